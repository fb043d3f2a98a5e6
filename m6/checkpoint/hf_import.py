"""A Hugging Face MoE model directory (config.json + safetensors shards) as an m6 checkpoint.

    python -m m6.checkpoint import-hf HF_DIR OUT_DIR [--dtype fp32|bf16] [--seed N]

OUT_DIR gets ``config.yaml`` (the m6 config: the translated ``model`` section, and
``checkpoint.init_from`` naming the imported checkpoint) and ``checkpoints/step_00000000``: a
weights-only m6 checkpoint (``model/`` tensors, ``meta/config``), which ``checkpoint.init_from``
reads at any world size and expert-parallel size (continued pretraining then saves and resumes
like any run), and which ``m6.checkpoint.load_model`` loads for evaluation.

Everything is checked before anything is written (config fields m6 cannot express, damaged or
truncated shards, every tensor's name and shape), and the output is written into a temporary
directory renamed into place: a failed import leaves nothing behind. Tensors are streamed: each
m6 tensor is assembled from its HF tensors when the checkpoint writer reaches it (one MoE layer's
stacked experts at most), so a model larger than memory imports.

m6 tensors with no HF counterpart (the image side: patch embedding, the modality embedding) start
as m6 initialises them, except the modality embedding, which starts at zero so the text path
computes exactly what the HF model does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

import m6.checkpoint.sharded_io as sharded_io
from m6.checkpoint.errors import CheckpointMismatch
from m6.checkpoint.export import EXPORT_DTYPES
from m6.checkpoint.hf_families import HFFamily, TensorMap, expected_hf_shapes, tensor_maps, to_m6_model
from m6.checkpoint.safetensors_reader import SafetensorsReader
from m6.checkpoint.state_tree import flatten
from m6.checkpoint.step_dirs import step_dir_name, written_whole
from m6.config import Config, ConfigError, ModelConfig, dump_yaml, to_dict
from m6.config_loader import from_dict
from m6.model.m6_model import build_meta_model

CONFIG_FILE = "config.json"
_IGNORED_HF = ("rotary_emb.inv_freq",)  # buffers some old exports saved; recomputed from rope_theta
_ZERO_INIT = ("modality.weight",)  # added to every text embedding: zero keeps the HF model's text path


def read_hf_config(hf_dir: Path) -> dict:
    """config.json of ``hf_dir`` as a dict (an error naming the file when it is missing or not JSON)."""
    file = hf_dir / CONFIG_FILE
    if not file.is_file():
        raise CheckpointMismatch(f"{file} does not exist: {hf_dir} is not a Hugging Face model directory")
    try:
        hf = json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointMismatch(f"{file} is not JSON: {e}") from e
    if not isinstance(hf, dict):
        raise CheckpointMismatch(f"{file} is not a JSON object")
    return hf


def hf_model_config(hf: dict, source: str) -> tuple[HFFamily, ModelConfig]:
    """config.json -> (family, m6 ModelConfig, validated)."""
    family, model = to_m6_model(hf, source)
    try:
        cfg = from_dict(ModelConfig, model, "model")
        cfg.validate()
    except ConfigError as e:
        raise CheckpointMismatch(f"{source}: the translated m6 config is invalid: {e}") from e
    return family, cfg


def assemble(tmap: TensorMap, reader: SafetensorsReader, dtype: torch.dtype) -> torch.Tensor:
    """The m6 tensor ``tmap`` names, read from its HF tensors one at a time."""
    if tmap.kind == "copy":
        return reader.read(tmap.hf[0]).to(dtype)
    if tmap.kind == "rows":
        return torch.cat([reader.read(name).to(dtype) for name in tmap.hf], dim=0)
    first = reader.shape(tmap.hf[0])
    out = torch.empty(len(tmap.hf), first[1], first[0], dtype=dtype)
    for j, name in enumerate(tmap.hf):
        out[j].copy_(reader.read(name).t())
    return out


def plan_import(family: HFFamily, cfg: ModelConfig, reader: SafetensorsReader
                ) -> tuple[dict[str, torch.Size], dict[str, TensorMap], list[str]]:
    """(m6 tensor shapes, the maps that fill them, the m6 tensors with no HF counterpart), after
    checking that every HF tensor is there with the shape the config implies and that every HF
    tensor has a place in m6."""
    shapes = {name: t.shape for name, t in build_meta_model(cfg).state_dict().items()}
    maps = {t.m6: t for t in tensor_maps(family, cfg)}
    used = set()
    for tmap in maps.values():
        if tmap.m6 not in shapes:
            raise AssertionError(f"hf_families maps {tmap.m6}, which the m6 model does not have")
        for name, want in zip(tmap.hf, expected_hf_shapes(tmap, shapes[tmap.m6])):
            if name not in reader.entries:
                raise CheckpointMismatch(f"{reader.directory}: tensor {name} is missing (its config.json implies it)")
            entry = reader.entries[name]
            if entry.shape != want:
                raise CheckpointMismatch(f"{entry.file}: tensor {name} has shape {list(entry.shape)}, its config.json "
                                         f"implies {list(want)} (for m6's {tmap.m6})")
            used.add(name)
    extra = [n for n in reader.names() if n not in used and not n.endswith(_IGNORED_HF)]
    if extra:
        raise CheckpointMismatch(f"{reader.entries[extra[0]].file}: tensor {extra[0]} has no place in m6's "
                                 f"{family.name} model ({len(extra)} such tensor(s))")
    fresh = [name for name in shapes if name not in maps]
    return shapes, maps, fresh


def fresh_tensor(name: str, shape: torch.Size, dtype: torch.dtype, init_std: float, seed: int) -> torch.Tensor:
    """An m6 tensor the HF model has no counterpart for, initialised as m6 initialises it
    (normal(0, init_std) weights, zero biases, unit norm scales), from its own seeded generator."""
    if name.endswith(".bias") or name in _ZERO_INIT:
        return torch.zeros(shape, dtype=dtype)
    if "norm" in name.rsplit(".", 2)[-2]:
        return torch.ones(shape, dtype=dtype)
    g = torch.Generator().manual_seed(seed * 1_000_003 + sum(name.encode()))
    return (torch.randn(shape, generator=g) * init_std).to(dtype)


def import_hf(hf_dir: str | Path, out_dir: str | Path, dtype: str = "fp32", seed: int = 0,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Import the Hugging Face model in ``hf_dir`` into ``out_dir`` (see the module docstring).
    Returns a summary: family, out, checkpoint, tensors, fresh (m6 tensors initialised here)."""
    hf_dir, out_dir = Path(hf_dir).expanduser(), Path(out_dir).expanduser()
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
    torch_dtype = EXPORT_DTYPES[dtype]
    if out_dir.exists() and any(out_dir.iterdir()):
        raise CheckpointMismatch(f"{out_dir} exists and is not empty: import-hf writes a new directory")
    hf = read_hf_config(hf_dir)
    family, cfg = hf_model_config(hf, str(hf_dir / CONFIG_FILE))
    reader = SafetensorsReader(hf_dir)
    shapes, maps, fresh = plan_import(family, cfg, reader)

    config = Config(model=cfg)
    step_dir = out_dir / "checkpoints" / step_dir_name(0)
    config.checkpoint.init_from = str(step_dir)
    state = flatten({"model": {name: torch.empty(shape, dtype=torch_dtype, device="meta")
                               for name, shape in shapes.items()},
                     # Written whole by one process: every expert in one chunk (any layout reads it).
                     "meta": {"config": to_dict(config), "world_size": 1, "expert_parallel_size": 1,
                              "imported_from": {"path": str(hf_dir), "architecture": family.architecture}},
                     "counters": {"step": 0}})

    def produce(key: str) -> torch.Tensor:
        name = key[len("model/"):]
        if name in maps:
            return assemble(maps[name], reader, torch_dtype)
        return fresh_tensor(name, shapes[name], torch_dtype, cfg.init_std, seed)

    with written_whole(out_dir) as tmp:
        (tmp / "checkpoints").mkdir()
        sharded_io.write_streamed(tmp / "checkpoints" / step_dir_name(0), state, produce)
        dump_yaml(config, tmp / "config.yaml")
    return {"family": family.name, "out": str(out_dir), "checkpoint": str(step_dir),
            "num_tensors": len(shapes), "fresh": fresh}
