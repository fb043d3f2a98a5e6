"""Tensor parallel (parallel.tensor_parallel_size): attention heads and dense FFNs split across the
ranks of a tensor-parallel group, Megatron style, applied to a materialised M6 model from outside.

What is split (each tp rank keeps 1/tp of it, as plain local parameters under the model's own names):
- attention ``qkv`` column-split by heads: rank r keeps the rows of its H/tp query heads and its
  Hkv/tp key/value heads, i.e. rows [q_r | k_r | v_r] of the fused [q | k | v] weight (a plain
  split of the fused rows would give rank 0 all of q and none of v); the module is told its local
  head counts. ``out`` row-split (its input columns), its bias added once after the sum.
- dense MLP ``fc_in`` (and ``fc_gate``, swiglu) column-split, ``fc_out`` row-split.
What is replicated: norms, embeddings, the head, the MoE layers whole (router, experts under
expert parallelism, shared experts): their input is the same on every tp rank, so each tp rank
routes and computes the same tokens (a cost: tp times the MoE work of one rank's batch).

The two boundaries of a split region are the Megatron pair, written as DTensor placements on the
job mesh's "tp" dim (m6.parallel.tp_regions): ``copy_to_tensor_parallel`` (the input Replicate,
its gradient Partial: identity forward, all-reduce of the gradient in backward), installed on
the attention and MLP modules, and ``reduce_from_tensor_parallel`` (the output Partial,
redistributed to Replicate: all-reduce forward, identity backward) in the row-parallel Linears.
Under sequence parallel (m6.parallel.sequence_parallel) they become an all-gather of the
sequence chunks and a reduce-scatter back to them. A replicated weight used inside a region (q/k RMSNorm per
head) goes through ``copy_to_tensor_parallel`` too, so its gradient is whole on every tp rank.
After backward every gradient is final within the tp group: replicated ones equal on all its
ranks, split ones each rank's own shard; data-parallel sync then runs over the ranks of one tp
coordinate (ProcessGroups.data), and the gradient norm sums the split shards over the tp group.

Why local parameters rather than DTensor parameters (parallelize_module with ColwiseParallel /
RowwiseParallel, as torchtitan): m6's gradient buckets, norm, optimizer grouping, offload and
checkpoint writer all work on plain local tensors, and the fused qkv weight's per-section split
under GQA (H/tp and Hkv/tp heads of differently sized sections) is not a DTensor placement.

Shape legend: D d_model, F ffn_dim, H / Hkv query / key-value heads, Dh head dim, tp group size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from m6.model.attention import SelfAttention
from m6.model.block import DenseMLP
from m6.model.cast_on_use import Linear, linear
from m6.parallel.pipeline import StageGap
from m6.parallel.tp_regions import (SequenceShape, copy_to_tensor_parallel, gather_from_sequence,
                                    reduce_from_tensor_parallel, reduce_scatter_to_sequence)


class ColumnParallelLinear(Linear):
    """This rank's output rows of a Linear: x [..., in] -> [..., out/tp]. The module that owns it
    enters the split region for it (``_enter_region``: one backward collective for all the
    column-parallel Linears reading the same input, e.g. swiglu's fc_in and fc_gate)."""

    tp_mesh: DeviceMesh | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.cast_on_use)


class RowParallelLinear(Linear):
    """This rank's input columns of a Linear: x [..., in/tp] -> [..., out] summed over the tp
    group, the (replicated) bias added once after the sum. ``scatter_sequence`` (sequence
    parallel): the sum is reduce-scattered over dim 1 (each rank keeps its chunk of S) and the
    bias, added to that chunk only, has its gradient summed over the tp group."""

    tp_mesh: DeviceMesh | None = None
    scatter_sequence: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, None, self.cast_on_use)
        if not self.scatter_sequence:
            y = reduce_from_tensor_parallel(y, self.tp_mesh)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        y = reduce_scatter_to_sequence(y, self.tp_mesh)
        return y if self.bias is None else y + copy_to_tensor_parallel(self.bias, self.tp_mesh).to(y.dtype)


class TensorParallelRMSNorm(nn.RMSNorm):
    """An RMSNorm applied inside a split region (per-head q/k norm): its weight's gradient is
    summed over the tp group in backward, so every rank holds the whole of it."""

    tp_mesh: DeviceMesh | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else copy_to_tensor_parallel(self.weight, self.tp_mesh)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


