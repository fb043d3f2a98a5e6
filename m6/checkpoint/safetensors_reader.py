"""Reading a Hugging Face model directory's safetensors shards one tensor at a time.

Each shard's header (an 8-byte little-endian length, then JSON ``{name: {"dtype", "shape",
"data_offsets"}}``, see m6.checkpoint.export) is read and checked when the directory is opened:
valid JSON, known dtypes, offsets that match the shapes and lie inside the file. So a truncated or
damaged shard is an error naming the file before anything is written. ``read(name)`` then seeks to
one tensor's bytes and reads them alone: at most one tensor is in memory per call.

Which shard holds a tensor comes from ``model.safetensors.index.json`` (``weight_map``) when there
is one, else from the headers of every ``*.safetensors`` file in the directory.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from m6.checkpoint.errors import CheckpointMismatch
from m6.checkpoint.export import SAFETENSORS_DTYPES

INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: its file, dtype, shape and absolute byte range."""

    file: Path
    dtype: torch.dtype
    shape: torch.Size
    begin: int
    end: int


class SafetensorsReader:
    """The tensors of the safetensors shards in ``directory``, by name, read one at a time."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        files = self._shard_files()
        self.entries: dict[str, TensorEntry] = {}
        for file in files:
            for name, entry in read_header(file).items():
                if name in self.entries:
                    raise CheckpointMismatch(f"{file}: tensor {name} is also in {self.entries[name].file}")
                self.entries[name] = entry

    def _shard_files(self) -> list[Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                names = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointMismatch(f"{index} is not a safetensors index (no weight_map of tensor -> file: "
                                         f"{type(e).__name__}: {e})") from e
            missing = [n for n in names if not (self.directory / n).is_file()]
            if missing:
                raise CheckpointMismatch(f"{self.directory / missing[0]} is missing: {INDEX_FILE} maps tensors to it")
            return [self.directory / n for n in names]
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise CheckpointMismatch(f"{self.directory} holds no *.safetensors file (pytorch_model.bin checkpoints: "
                                     f"load and save_pretrained them with transformers first)")
        return files

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> torch.Size:
        return self.entries[name].shape

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name``, read alone from its shard (a fresh CPU tensor of its saved dtype)."""
        entry = self.entries[name]
        with open(entry.file, "rb") as f:
            f.seek(entry.begin)
            data = bytearray(entry.end - entry.begin)
            if f.readinto(data) != len(data):
                raise CheckpointMismatch(f"{entry.file} is truncated: tensor {name} ends past the end of the file")
        if not data:
            return torch.empty(entry.shape, dtype=entry.dtype)
        return torch.frombuffer(data, dtype=entry.dtype).reshape(entry.shape)


def read_header(file: Path) -> dict[str, TensorEntry]:
    """The tensors one shard holds, with their header checked against the file (see module doc)."""
    if sys.byteorder != "little":
        raise CheckpointMismatch("safetensors stores little-endian bytes; m6 reads them on little-endian hosts only")
    size = file.stat().st_size
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointMismatch(f"{file} is truncated ({size} bytes): not even a safetensors header length")
        n = int.from_bytes(prefix, "little")
        if n > _MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointMismatch(f"{file} is truncated or not safetensors: its header claims {n:,} bytes, the "
                                     f"file has {size:,}")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointMismatch(f"{file} is not safetensors: its header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointMismatch(f"{file} is not safetensors: its header is not a JSON object")
    entries, data_start = {}, 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = torch.Size(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointMismatch(f"{file}: tensor {name} has an unreadable header entry {info!r} "
                                     f"({type(e).__name__}: {e})") from e
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointMismatch(f"{file}: tensor {name} spans {end - begin} bytes, its shape {list(shape)} "
                                     f"{info['dtype']} needs {math.prod(shape) * dtype.itemsize}")
        if data_start + end > size:
            raise CheckpointMismatch(f"{file} is truncated: {size:,} bytes, tensor {name} ends at byte "
                                     f"{data_start + end:,}")
        entries[name] = TensorEntry(file, dtype, shape, data_start + begin, data_start + end)
    return entries
