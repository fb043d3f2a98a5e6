"""Does a checkpoint fit this run: its keys and global shapes against the model's, and the config
keys that changed since it was saved (for error messages that say what to change)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from m6.checkpoint.errors import CheckpointError
from m6.checkpoint.reader import MAX_LISTED_DIFFS, load_metadata


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def changed_keys(saved: dict, current: dict, prefixes: tuple[str, ...]) -> list[str]:
    """Config keys under ``prefixes`` whose values differ between the saving run and this one,
    each with both values."""
    before, now = _flat(saved), _flat(current)
    return [f"{k}: {before.get(k)!r} at save, {now.get(k)!r} now" for k in sorted(set(before) | set(now))
            if k.startswith(prefixes) and before.get(k) != now.get(k)
            and k not in ("data.num_workers", "data.prefetch_factor")]


def checkpoint_keys(path: Path) -> dict[str, Any]:
    """Flat key -> global shape (tensors) or None (python values) of a checkpoint on disk."""
    md = load_metadata(path)
    return {k: (v.size if hasattr(v, "size") else None) for k, v in md.state_dict_metadata.items()}


def shape_differences(expected: dict[str, torch.Size], saved: dict[str, torch.Size]) -> list[str]:
    """Shape mismatches, then keys missing from and unexpected in the checkpoint."""
    diffs = [f"{k}: checkpoint {list(saved[k])} vs model {list(v)}" for k, v in expected.items()
             if k in saved and saved[k] is not None and torch.Size(saved[k]) != v]
    diffs += [f"missing in checkpoint: {k}" for k in expected if k not in saved]
    diffs += [f"unexpected in checkpoint: {k}" for k in saved if k not in expected]
    return diffs


def _describe_differences(model_sd: dict, ckpt_sd: dict) -> list[str]:
    """List shape mismatches, then keys missing from and unexpected in the checkpoint."""
    diffs = []
    for key, value in model_sd.items():
        other = ckpt_sd.get(key)
        if isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor) and value.shape != other.shape:
            diffs.append(f"{key}: checkpoint {list(other.shape)} vs model {list(value.shape)}")
    diffs += [f"missing in checkpoint: {key}" for key in model_sd if key not in ckpt_sd]
    diffs += [f"unexpected in checkpoint: {key}" for key in ckpt_sd if key not in model_sd]
    return diffs


def load_model_state(model: torch.nn.Module, state_dict: dict, source: str) -> None:
    """Load `state_dict` into `model` strictly, refusing up front (nothing loaded) if keys or shapes differ."""
    diffs = _describe_differences(model.state_dict(), state_dict)
    if diffs:
        shown = "\n  ".join(diffs[:MAX_LISTED_DIFFS])
        more = f"\n  ... and {len(diffs) - MAX_LISTED_DIFFS} more" if len(diffs) > MAX_LISTED_DIFFS else ""
        raise CheckpointError(
            f"checkpoint{' ' + source if source else ''} was written for a different model shape "
            f"({len(diffs)} difference(s)); check the model config matches the run that saved it:\n"
            f"  {shown}{more}"
        )
    model.load_state_dict(state_dict, strict=True)
