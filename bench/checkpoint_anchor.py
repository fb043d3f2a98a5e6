"""The anchor for bench.checkpoint: m6's previous checkpoint design, removed from m6 in bf1ac67 and
kept here only to be measured against (never used by training).

Save: every expert parameter and its Adam moments are gathered with ``dist.gather`` over the
expert-parallel group to the group's first rank (as the old ``m6/parallel/checkpoint_state.py``
did: with EP < world every EP group's first rank gathers), and global rank 0 ``torch.save``'s ONE
file holding everything (model state dict with whole expert tensors, optimizer state, the other
Stateful pieces), fsyncs it and renames it into place; then a barrier. Load: EVERY rank
``torch.load``'s the whole file and slices its experts out.

One deliberate difference, in the anchor's favour: the old code handed the sliced moments to
``optimizer.load_state_dict``, whose ``value.to(dtype, device)`` returns the slice itself, a view
that keeps the whole loaded tensor alive; here the rows are copied into the trainer's existing
tensors and the loaded file is dropped, so the anchor's load peak is its best case.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from m6.train.loop import Trainer


def _gather_rows(t: torch.Tensor, tr: Trainer) -> torch.Tensor | None:
    """``t`` concatenated over the expert-parallel group along dim 0, on the group's first rank."""
    groups = tr.sharded.groups
    size = groups.layout.expert_parallel_size
    if size == 1:
        return t
    first = dist.get_global_rank(groups.expert, 0)
    parts = [torch.empty_like(t) for _ in range(size)] if dist.get_rank() == first else None
    dist.gather(t.contiguous(), parts, dst=first, group=groups.expert)
    return torch.cat(parts) if parts is not None else None


def _tensors(tr: Trainer) -> dict[str, torch.Tensor]:
    """model/<name> and optimizer/<name>/<moment>: this rank's tensors (shared storage)."""
    out = {f"model/{k}": v for k, v in tr.state.model.tensors().items()}
    for name, state in tr.state.optimizer.tensors().items():
        out.update({f"optimizer/{name}/{k}": v for k, v in state.items()})
    return out


def _param_name(key: str) -> str:
    return key.split("/")[1]


def anchor_save(tr: Trainer, path: Path) -> None:
    """Gather experts to rank 0, which writes one file with everything (a collective)."""
    whole = {}
    for key, t in _tensors(tr).items():
        if _param_name(key) in tr.sharded.expert_params and t.dim() > 0:
            t = _gather_rows(t, tr)  # every rank, same order: a collective per tensor
        whole[key] = t
    values = {name: piece.state_dict() for name, piece in tr.state.values.items()}  # collectives inside
    if tr.rank == 0:
        state = {"tensors": whole, "values": values, "param_groups": tr.state.optimizer.hyperparameters(),
                 "rng": tr.state.rng.state_dict(), "meta": tr.state.metadata}
        tmp = path.with_name(f".tmp-{path.name}")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    del whole
    if dist.is_initialized():
        dist.barrier()


def anchor_load(tr: Trainer, path: Path) -> None:
    """Every rank reads the whole file and copies its experts' rows (and everything else) in place."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    for key, t in _tensors(tr).items():
        saved = state["tensors"][key]
        name = _param_name(key)
        if name in tr.sharded.expert_params and t.dim() > 0:
            first = tr.sharded.first_expert(name)
            saved = saved[first:first + t.shape[0]]
        t.copy_(saved)
    tr.state.optimizer.load_hyperparameters(state["param_groups"])
    for name, piece in tr.state.values.items():
        piece.load_state_dict(state["values"][name])
    del state
