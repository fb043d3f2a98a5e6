"""Sharded data parallel (``parallel.shard``): torch's FSDP2 ``fully_shard`` on m6's device mesh,
composed with expert parallelism.

Which ranks hold copies of what decides where each parameter is sharded (torchtitan's
"dp_shard_mod_ep"): a replicated (dense) parameter has a copy on every rank, so it is sharded over
all ranks (the mesh's two dims flattened, "dp"); an expert tensor is the same only on the ranks
holding the same experts, so it is sharded over the expert-data-parallel dim ("edp"), and the EP
ranks keep holding different experts. Units: each MoE layer's experts (edp), each block (dp:
attention, norms, router, dense MLP), the root (dp: embeddings, final norm, LM head).

Sums, not means: m6's loss is already normalised by global counts (m6.parallel.grad_sync), so the
reduce-scatter divides by nothing (``set_gradient_divide_factor(1.0)``, a plain SUM). Parameters some rank's
graph does not reach (a batch with no image) reduce zeros, so every rank issues the same
reduce-scatters. m6's bucketed all-reduce is not used at all when sharding: every trainable
parameter belongs to one FSDP unit, whose reduce-scatter is its gradient sync.

Modes: ``full`` (ZeRO-3) frees a unit's gathered parameters after its forward and gathers them
again for backward; ``optimizer`` (ZeRO-2) keeps them gathered from forward through backward (one
all-gather per unit per step, not two), which is FSDP2's ``reshard_after_forward=False``: the
gradients and the optimizer state are sharded exactly as in ``full``; between steps the parameters
rest sharded too, so a checkpoint of either mode has the same layout. torch's
ZeroRedundancyOptimizer (ZeRO-1) was not chosen: it all-reduces whole gradients and shards only
the optimizer state, it has no notion of the expert-data-parallel groups, and its state dict is
not DCP-reshardable.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from m6.parallel.grad_sync import clip_coefficient, sum_sq_of
from m6.parallel.layout import LayoutError
from m6.parallel.plan import ShardedModel

if TYPE_CHECKING:  # torch.distributed.fsdp is imported where units are made: a run without sharding never loads it
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy

SHARD_MODES = ("none", "optimizer", "full")


def dense_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """All ranks as one mesh dim ("dp", in rank order): where replicated parameters are sharded.
    At tensor parallel (mesh ("edp", "ep", "tp")) the ranks of this rank's tp coordinate: FSDP2
    shards the tp rank's own parameters (its split shards and the replicated rest) over them, as
    torchtitan's 2-D layout (FSDP over data parallel, tp inside)."""
    return mesh["edp", "ep"]._flatten("dp")


