"""Per-rank memory and data-parallel traffic of ``parallel.shard`` (optimizer, full), as
m6.parallel.fsdp lays the model out: dense parameters sharded over all ranks, expert tensors over
the expert-data-parallel ranks, FSDP2 units = each MoE layer's experts, each block, the root.

A sharded tensor holds ceil(rows / degree) rows of dim 0 per rank (FSDP2 pads dim 0), so the
shards' bytes are those of meta tensors of that shape. What lives all the time: the fp32 shard of
every parameter and its two AdamW moments. Over a step, on top (an upper bound: the parts below
are added as if all were held at the same moment of backward):
  gathered parameters   full: the root (gathered for the whole step) + the two largest other
                        units (the one running and the one prefetched); optimizer: every unit
                        (gathered in forward, freed after its backward); in the gather dtype
                        (bf16 with train.precision bf16: FSDP2's MixedPrecisionPolicy);
  unsharded gradients   the two largest units' gradients in the gather dtype and their fp32
                        reduce-scatter input; with accumulation, every unit's (kept unsharded
                        between micro-batches) in fp32;
  sharded gradients     the fp32 shard of every gradient;
  activations           as without sharding (m6.memory.estimate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from m6.config import Config, accumulation_steps
from m6.memory.grouped_apply import split_apply_groups
from m6.moe import MoELayer


@dataclass(frozen=True)
class ShardLayout:
    """Element counts of one rank's sharded model: shards, FSDP2 units, shard degrees."""

    shard_numel: int  # elements of this rank's shards (padding rows included)
    num_tensors: int
    unit_numel: list[int]  # whole (gathered) elements of each non-root unit
    root_numel: int
    dense_numel: int  # whole elements of the dense (replicated) parameters
    expert_numel: int  # whole elements of this EP rank's experts
    largest_update_call: int  # elements of the largest foreach AdamW call over shards


def _shard_shape(p: nn.Parameter, degree: int) -> torch.Size:
    if p.dim() == 0:
        return p.shape
    return torch.Size([math.ceil(p.shape[0] / degree), *p.shape[1:]])


def shard_layout(cfg: Config, model: nn.Module, no_decay: set[int], world_size: int, ep: int) -> ShardLayout:
    """``model``: this rank's model (its experts only, on meta or real) before sharding."""
    edp = world_size // ep
    expert_ids = {id(p) for m in model.modules() if isinstance(m, MoELayer) for p in m.experts.parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    shards = {id(p): torch.empty(_shard_shape(p, edp if id(p) in expert_ids else world_size), device="meta")
              for p in params}
    units = []
    for block in getattr(model, "blocks", []):
        block_params = [p for p in block.parameters() if p.requires_grad]
        units.append(sum(p.numel() for p in block_params if id(p) not in expert_ids))
        units += [sum(p.numel() for p in m.experts.parameters()) for m in block.modules() if isinstance(m, MoELayer)]
    in_blocks = {id(p) for b in getattr(model, "blocks", []) for p in b.parameters()}
    replicated = [shards[id(p)] for p in params if id(p) not in expert_ids]
    experts = [shards[id(p)] for p in params if id(p) in expert_ids]
    groups = split_apply_groups(replicated, experts, cfg.optim.apply_groups) if cfg.optim.apply_groups > 1 \
        else [replicated + experts]
    decayed = {id(shards[id(p)]) for p in params if id(p) not in no_decay}
    largest = max((sum(t.numel() for t in g if (id(t) in decayed) == d) for g in groups for d in (True, False)),
                  default=0)
    return ShardLayout(
        shard_numel=sum(t.numel() for t in shards.values()), num_tensors=len(params), unit_numel=units,
        root_numel=sum(p.numel() for p in params if id(p) not in in_blocks),
        dense_numel=sum(p.numel() for p in params if id(p) not in expert_ids),
        expert_numel=sum(p.numel() for p in params if id(p) in expert_ids), largest_update_call=largest)


def gather_bytes(cfg: Config, device_type: str) -> int:
    """Bytes per element of a gathered parameter: bf16 when FSDP2's MixedPrecisionPolicy casts
    (train.precision bf16, or auto on CUDA), else the fp32 parameter itself."""
    precision = cfg.train.precision
    bf16 = precision == "bf16" or (precision == "auto" and device_type == "cuda")
    return 2 if bf16 else 4


def fused_update(cfg: Config, device_type: str) -> bool:
    """Whether the rank's update runs torch's fused AdamW (optim.implementation; auto: a CUDA device
    update), which keeps no step temporaries; an offloaded update runs on the host."""
    return cfg.optim.adamw_kernel(on_cuda=device_type == "cuda" and cfg.memory.offload == "none") == "fused"


def sharded_states(cfg: Config, layout: ShardLayout, world_size: int, device_type: str) -> dict[str, float]:
    """Bytes per component of one rank's sharded training state (names as m6.memory.estimate's)."""
    g = gather_bytes(cfg, device_type)
    two_largest = sum(sorted(layout.unit_numel, reverse=True)[:2])
    if cfg.parallel.shard == "full":
        gathered = g * (layout.root_numel + two_largest)
    else:
        gathered = g * (layout.root_numel + sum(layout.unit_numel))
    accumulating = accumulation_steps(cfg.train, world_size) > 1
    unsharded = (g + 4.0) * two_largest + (4.0 * (layout.dense_numel + layout.expert_numel) if accumulating else 0.0)
    return {
        "params": 4.0 * layout.shard_numel,
        "grads": 4.0 * layout.shard_numel,
        "optimizer state": 8.0 * layout.shard_numel + 4.0 * layout.num_tensors,
        "optimizer step temporaries": 0.0 if fused_update(cfg, device_type) else 4.0 * layout.largest_update_call,
        "gathered parameters": float(gathered),
        "unsharded gradients": float(unsharded),
    }


def data_parallel_traffic(cfg: Config, layout: ShardLayout, world_size: int, ep: int,
                          device_type: str) -> dict[str, float]:
    """Bytes of the tensors one rank gathers, reduce-scatters or all-reduces in one step (the
    collectives' outputs / inputs, not what a ring algorithm puts on the wire)."""
    g = gather_bytes(cfg, device_type)
    # Only what another rank also holds travels: dense over all ranks, experts over their EDP group.
    whole = layout.dense_numel * (world_size > 1) + layout.expert_numel * (world_size // ep > 1)
    if cfg.parallel.shard == "none":
        return {"all-gather": 0.0, "reduce-scatter": 0.0, "all-reduce": 4.0 * whole}
    non_root = whole - layout.root_numel * (world_size > 1)
    # full gathers every unit but the root twice (forward, then backward); optimizer once.
    gathers = g * (layout.root_numel * (world_size > 1) + non_root * (2 if cfg.parallel.shard == "full" else 1))
    return {"all-gather": float(gathers), "reduce-scatter": 4.0 * whole, "all-reduce": 0.0}
