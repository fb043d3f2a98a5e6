"""Per-rank memory and data-parallel traffic of ``parallel.shard`` (optimizer, full), as
m6.parallel.fsdp lays the model out: dense parameters sharded over all ranks, expert tensors over
the expert-data-parallel ranks, FSDP2 units = each MoE layer's experts, each block, the root.

A sharded tensor holds ceil(rows / degree) rows of dim 0 per rank (FSDP2 pads dim 0), so the
shards' bytes are those of meta tensors of that shape. What lives all the time: the fp32 shard of
every parameter and its two AdamW moments (or its Adafactor factors: m6.parallel.sharded_adafactor).
Backward is walked unit by unit as it runs (head, blocks last to first, embeddings), and at each
unit the estimate adds to the activations not yet
released (``sharded_backward``):
  gathered parameters   the root's (gathered for the whole step); full: the block running and the
                        one FSDP2 prefetches; optimizer: every block not yet done (gathered since
                        forward, each freed after its own backward); in the gather dtype (bf16
                        or fp16 with train.precision bf16 or fp16: FSDP2's MixedPrecisionPolicy);
  unsharded gradients   the root's gradients (its head's are made first, reduced last, with the
                        embeddings'), and the running unit's gradients in the gather dtype, with
                        the largest transient of a unit's backward (as without sharding,
                        m6.memory.estimate) while backward makes them, then with their fp32
                        reduce-scatter input (FSDP2 copies them into one flat buffer, then drops
                        them), whichever is more; an MoE block's experts and the rest of the
                        block are separate units, reduced one after the other. With
                        accumulation, every unit's fp32 gradients, kept unsharded between
                        micro-batches;
  sharded gradients     the fp32 shards of the blocks done so far.
With memory.offload (FSDP2's CPUOffloadPolicy) the shards, their moments, the gradient shards and
the update are on the host; the device keeps the walk's gathered parameters and unsharded
gradients, and of the sharded gradients only the running block's, until its copy to the host.
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
    blocks: list[tuple[int, int, int]]  # per block, forward order: whole dense, whole expert, shard elements
    root_numel: int
    dense_numel: int  # whole elements of the dense (replicated) parameters
    expert_numel: int  # whole elements of this EP rank's experts
    largest_update_call: int  # elements of the largest foreach AdamW call over shards
    largest_shard: int  # elements of the largest single shard (m6.parallel.sharded_adafactor's temporaries)
    adafactor_state_bytes: int  # the shards' Adafactor state (m6.parallel.sharded_adafactor)

    @property
    def unit_numel(self) -> list[int]:
        """Whole (gathered) elements of each non-root FSDP2 unit: a block's dense part, its experts."""
        return [n for dense, experts, _ in self.blocks for n in ((dense, experts) if experts else (dense,))]


def _shard_shape(p: nn.Parameter, degree: int) -> torch.Size:
    if p.dim() == 0:
        return p.shape
    return torch.Size([math.ceil(p.shape[0] / degree), *p.shape[1:]])


