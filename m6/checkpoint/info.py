"""What a checkpoint holds, from its metadata and its small python values (never its tensors):
step, the layout it was saved at, the model it belongs to, its size on disk."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable

from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

import m6.checkpoint.sharded_io as sharded_io
from m6.checkpoint.reader import find_checkpoint, load_metadata, raise_read_failure
from m6.checkpoint.state_tree import unflatten

MODEL = "model/"


def read_values(ckpt: Path, metadata: Metadata, prefixes: Iterable[str]) -> dict[str, Any]:
    """The python values saved under ``prefixes`` (nested, as saved); tensors are not read."""
    wanted = {k: None for k in sharded_io.value_keys(metadata) if k.startswith(tuple(prefixes))}
    if not wanted:
        return {}
    try:
        sharded_io.read(ckpt, wanted, {})
    except (Exception, CheckpointException) as e:  # DCP's own error is a BaseException
        raise_read_failure(ckpt, e)
    return unflatten(wanted)


def checkpoint_info(path: str | Path) -> dict[str, Any]:
    """A summary of the checkpoint ``path`` names (see the module docstring for the forms of ``path``)."""
    ckpt = find_checkpoint(path)
    metadata = load_metadata(ckpt)
    tensors = sharded_io.tensor_keys(metadata)
    weights = {k[len(MODEL):]: md for k, md in tensors.items() if k.startswith(MODEL)}
    values = read_values(ckpt, metadata, ("counters/", "meta/"))
    meta, counters = values.get("meta", {}), values.get("counters", {})
    model_cfg = meta.get("config", {}).get("model", {})
    files = [p for p in ckpt.iterdir() if p.is_file()]
    return {
        "path": str(ckpt),
        "step": counters.get("step"),
        "world_size": meta.get("world_size"),
        "expert_parallel_size": meta.get("expert_parallel_size"),
        "model": model_cfg,  # the saved config's model section (nested dict), {} if absent
        "num_moe_layers": sum(1 for name in weights if name.endswith(".experts.w_in")),
        "total_params": sum(math.prod(md.size) for md in weights.values()),
        "expert_params": sum(math.prod(md.size) for name, md in weights.items() if ".experts." in name),
        "dtypes": sorted({str(md.properties.dtype).removeprefix("torch.") for md in weights.values()}),
        "has_optimizer_state": any(k.startswith("optimizer/state/") for k in tensors),
        "size_bytes": sum(p.stat().st_size for p in files),
        "num_data_files": sum(1 for p in files if p.suffix == ".distcp"),
    }


def format_info(info: dict[str, Any]) -> str:
    """The summary as aligned lines for the console."""
    m = info["model"]
    moe = m.get("moe", {})
    layers = m.get("num_layers")
    lines = [
        ("checkpoint", info["path"]),
        ("step", _or_unknown(info["step"])),
        ("saved at", f"world size {_or_unknown(info['world_size'])}, expert-parallel size "
                     f"{_or_unknown(info['expert_parallel_size'])}"),
        ("model", f"d_model {_or_unknown(m.get('d_model'))}, {_or_unknown(layers)} layers, "
                  f"{_or_unknown(m.get('num_heads'))} heads, ffn {_or_unknown(m.get('ffn_dim'))}, "
                  f"vocab {_or_unknown(m.get('vocab_size'))}"),
        ("experts", f"{_or_unknown(moe.get('num_experts'))} per MoE layer (top-{_or_unknown(moe.get('top_k'))}) in "
                    f"{info['num_moe_layers']} of {_or_unknown(layers)} layers" if info["num_moe_layers"]
                    else "none (dense model)"),
        ("parameters", f"{info['total_params']:,} ({info['expert_params']:,} in experts), "
                       f"{'/'.join(info['dtypes']) or 'no tensors'}"),
        ("optimizer state", "yes" if info["has_optimizer_state"] else "no"),
        ("on disk", f"{info['size_bytes']:,} bytes ({_human_bytes(info['size_bytes'])}) in "
                    f"{info['num_data_files']} data file{'' if info['num_data_files'] == 1 else 's'} "
                    f"+ {sharded_io.METADATA_FILE}"),
    ]
    return "\n".join(f"{key:<16} {value}" for key, value in lines)


def _or_unknown(value: Any) -> str:
    return "?" if value is None else str(value)


def _human_bytes(n: float) -> str:
    for scale, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
