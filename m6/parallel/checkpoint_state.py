"""Layout-free checkpoint state: expert tensors stored whole, indexed by global expert id.

Saving gathers each expert parameter (and its optimizer moments) over the expert-parallel group to
rank 0, which writes the same format a single process writes (one process: nothing to gather). Loading slices this rank's experts
[first, first + local) out of it. So a checkpoint saved at one (world size, EP size) loads at any
other valid one, single process included. Rank 0 holds one full copy while saving: fine up to
models whose states fit in one host's memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from m6.parallel.plan import ShardedModel


def _optimizer_index(optimizer: torch.optim.Optimizer, model: nn.Module,
                     names: dict[int, str] | None = None) -> dict[str, int]:
    """Param name -> its integer key in optimizer.state_dict()['state'].

    ``names``: id of each tensor the optimizer updates -> the model parameter's name, for an
    optimizer over copies (offloaded host masters); default: the model's own parameters.
    """
    name_of = names if names is not None else {id(p): n for n, p in model.named_parameters()}
    index, i = {}, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            index[name_of[id(p)]] = i
            i += 1
    return index


def _gather_rows(t: torch.Tensor, group, size: int) -> torch.Tensor | None:
    """Concatenate ``t`` over the group's ``size`` ranks along dim 0 on the group's first rank."""
    if size == 1:
        return t
    first = dist.get_global_rank(group, 0)
    parts = [torch.empty_like(t) for _ in range(size)] if dist.get_rank() == first else None
    dist.gather(t.contiguous(), parts, dst=first, group=group)
    return torch.cat(parts) if parts is not None else None


def full_model_state(sharded: ShardedModel) -> dict | None:
    """The model's state dict with whole expert tensors, on global rank 0 (None elsewhere).

    Every rank must call it (collectives inside).
    """
    groups = sharded.groups
    model_sd = {k: v.detach().cpu() for k, v in sharded.model.state_dict().items()}
    for name in sharded.expert_params:
        full = _gather_rows(model_sd[name], groups.expert, groups.layout.expert_parallel_size)
        if full is not None:
            model_sd[name] = full
    return model_sd if groups.layout.rank == 0 else None


def full_optimizer_state(sharded: ShardedModel, optimizer: torch.optim.Optimizer,
                         names: dict[int, str] | None = None) -> dict | None:
    """The optimizer's state dict with whole expert moments, on global rank 0 (None elsewhere).

    ``names``: see _optimizer_index. Every rank must call it (collectives inside).
    """
    groups = sharded.groups
    optim_sd = optimizer.state_dict()
    index = _optimizer_index(optimizer, sharded.model, names)
    for name in sharded.expert_params:
        state = optim_sd["state"].get(index[name], {})
        moments = {k: _gather_rows(v.detach().cpu(), groups.expert, groups.layout.expert_parallel_size)
                   for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}
        if groups.layout.rank == 0:
            optim_sd["state"][index[name]] = {**state, **moments}
    return optim_sd if groups.layout.rank == 0 else None


def _expert_rows(sharded: ShardedModel, name: str, saved: torch.Tensor) -> slice | None:
    """This rank's rows of a whole expert tensor; None when the saved tensor cannot hold them (a
    different expert count: load_model_state reports the shape mismatch)."""
    first, count = sharded.first_expert(name), sharded.expert_params[name].shape[0]
    return slice(first, first + count) if saved.shape[0] >= first + count else None


def local_model_state(sharded: ShardedModel, model_sd: dict) -> dict:
    """Slice this rank's experts out of a layout-free model state dict."""
    model_sd = dict(model_sd)
    for name in sharded.expert_params:
        if name not in model_sd:
            continue  # load_model_state reports missing keys
        rows = _expert_rows(sharded, name, model_sd[name])
        if rows is not None:
            model_sd[name] = model_sd[name][rows]
    return model_sd


def local_optimizer_state(sharded: ShardedModel, optimizer: torch.optim.Optimizer, optim_sd: dict,
                          names: dict[int, str] | None = None) -> dict:
    """Slice this rank's experts' moments out of a layout-free optimizer state dict."""
    optim_sd = {**optim_sd, "state": dict(optim_sd["state"])}
    index = _optimizer_index(optimizer, sharded.model, names)
    for name in sharded.expert_params:
        state = optim_sd["state"].get(index[name])
        if state is None:
            continue
        moments = [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
        rows = _expert_rows(sharded, name, moments[0]) if moments else None
        if rows is not None:
            optim_sd["state"][index[name]] = {
                k: (v[rows] if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in state.items()}
    return optim_sd