def _adafactor_bytes(shard: torch.Tensor) -> int:
    """Bytes of m6.parallel.sharded_adafactor's state for one rank's ``shard`` (its step count
    included): a matrix's rows' factor and its whole column factor (replicated), a 3-D tensor's two
    factors of its local leading rows, a vector's full second moment."""
    n = shard.numel()
    if shard.dim() > 1:
        rows, cols = shard.shape[-2], shard.shape[-1]
        return 4 * (n // cols if cols else 0) + 4 * (n // rows if rows else cols) + 4
    return 4 * n + 4


def shard_layout(cfg: Config, model: nn.Module, no_decay: set[int], world_size: int, ep: int) -> ShardLayout:
    """``model``: this rank's model (its experts only, on meta or real) before sharding."""
    edp = world_size // ep
    expert_ids = {id(p) for m in model.modules() if isinstance(m, MoELayer) for p in m.experts.parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    shards = {id(p): torch.empty(_shard_shape(p, edp if id(p) in expert_ids else world_size), device="meta")
              for p in params}
    blocks = []
    for block in getattr(model, "blocks", []):
        block_params = [p for p in block.parameters() if p.requires_grad]
        blocks.append((sum(p.numel() for p in block_params if id(p) not in expert_ids),
                       sum(p.numel() for p in block_params if id(p) in expert_ids),
                       sum(shards[id(p)].numel() for p in block_params)))
    in_blocks = {id(p) for b in getattr(model, "blocks", []) for p in b.parameters()}
    replicated = [shards[id(p)] for p in params if id(p) not in expert_ids]
    experts = [shards[id(p)] for p in params if id(p) in expert_ids]
    groups = split_apply_groups(replicated, experts, cfg.optim.apply_groups) if cfg.optim.apply_groups > 1 \
        else [replicated + experts]
    decayed = {id(shards[id(p)]) for p in params if id(p) not in no_decay}
    largest = max((sum(t.numel() for t in g if (id(t) in decayed) == d) for g in groups for d in (True, False)),
                  default=0)
    return ShardLayout(
        shard_numel=sum(t.numel() for t in shards.values()), num_tensors=len(params), blocks=blocks,
        root_numel=sum(p.numel() for p in params if id(p) not in in_blocks),
        dense_numel=sum(p.numel() for p in params if id(p) not in expert_ids),
        expert_numel=sum(p.numel() for p in params if id(p) in expert_ids), largest_update_call=largest,
        largest_shard=max((t.numel() for t in shards.values()), default=0),
        adafactor_state_bytes=sum(_adafactor_bytes(t) for t in shards.values()))


def gather_bytes(cfg: Config, device_type: str) -> int:
    """Bytes per element of a gathered parameter: 2 when FSDP2's MixedPrecisionPolicy casts
    (train.precision bf16 or fp16, or auto on CUDA), else the fp32 parameter itself."""
    precision = cfg.train.precision
    half = precision in ("bf16", "fp16") or (precision == "auto" and device_type == "cuda")
    return 2 if half else 4


def fused_update(cfg: Config, device_type: str) -> bool:
    """Whether the rank's update runs torch's fused AdamW (optim.implementation; auto: a CUDA device
    update), which keeps no step temporaries; an offloaded update runs on the host."""
    return cfg.optim.adamw_kernel(on_cuda=device_type == "cuda" and cfg.memory.offload == "none") == "fused"


def sharded_states(cfg: Config, layout: ShardLayout, world_size: int, device_type: str) -> dict[str, float]:
    """Bytes of one rank's sharded training state that the update holds (names as
    m6.memory.estimate's): shards, their gradients and optimizer state, the step's temporaries.
    optim.name=adafactor: m6.parallel.sharded_adafactor's factored state, and its temporaries of
    one shard at a time (the squared gradient or estimate, the update, its fp32 square)."""
    if cfg.optim.name == "adafactor":
        state, temporaries = float(layout.adafactor_state_bytes), 12.0 * layout.largest_shard
    else:
        state = 8.0 * layout.shard_numel + 4.0 * layout.num_tensors
        temporaries = 0.0 if fused_update(cfg, device_type) else 4.0 * layout.largest_update_call
    return {
        "params": 4.0 * layout.shard_numel,
        "grads": 4.0 * layout.shard_numel,
        "optimizer state": state,
        "optimizer step temporaries": temporaries,
    }


@dataclass(frozen=True)
class ShardedBackward:
    """The backward's high-water mark over the resident shards, and what it holds there."""

    peak: float  # bytes on top of the resident shards and optimizer state
    gathered: float  # gathered parameters at the peak
    unsharded_grads: float  # unsharded gradients (and reduce-scatter input) at the peak


def sharded_backward(cfg: Config, layout: ShardLayout, kept_by_unit: dict[str, float], transient: float,
                     world_size: int, device_type: str, offloaded: bool = False) -> ShardedBackward:
    """Walk backward unit by unit (``kept_by_unit``: the activations each unit releases, in
    backward order: head, blocks.<last>..blocks.0, embeddings) and return its worst moment (module
    docstring). ``transient``: the largest transient of one unit's backward, held beside the
    running unit's gradients unless their reduce-scatter input is larger. ``offloaded`` (FSDP2's
    CPU offload): each gradient shard leaves for the host after its reduce-scatter, so of the
    shards only the running unit's output is on the device."""
    g = gather_bytes(cfg, device_type)
    full = cfg.parallel.shard == "full"
    whole = [dense + experts for dense, experts, _ in layout.blocks]
    accumulated = 4.0 * (layout.dense_numel + layout.expert_numel) \
        if accumulation_steps(cfg.train, world_size) > 1 else 0.0
    held = sum(kept_by_unit.values())
    worst = ShardedBackward(0.0, 0.0, 0.0)
    for unit, acts in kept_by_unit.items():
        i = int(unit.split(".")[1]) if unit.startswith("blocks.") else (len(whole) if unit == "head" else -1)
        # Blocks gathered now: full, the running one and the prefetched one (at the head, the
        # last block is prefetched); optimizer, every block whose backward has not finished.
        running = [j for j in ((i, i - 1) if full else range(i + 1)) if 0 <= j < len(whole)]
        gathered = g * (layout.root_numel + sum(whole[j] for j in running))
        # The running unit (a block's experts, then the rest of the block): its gradients as
        # backward makes them, beside the unit's transient; then, once all are made, their
        # reduce-scatter input beside them (the transient is over by then).
        n = max(layout.blocks[i][:2]) if 0 <= i < len(whole) else 0
        made = 0.0 if accumulated else g * n  # accumulated: they exist already
        reducing = 4.0 * n >= transient
        unsharded = (accumulated or g * layout.root_numel) + made + (4.0 * n if reducing else 0.0)
        if offloaded:  # the running block's reduce-scatter output, until its copy to the host
            sharded = 4.0 * layout.blocks[i][2] if 0 <= i < len(whole) else 0.0
        else:
            sharded = 4.0 * sum(shard for _, _, shard in layout.blocks[max(i, 0):]) if unit != "head" else 0.0
        total = held + gathered + unsharded + (0.0 if reducing else transient) + sharded
        if total > worst.peak:
            worst = ShardedBackward(total, gathered, unsharded)
        held -= acts
    return worst


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