def apply_sharding(sharded: ShardedModel, mode: str, param_dtype: torch.dtype | None = None,
                   offload: bool = False) -> None:
    """Wrap ``sharded.model`` in FSDP2 units for ``mode`` (``optimizer`` or ``full``), in place.

    ``param_dtype``: the dtype the units gather their parameters in (bf16 for train.precision=bf16:
    FSDP2's MixedPrecisionPolicy casts the gathered copy, the sharded fp32 parameter stays the
    master, gradients are reduced in fp32) or None for the parameters' own dtype.
    ``offload``: FSDP2's CPUOffloadPolicy (memory.offload=optimizer+params with sharding) on CUDA:
    the shards rest in pinned host memory, each gather copies them to the device first, each
    reduce-scatter's output goes back to the host, and the optimizer steps them there. On a CPU
    mesh the shards are in host memory already and stay as they are.
    """
    if mode not in ("optimizer", "full"):
        raise ValueError(f"parallel.shard must be one of {SHARD_MODES}, got {mode!r}")
    groups = sharded.groups
    if groups.mesh is None:
        raise LayoutError(f"parallel.shard={mode} needs torch.distributed: launch with torchrun (even "
                          f"--nproc_per_node 1), or use parallel.shard=none for one plain process")
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    model = sharded.model
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    # On a CPU device the shards live in host memory already: nothing to move (and the policy's
    # copies need an accelerator); the host optimizer still steps them (m6.train.update).
    placement = CPUOffloadPolicy(pin_memory=True) if offload and groups.mesh.device_type == "cuda" else OffloadPolicy()
    expert_ids = {id(p) for p in sharded.expert_params.values()}
    shard_units(model, expert_ids, dense_mesh(groups.mesh), groups.mesh["edp"], mode == "full", policy, placement,
                roots=sharded.stages or None)
    unmanaged = [n for n, p in model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
    assert not unmanaged, f"parameters outside every FSDP unit: {unmanaged[:3]}"
    # The ShardedModel's maps name the sharded DTensor parameters from now on.
    names = dict(model.named_parameters())
    sharded.expert_params = {n: names[n] for n in sharded.expert_params}
    sharded.replicated_params = {n: names[n] for n in sharded.replicated_params}


def reduce_unused_params(unit: FSDPModule) -> None:
    """Have ``unit`` reduce-scatter zeros for parameters this rank's backward did not reach, so that
    every rank issues the same reduce-scatters (a batch with no image leaves the image embedding
    without a gradient on that rank). Older FSDP2 (torch 2.11 has not the switch, 2.13 has) reduces
    only the gradients a rank has, which over several ranks mismatches the collectives; one rank
    per mesh has nobody to mismatch with, so it runs there without the switch."""
    if hasattr(unit, "set_reduce_scatter_unused_params"):
        unit.set_reduce_scatter_unused_params(True, recurse=False)
        return
    meshes = {id(p.device_mesh): p.device_mesh for p in unit.parameters() if isinstance(p, DTensor)}
    if any(mesh.size() > 1 for mesh in meshes.values()):
        raise LayoutError(f"parallel.shard over more than one rank needs FSDP2's set_reduce_scatter_unused_params, "
                          f"which torch {torch.__version__} lacks (torch 2.13 has it): upgrade torch, or use "
                          f"parallel.shard=none")


def shard_units(model: nn.Module, expert_ids: set[int], dense: DeviceMesh, experts: DeviceMesh, reshard: bool,
                policy: MixedPrecisionPolicy | None = None, placement: OffloadPolicy | None = None,
                roots: list[nn.Module] | None = None) -> list[nn.Module]:
    """``fully_shard`` m6's units of ``model`` in place (each MoE layer's experts over ``experts``,
    each block and the root over ``dense``), with m6's reduction settings; returns the units.
    Shared by the run (apply_sharding) and the planner's CPU profile (m6.plan.timing), which wraps
    the profiled rank in the same units over a one-rank mesh to time FSDP2's own host work.
    ``roots``: at pipeline parallel, this rank's stage modules (m6.parallel.pipeline), each the
    root unit of its stage (its embeddings, final norm, head), in place of the model; the blocks
    other stages own (no parameters) are no units."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    policy, placement = policy or MixedPrecisionPolicy(), placement or OffloadPolicy()
    units: list[nn.Module] = []
    # Experts first (innermost): an enclosing unit leaves parameters an inner unit manages alone.
    for module in model.modules():
        params = list(module.parameters(recurse=False))
        if params and all(id(p) in expert_ids for p in params):
            fully_shard(module, mesh=experts, reshard_after_forward=reshard, mp_policy=policy, offload_policy=placement)
            units.append(module)
    for block in model.blocks:
        if not any(True for _ in block.parameters()):
            continue
        fully_shard(block, mesh=dense, reshard_after_forward=reshard, mp_policy=policy, offload_policy=placement)
        units.append(block)
    # The root's parameters are used first in forward and last in backward: freeing them after the
    # forward would only gather them again at once, so the root never reshards early.
    for root in roots or [model]:
        fully_shard(root, mesh=dense, reshard_after_forward=False, mp_policy=policy, offload_policy=placement)
        units.append(root)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        # A plain SUM (factor 1 would otherwise be a PREMUL_SUM, which gloo lacks; a no-op scale on NCCL).
        unit.set_force_sum_reduction_for_comms(True)
        reduce_unused_params(unit)
    return units


class ShardedGradientSync:
    """Gradient sync of a model in FSDP2 units: each unit reduce-scatters its gradients at the end
    of its own backward (summed over its mesh: all ranks for dense units, the expert-data-parallel
    group for expert units). The micro-batches before the step's last accumulate unsharded
    gradients locally (``enabled = False``: no communication), as with m6's bucketed sync."""

    def __init__(self, model: nn.Module, roots: list[nn.Module] | None = None) -> None:
        """``roots``: the root units when the model is not one (a pipeline rank's stage modules,
        whose PipelineStage also turns their sync on for the schedule's last backward)."""
        from torch.distributed.fsdp import FSDPModule

        self.roots = roots or [model]
        assert all(isinstance(r, FSDPModule) for r in self.roots), "ShardedGradientSync needs units from apply_sharding"
        self.model = model
        self._enabled = True

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        if value != self._enabled:
            for root in self.roots:
                root.set_requires_gradient_sync(value)  # every unit under the root
            self._enabled = value

    def prepare(self, loss: torch.Tensor) -> None:
        """Nothing to learn before backward: FSDP2 reduces zeros for unreached parameters itself."""

    def finish(self) -> None:
        """Nothing to drain: the root's backward waits for every reduce-scatter it launched."""


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's elements of ``t``: a DTensor's local shard, or a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` on this rank (a DTensor: its local shard's,
    FSDP2's padding included): what the rank really holds, for measurements beside the estimate."""
    storages = {}
    for t in tensors:
        s = local_part(t).untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def shard_rows(t: DTensor) -> tuple[int, int]:
    """(first row, rows) of ``t``'s dim 0 that this rank's shard holds (FSDP2 shards dim 0)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return (offset[0] if len(offset) else 0), (shape[0] if len(shape) else 0)


def clip_sharded_grad_norm(params: list[nn.Parameter], max_norm: float, group, device: torch.device,
                           grad_scale: float = 1.0, uncounted: list[nn.Parameter] = (),
                           split: list[nn.Parameter] = (), copies: int = 1) -> float:
    """Clip the gradients of a model in FSDP2 units to the norm of the GLOBAL gradient; returns it.

    Every gradient is a DTensor shard: dense ones of the whole tensor over all ranks, expert ones
    of this EP rank's experts over its expert-data-parallel group; so all ranks together hold each
    element of the global gradient exactly once, and one sum over ``group`` (all ranks) of the
    local squares is its squared norm. Same coefficient formula as torch.nn.utils.clip_grad_norm_.
    ``device``: the rank's compute device, where the sum travels (offloaded shards hold host
    gradients, and NCCL reduces only CUDA tensors).

    ``grad_scale``: the gradients hold the fp16 loss scale's multiple; they are unscaled in the
    clip's one multiply and the returned norm is the unscaled one (as m6.parallel.grad_sync's
    clip_grad_norm). The sum over all ranks is also the overflow check: an inf/nan in any rank's
    shard makes the norm non-finite on every rank, so every rank skips the step together, and a
    non-finite norm leaves the gradients as they are. ``uncounted``: clipped, not in the norm (the
    tied token embedding's copy on a pipeline's last stage: its first stage counts it).

    Tensor parallel (m6.parallel.tensor_parallel) with sharding: each tp coordinate's data-parallel
    ranks shard their own model, so ``split`` (the tensor-parallel shards, different on every tp
    coordinate) holds each element once over ``group`` (all ranks), while every one of ``params``
    (replicated and expert gradients) is held the same by ``copies`` (tp) coordinates: its squares
    count 1/copies each (in float64; an inf or nan in any rank's shard still reaches every rank's norm).
    """
    grads = [local_part(p.grad) for p in params if p.grad is not None]
    split_grads = [local_part(p.grad) for p in split if p.grad is not None]
    extra = [local_part(p.grad) for p in uncounted if p.grad is not None]
    total_sq = sum_sq_of(grads) / copies + sum_sq_of(split_grads)
    if group is not None and dist.get_world_size(group) > 1:
        total_sq = total_sq.to(device)
        dist.all_reduce(total_sq, group=group)
    total = float(total_sq.sqrt()) / grad_scale
    if math.isfinite(total):  # a non-finite norm skips the step: the gradients are dropped unscaled
        coef = clip_coefficient(total, max_norm) / grad_scale
        if coef != 1.0:
            for g in grads + split_grads + extra:
                g.mul_(coef)
    return total
