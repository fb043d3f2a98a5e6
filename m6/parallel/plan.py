"""Whale-style scopes: everything is replicated (data parallel) unless it sits in a `split` scope.

A split MoE layer keeps only this rank's share of the experts and reaches the others through the
all-to-all dispatcher. Which parameters are split is recorded HERE, in the plan, never as flags on
Parameter objects, and the model's code does not change between EP=1 and EP>1.

    plan = default_plan(model)                 # M6: split the experts of every MoE layer
    plan = ParallelPlan(split=[model.moe])     # a user's own model: name what to split
    sharded = apply_plan(model, plan, groups)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from m6.moe import GlobalRoutingStats, GroupedExperts, MoELayer
from m6.moe.all_to_all import AllToAllDispatcher, OverlapDegree
from m6.moe.node_aware_all_to_all import NodeAwareDispatcher
from m6.parallel.layout import ParallelLayout, ProcessGroups
from m6.parallel.node_groups import ep_group_nodes


@dataclass
class ParallelPlan:
    """The MoE layers whose experts are split across the expert-parallel group."""

    split: list[MoELayer] = field(default_factory=list)

    def __post_init__(self) -> None:
        for module in self.split:
            if not isinstance(module, MoELayer):
                raise TypeError(f"split() takes MoELayer modules (expert dimension), got {type(module).__name__}")


def default_plan(model: nn.Module) -> ParallelPlan:
    """Replicate everything, split the experts of every MoE layer (the M6 plan)."""
    return ParallelPlan(split=[m for m in model.modules() if isinstance(m, MoELayer)])


@dataclass
class ShardedModel:
    """The result of applying a plan: which parameters are synchronised over which group."""

    model: nn.Module
    groups: ProcessGroups
    expert_params: dict[str, nn.Parameter]  # name -> param, sharded by expert id (dim 0)
    replicated_params: dict[str, nn.Parameter]
    expert_offsets: dict[str, int]  # name -> global id of local expert 0
    # name -> the layer's experts over all EP ranks (dim 0 of the global tensor a checkpoint stores)
    global_experts: dict[str, int] = field(default_factory=dict)
    # name -> how it is split over the tensor-parallel group (m6.parallel.tensor_parallel.TensorSplit);
    # these are among replicated_params too (synced over the data-parallel group like them)
    tensor_split: dict[str, object] = field(default_factory=dict)
    # pipeline parallel: this rank's stages (m6.parallel.pipeline.PipelineStageModule), in schedule order
    stages: list = field(default_factory=list)

    def first_expert(self, name: str) -> int:
        return self.expert_offsets[name]


def _shard_experts(experts: GroupedExperts, first: int, count: int) -> GroupedExperts:
    """A GroupedExperts holding global experts [first, first + count) with the same weights."""
    with torch.device(experts.w_in.device):  # meta stays meta: nothing allocated before materialising
        local = GroupedExperts(count, experts.d_model, experts.ffn_dim, experts.activation, experts.init_std,
                               experts.init_seed, first_expert=first,
                               expert_kernel=experts.expert_kernel).to(dtype=experts.w_in.dtype)
    if not experts.w_in.is_meta:
        with torch.no_grad():
            for name in ("w_in", "w_out", "w_gate"):
                src = getattr(experts, name)
                if src is not None:
                    getattr(local, name).copy_(src[first:first + count])
    return local if experts.w_in.is_meta else local.to(experts.w_in.device)


def shard_model(model: nn.Module, plan: ParallelPlan, groups: ProcessGroups,
                a2a_dtype: Optional[torch.dtype] = None, aux_loss_scope: str = "global",
                a2a_overlap_degree: OverlapDegree = 1, a2a_dispatch: str = "flat") -> None:
    """Structural part of a plan: keep this rank's experts, install dispatcher and stats reducer.

    Works on a model built on ``meta`` (nothing is allocated for the experts of other ranks);
    materialise afterwards and then call ``classify_parameters``.
    """
    if aux_loss_scope not in ("global", "local"):
        raise ValueError(f"model.moe.aux_loss_scope must be 'global' or 'local', got {aux_loss_scope!r}")
    layout = groups.layout
    keep_local_experts(plan, layout)
    for module in model.modules():
        if not isinstance(module, MoELayer):
            continue
        if aux_loss_scope == "global" and layout.world_size > 1:
            module.stats_reducer = GlobalRoutingStats(groups.data)  # tp ranks repeat their tokens: not them
        if module in plan.split and layout.expert_parallel_size > 1:
            if a2a_dispatch == "node_aware":
                if groups.node_aware is None:
                    raise ValueError("model.moe.a2a_dispatch=node_aware needs the process groups made with "
                                     "create_process_groups(..., node_aware=True)")
                module.dispatcher = NodeAwareDispatcher(groups.expert, groups.node_aware.rail, groups.node_aware.node,
                                                        module.num_experts, ep_group_nodes(layout), a2a_dtype,
                                                        layout.counts_for(module.num_experts), a2a_overlap_degree)
            else:
                module.dispatcher = AllToAllDispatcher(groups.expert, module.num_experts, a2a_dtype,
                                                       a2a_overlap_degree, ep_group_nodes(layout),
                                                       layout.counts_for(module.num_experts))


def keep_local_experts(plan: ParallelPlan, layout: ParallelLayout) -> None:
    """The parameter half of a plan: each split MoE layer keeps only this rank's experts (no
    process group needed, so the planner sizes any rank of any layout with it on ``meta``)."""
    sharded: dict[int, GroupedExperts] = {}  # layers that share experts (model.share_layers) keep sharing them
    for module in plan.split:
        counts = layout.counts_for(module.num_experts)  # uneven with parallel.balance (m6.parallel.expert_ranges)
        first = sum(counts[:layout.ep_rank])
        if id(module.experts) not in sharded:
            sharded[id(module.experts)] = _shard_experts(module.experts, first, counts[layout.ep_rank])
        module.experts = sharded[id(module.experts)]


def classify_parameters(model: nn.Module, plan: ParallelPlan, groups: ProcessGroups) -> ShardedModel:
    """Which parameters are expert-split (synced over their EDP group) and which are replicated."""
    expert_params, offsets, replicated, global_experts = {}, {}, {}, {}
    split_expert_modules = {id(m.experts): m.num_experts for m in plan.split}
    for mod_name, module in model.named_modules():
        if id(module) in split_expert_modules:
            for pname, p in module.named_parameters(recurse=False):
                full = f"{mod_name}.{pname}" if mod_name else pname
                expert_params[full] = p
                offsets[full] = module.first_expert
                global_experts[full] = split_expert_modules[id(module)]
    for name, p in model.named_parameters():
        if name not in expert_params:
            replicated[name] = p
    return ShardedModel(model, groups, expert_params, replicated, offsets, global_experts)


def apply_plan(model: nn.Module, plan: ParallelPlan, groups: ProcessGroups,
               a2a_dtype: Optional[torch.dtype] = None, aux_loss_scope: str = "global",
               a2a_overlap_degree: OverlapDegree = 1, a2a_dispatch: str = "flat") -> ShardedModel:
    """shard_model + classify_parameters, for a model that is already materialised."""
    shard_model(model, plan, groups, a2a_dtype, aux_loss_scope, a2a_overlap_degree, a2a_dispatch)
    return classify_parameters(model, plan, groups)
