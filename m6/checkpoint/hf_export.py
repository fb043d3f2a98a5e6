"""An m6 checkpoint's text model as a Hugging Face model directory (``export --format hf``).

    python -m m6.checkpoint export PATH OUT_DIR --format hf [--dtype fp32|bf16]

OUT_DIR gets ``config.json`` and ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors``
shards and ``model.safetensors.index.json`` past ``max_shard_bytes``), in the per-expert layout
published checkpoints use, which transformers' ``AutoModelForCausalLM.from_pretrained`` loads as
the matching architecture. The family follows from the saved model config
(m6.checkpoint.hf_families.family_of_m6); an m6 option the family cannot hold is an error naming
the config key. Streamed: each m6 tensor is read from the checkpoint alone and written out as its
HF tensors (a stacked expert tensor as one tensor per expert).

The image side (patch embedding and positions) has no place in a text-only causal LM and is left
out (the summary names it); the modality vector m6 adds to every text embedding is folded into
``embed_tokens`` (with tied embeddings it must be zero, as import-hf leaves it, since the LM head
shares that matrix).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import torch

import m6.checkpoint.sharded_io as sharded_io
from m6.checkpoint.errors import CheckpointError, CheckpointMismatch
from m6.checkpoint.export import EXPORT_DTYPES, read_tensor, safetensors_header
from m6.checkpoint.hf_families import TensorMap, expected_hf_shapes, family_of_m6, tensor_maps
from m6.checkpoint.info import MODEL, read_values
from m6.checkpoint.reader import find_checkpoint, load_metadata
from m6.checkpoint.step_dirs import written_whole
from m6.config import ConfigError, ModelConfig, to_dict
from m6.config_loader import from_dict

_IMAGE_SIDE = ("patch_embed.", "modality.weight")
_TEXT = 1  # m6.model.m6_model.TEXT: the modality row added to text embeddings
_TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                      torch.float64: "float64"}


def hf_tensors(tmap: TensorMap, t: torch.Tensor) -> list[torch.Tensor]:
    """The HF tensors one m6 tensor becomes (the inverse of hf_import.assemble)."""
    if tmap.kind == "copy":
        return [t]
    if tmap.kind == "rows":
        return list(t.split(list(tmap.rows), dim=0))
    return [t[j].t().contiguous() for j in range(t.shape[0])]


def export_hf(path: str | Path, out_dir: str | Path, dtype: Optional[str] = None,
              max_shard_bytes: int = 5 * 2**30) -> dict[str, Any]:
    """Write the checkpoint ``path``'s text model to ``out_dir`` as a Hugging Face model directory
    (see the module docstring). Returns a summary: path, out, step, architecture, tensors, bytes,
    files, dropped (m6 tensors with no HF place)."""
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(EXPORT_DTYPES)} or None, got {dtype!r}")
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CheckpointMismatch(f"{out_dir} exists and is not an empty directory: export --format hf writes a new "
                                 f"directory")
    ckpt = find_checkpoint(path)
    metadata = load_metadata(ckpt)
    values = read_values(ckpt, metadata, ("counters/step", "meta/config"))
    saved_model = values.get("meta", {}).get("config", {}).get("model")
    if saved_model is None:
        raise CheckpointMismatch(f"checkpoint {ckpt} holds no model config (meta/config): its architecture is unknown")
    try:
        cfg = from_dict(ModelConfig, saved_model, "model")
        m = to_dict(cfg)  # defaults filled in
    except ConfigError as e:
        raise CheckpointMismatch(f"checkpoint {ckpt}: its saved model config does not load: {e}") from e
    family = family_of_m6(m)
    hf_config = family.to_hf(m)
    saved = {k[len(MODEL):]: md for k, md in sharded_io.tensor_keys(metadata).items() if k.startswith(MODEL)}
    maps = tensor_maps(family, cfg)
    missing = [t.m6 for t in maps if t.m6 not in saved]
    if missing:
        raise CheckpointMismatch(f"checkpoint {ckpt} has no tensor model/{missing[0]}, which a {family.name} model needs")
    covered = {t.m6 for t in maps}
    dropped = [n for n in saved if n not in covered]
    unexpected = [n for n in dropped if not n.startswith(_IMAGE_SIDE)]
    if unexpected:
        raise CheckpointMismatch(f"checkpoint {ckpt}: tensor model/{unexpected[0]} has no place in a {family.name} "
                                 f"model")

    cast = EXPORT_DTYPES[dtype] if dtype else None
    out_dtypes = {t.m6: cast if cast is not None else saved[t.m6].properties.dtype for t in maps}
    if len(set(out_dtypes.values())) > 1:
        raise CheckpointMismatch(f"checkpoint {ckpt} holds weights of several dtypes; pass --dtype fp32 or bf16")
    out_dtype = next(iter(out_dtypes.values()))
    modality = _text_modality(ckpt, saved, m)

    # Shards: whole m6 tensors per file (their HF tensors together), a new file past max_shard_bytes.
    files: list[list[TensorMap]] = [[]]
    size = 0
    for tmap in maps:
        nbytes = math.prod(saved[tmap.m6].size) * out_dtype.itemsize
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(tmap)
        size += nbytes
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])

    total, weight_map = 0, {}
    with written_whole(out_dir) as tmp:
        for name, group in zip(names, files):
            entries = {}
            for tmap in group:
                for hf_name, shape in zip(tmap.hf, expected_hf_shapes(tmap, saved[tmap.m6].size)):
                    entries[hf_name] = (out_dtype, shape)
                    weight_map[hf_name] = name
            with open(tmp / name, "wb") as f:
                f.write(safetensors_header(entries, {"format": "pt"}))
                for tmap in group:
                    t = read_tensor(ckpt, MODEL + tmap.m6, saved[tmap.m6])
                    if tmap.m6 == "text_embed.tokens.weight" and modality is not None:
                        t = t + modality.to(t.dtype)  # m6 adds it to every text token's embedding
                    for part in hf_tensors(tmap, t.to(out_dtype)):
                        f.write(part.contiguous().reshape(-1).view(torch.uint8).numpy())
                    del t
                total += f.tell()
        if len(names) > 1:
            index = {"metadata": {"total_size": sum(math.prod(s) * d.itemsize for d, s in
                                                    ((out_dtype, saved[t.m6].size) for t in maps))},
                     "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        hf_config["torch_dtype"] = hf_config["dtype"] = _TORCH_DTYPE_NAMES[out_dtype]
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
    step = values.get("counters", {}).get("step")
    return {"path": str(ckpt), "out": str(out_dir), "step": step, "architecture": family.architecture,
            "num_tensors": len(weight_map), "size_bytes": total, "files": names, "dropped": dropped}


def _text_modality(ckpt: Path, saved: dict, m: dict) -> Optional[torch.Tensor]:
    """The modality vector m6 adds to text embeddings (None when zero, as import-hf leaves it)."""
    if "modality.weight" not in saved:
        return None
    row = read_tensor(ckpt, MODEL + "modality.weight", saved["modality.weight"])[_TEXT].to(torch.float32)
    if not row.any():
        return None
    if m["tie_embeddings"]:
        raise CheckpointError(f"checkpoint {ckpt}: model.tie_embeddings=true with a non-zero text modality vector "
                              f"(model/modality.weight[1]) has no Hugging Face equivalent: the vector would have to "
                              f"join the input embeddings, which the LM head shares")
    return row