@dataclass(frozen=True)
class TensorSplit:
    """How a parameter is split over the tp group: along ``dim`` (0 rows, 1 columns), each of the
    global tensor's ``sections`` (sizes along ``dim``, stacked in this order: q, k, v for the fused
    qkv; one section otherwise) cut in tp equal parts, rank r holding part r of every section."""

    dim: int
    sections: tuple[int, ...]

    def global_shape(self, local_shape: torch.Size) -> torch.Size:
        shape = list(local_shape)
        shape[self.dim] = sum(self.sections)
        return torch.Size(shape)

    def pieces(self, local_shape: torch.Size, tp: int, rank: int, rows: tuple[int, int] | None = None
               ) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """Where rank ``rank``'s tensor of ``local_shape`` lies in the global one: one (global
        offsets, local offsets, sizes) per section (a checkpoint's chunks). ``rows``: (first, count)
        of the tp rank's tensor's dim-0 rows this process holds (parallel.shard: FSDP2 shards the
        tp rank's tensor by rows over its data-parallel ranks); local offsets are then within those
        rows, and a section with none of them gives no piece."""
        first, count = rows if rows is not None else (0, local_shape[0])
        out, global_start, local_start = [], 0, 0
        for size in self.sections:
            share = size // tp
            g, l_, n = [0] * len(local_shape), [0] * len(local_shape), list(local_shape)
            g[self.dim], l_[self.dim], n[self.dim] = global_start + rank * share, local_start, share
            global_start += size
            local_start += share
            # Keep the held rows [first, first + count) of the tp rank's dim 0 (all of them unsharded).
            lo, hi = max(l_[0], first), min(l_[0] + n[0], first + count)
            if hi <= lo:
                continue
            g[0], l_[0], n[0] = g[0] + lo - l_[0], lo - first, hi - lo
            out.append((tuple(g), tuple(l_), tuple(n)))
        return out


@dataclass
class TensorParallelPlan:
    """What apply_tensor_parallel split, by parameter name (the norm's and a checkpoint's account)."""

    size: int
    rank: int
    split: dict[str, TensorSplit] = field(default_factory=dict)


