"""A checkpoint's model weights as one consolidated safetensors file, streamed tensor by tensor.

The safetensors layout: an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`` (padded
with spaces so the data starts 8-byte aligned), then every tensor's raw little-endian bytes in
offset order. The header is computed from the DCP metadata alone (names, global shapes, dtypes),
then each tensor is read from the checkpoint on its own (at its global shape: experts under their
global ids, whatever layout saved them) and appended, so at most one tensor (and its cast) is in
memory at a time.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import CheckpointException

from m6.checkpoint.info import MODEL, read_values
import m6.checkpoint.sharded_io as sharded_io
from m6.checkpoint.errors import CheckpointError
from m6.checkpoint.reader import find_checkpoint, load_metadata, raise_read_failure

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def safetensors_header(entries: dict[str, tuple[torch.dtype, torch.Size]], metadata: dict[str, str]) -> bytes:
    """The length prefix and JSON header for tensors ``entries`` (name -> (dtype, shape)), laid out
    in the given order; the data section that follows is their bytes back to back."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, (dtype, shape) in entries.items():
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"tensor {name} has dtype {dtype}, which this export does not write")
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def export_safetensors(path: str | Path, out: str | Path, dtype: Optional[str] = None) -> dict[str, Any]:
    """Write the model weights of the checkpoint ``path`` to ``out`` (keys without the ``model/``
    prefix; ``dtype`` fp32/bf16 casts floating-point tensors, None keeps the saved dtypes).
    Written to a temporary file renamed into place. Returns a summary: path, step, tensors, bytes."""
    if sys.byteorder != "little":
        raise CheckpointError("safetensors stores little-endian bytes; export runs on little-endian hosts only")
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(EXPORT_DTYPES)} or None, got {dtype!r}")
    cast = EXPORT_DTYPES.get(dtype) if dtype else None
    ckpt = find_checkpoint(path)
    metadata = load_metadata(ckpt)
    saved = {k: md for k, md in sorted(sharded_io.tensor_keys(metadata).items()) if k.startswith(MODEL)}
    if not saved:
        raise CheckpointError(f"checkpoint {ckpt} holds no model weights (no {MODEL} keys)")
    entries = {}
    for key, md in saved.items():
        src = md.properties.dtype
        entries[key[len(MODEL):]] = (cast if cast is not None and src.is_floating_point else src, md.size)
    values = read_values(ckpt, metadata, ("counters/step", "meta/config"))
    step = values.get("counters", {}).get("step")
    header = safetensors_header(entries, export_metadata(ckpt, step, values.get("meta", {}).get("config")))

    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            for key, md in saved.items():
                t = read_tensor(ckpt, key, md)
                t = t.to(entries[key[len(MODEL):]][0]).reshape(-1)
                f.write(t.view(torch.uint8).numpy())  # raw bytes, host order (little-endian: checked above)
                del t
            size = f.tell()
        expected = len(header) + sum(math.prod(s) * d.itemsize for d, s in entries.values())
        assert size == expected, (size, expected)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"path": str(ckpt), "out": str(out), "step": step, "num_tensors": len(entries), "size_bytes": size}


def export_metadata(ckpt: Path, step: Any, config: Optional[dict]) -> dict[str, str]:
    """The ``__metadata__`` of an export (safetensors allows str -> str only): where the weights
    come from, and what they are: the saved run's resolved config as JSON (``config``; its
    ``model`` section builds the model the weights fit) and the tokenizer its token ids belong to
    (``tokenizer``: data.tokenizer's path, or ``byte`` for m6's byte tokenizer). A checkpoint saved
    without a config (none written by m6 today) exports without those two keys."""
    metadata = {"format": "pt", "source": str(ckpt), "step": str(step)}
    if config is not None:
        metadata["config"] = json.dumps(config, sort_keys=True, separators=(",", ":"))
        metadata["tokenizer"] = str(config.get("data", {}).get("tokenizer") or "byte")
    return metadata


def read_tensor(ckpt: Path, key: str, md) -> torch.Tensor:
    """One tensor of the checkpoint, whole (at its global shape), read alone."""
    t = torch.empty(md.size, dtype=md.properties.dtype)
    try:
        sharded_io.read(ckpt, {key: t}, {})
    except (Exception, CheckpointException) as e:  # DCP's own error is a BaseException
        raise_read_failure(ckpt, e)
    return t