def _sections_slice(t: torch.Tensor, dim: int, sections: list[int], tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s 1/tp of every section of ``t`` along ``dim``, concatenated (a copy)."""
    parts, start = [], 0
    for size in sections:
        share = size // tp
        parts.append(t.narrow(dim, start + rank * share, share))
        start += size
    return torch.cat(parts, dim=dim).clone()


def _split_linear(module: Linear, kind: type, dim: int, sections: list[int], tp: int, rank: int,
                  tp_mesh: DeviceMesh) -> Linear:
    """A ``kind`` Linear holding rank ``rank``'s share of ``module``'s weight (and bias, when the
    bias is split too: column-parallel) on the same device and dtype, cast-on-use switch kept."""
    weight = module.weight.detach()
    local_w = _sections_slice(weight, dim, sections, tp, rank)
    with torch.device("meta"):
        new = kind(local_w.shape[1], local_w.shape[0], bias=module.bias is not None)
    new.weight = nn.Parameter(local_w, requires_grad=module.weight.requires_grad)
    if module.bias is not None:
        bias = module.bias.detach()
        local_b = _sections_slice(bias, 0, sections, tp, rank) if dim == 0 else bias.clone()
        new.bias = nn.Parameter(local_b, requires_grad=module.bias.requires_grad)
    new.cast_on_use = module.cast_on_use
    new.tp_mesh = tp_mesh
    return new


def _enter_region(module: nn.Module, tp_mesh: DeviceMesh, sequence: SequenceShape | None) -> None:
    """Make ``module``'s first input enter a split region before its column-parallel Linears read
    it: the same input on every rank, its gradient summed over the tp group in backward (tensor
    parallel); or (sequence parallel) all-gathered from the ranks' chunks of S, the gradient
    reduce-scattered back."""
    if sequence is None:
        enter = lambda x: copy_to_tensor_parallel(x, tp_mesh)  # noqa: E731
    else:
        enter = lambda x: gather_from_sequence(x, tp_mesh, sequence, partial_grad=True)  # noqa: E731
    module.register_forward_pre_hook(lambda module, args: (enter(args[0]), *args[1:]))


def _split_attention(attn: SelfAttention, tp: int, rank: int, tp_mesh: DeviceMesh,
                     sequence: SequenceShape | None) -> None:
    q_dim, kv_dim = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    attn.qkv = _split_linear(attn.qkv, ColumnParallelLinear, 0, [q_dim, kv_dim, kv_dim], tp, rank, tp_mesh)
    attn.out = _split_linear(attn.out, RowParallelLinear, 1, [q_dim], tp, rank, tp_mesh)
    attn.out.scatter_sequence = sequence is not None
    _enter_region(attn, tp_mesh, sequence)
    attn.num_heads, attn.num_kv_heads = attn.num_heads // tp, attn.num_kv_heads // tp
    if attn.qk_norm == "head":
        for name in ("q_norm", "k_norm"):
            norm = getattr(attn, name)
            norm.__class__ = TensorParallelRMSNorm  # same parameters, names and values; forward differs
            norm.tp_mesh = tp_mesh
    elif attn.qk_norm != "none":
        raise ValueError(f"model.qk_norm={attn.qk_norm} with tensor parallelism: an RMSNorm over all heads "
                         "needs every head; use qk_norm none or head")


def _split_mlp(mlp: DenseMLP, tp: int, rank: int, tp_mesh: DeviceMesh, sequence: SequenceShape | None) -> None:
    ffn_dim = mlp.fc_in.out_features
    mlp.fc_in = _split_linear(mlp.fc_in, ColumnParallelLinear, 0, [ffn_dim], tp, rank, tp_mesh)
    if mlp.fc_gate is not None:
        mlp.fc_gate = _split_linear(mlp.fc_gate, ColumnParallelLinear, 0, [ffn_dim], tp, rank, tp_mesh)
    mlp.fc_out = _split_linear(mlp.fc_out, RowParallelLinear, 1, [ffn_dim], tp, rank, tp_mesh)
    mlp.fc_out.scatter_sequence = sequence is not None
    # fc_in and fc_gate read the same input: the region is entered once, so backward sums the two
    # partial input gradients with one collective instead of one each.
    _enter_region(mlp, tp_mesh, sequence)


def apply_tensor_parallel(model: nn.Module, tp: int, rank: int, tp_mesh: DeviceMesh | None,
                          sequence: SequenceShape | None = None) -> TensorParallelPlan:
    """Split every transformer block's attention and dense MLP of a materialised M6 model over the
    tp mesh (the job mesh's "tp" dim; ``rank``: this rank's place in it); MoE layers, norms and
    embeddings stay whole. ``sequence``: the regions are entered and left for sequence parallel
    (m6.parallel.sequence_parallel adds the rest).
    Returns which parameters were split (by name) and along which dim."""
    plan = TensorParallelPlan(tp, rank)
    if tp == 1:
        return plan
    for name, block in model.blocks.named_children():
        if isinstance(block, StageGap):  # another pipeline stage's block (m6.parallel.pipeline)
            continue
        prefix = f"blocks.{name}"
        attn = block.attn
        q_dim, kv_dim = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        _split_attention(attn, tp, rank, tp_mesh, sequence)
        plan.split[f"{prefix}.attn.qkv.weight"] = TensorSplit(0, (q_dim, kv_dim, kv_dim))
        plan.split[f"{prefix}.attn.out.weight"] = TensorSplit(1, (q_dim,))
        if attn.qkv.bias is not None:
            plan.split[f"{prefix}.attn.qkv.bias"] = TensorSplit(0, (q_dim, kv_dim, kv_dim))
        if isinstance(block.ffn, DenseMLP):
            ffn_dim = block.ffn.fc_in.out_features
            _split_mlp(block.ffn, tp, rank, tp_mesh, sequence)
            for part, dim in (("fc_in", 0), ("fc_gate", 0), ("fc_out", 1)):
                module = getattr(block.ffn, part)
                if module is None:
                    continue
                plan.split[f"{prefix}.ffn.{part}.weight"] = TensorSplit(dim, (ffn_dim,))
                if dim == 0 and module.bias is not None:
                    plan.split[f"{prefix}.ffn.{part}.bias"] = TensorSplit(0, (ffn_dim,))
    return plan
