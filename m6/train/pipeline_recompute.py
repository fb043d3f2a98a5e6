"""memory.activation_checkpointing=auto at pipeline parallel: each pipeline rank chooses what to
recompute in its own stages' blocks, from a profile of its own stages, against its own budget.

Without a pipeline the auto plan profiles one forward of the whole model (m6.memory.recompute_plan).
No pipeline rank holds the whole model, so on the first step, before the schedule, the densest
micro-batch of the step's shape is passed through the pipeline once, stage after stage in order
(each rank runs its stages' forwards with every part's saved bytes and time measured, the stage
outputs sent point-to-point to the next stage's rank; the last stage adds its LM head and loss),
and every rank chooses from its profile alone (recompute_plan.choose_recompute, the same greedy
knapsack as without a pipeline).

The budget: ``memory.activation_budget_gb`` is what one process may keep, and a pipeline rank keeps
several micro-batches' activations at once (the schedule's in-flight count, ``in_flight``: 1F1B's
stage s holds p - s), so a micro-batch's share is the budget over that count;
``memory.activation_budget_fraction`` is a share of one micro-batch's profiled bytes, as without a
pipeline. What the budget guard adds without a pipeline (metering every training micro-batch and
recomputing more on a heavier one, m6.memory.recompute_guard) does not run inside torch's schedules:
the plan is fixed after the profile.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from m6.config import MemoryConfig
from m6.data.batch import MultimodalBatch
from m6.memory.recompute import RecomputeParts
from m6.parallel.pipeline_order import most_in_flight
from m6.memory.recompute_plan import RecomputePlan, budget_bytes, choose_recompute, profile_parts
from m6.model import RecomputablePart
from m6.parallel.pipeline import PipelineStageModule, rank_stage_indices

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


class RankStages:
    """The recomputable parts of every stage a pipeline rank holds, under the whole model's names."""

    def __init__(self, stage_modules: Sequence[PipelineStageModule]) -> None:
        self.stage_modules = list(stage_modules)

    def recomputable_parts(self) -> list[RecomputablePart]:
        return [part for m in self.stage_modules for part in m.recomputable_parts()]


def in_flight(schedule: str, pp: int, v: int, m: int, pp_rank: int) -> float:
    """Micro-batches' activations pipeline rank ``pp_rank`` holds at its peak, in units of one
    micro-batch through all its stages, counted over torch's order of its actions
    (m6.parallel.pipeline_order, which the planner's memory model walks too): 1F1B min(m, p - rank);
    interleaved Megatron's warm-up count of chunks, 1/v each; ZB-V its own V's."""
    return most_in_flight(schedule, pp, v, m, pp_rank)


def stage_owners(pipeline_parallel_size: int, stages_per_rank: int, schedule: str) -> dict[int, int]:
    """Stage index -> the pipeline rank (in the pipeline group) that runs it."""
    return {s: r for r in range(pipeline_parallel_size)
            for s in rank_stage_indices(r, pipeline_parallel_size, stages_per_rank, schedule)}


def _send(x: torch.Tensor, group, to: int) -> None:
    """``x`` to pipeline rank ``to``: its rank count, shape and dtype first (a header of int64s)."""
    header = torch.tensor([x.dim(), *x.shape, _DTYPES.index(x.dtype)], dtype=torch.int64, device=x.device)
    dist.send(torch.tensor([header.numel()], dtype=torch.int64, device=x.device), group=group, group_dst=to)
    dist.send(header, group=group, group_dst=to)
    dist.send(x.detach().contiguous(), group=group, group_dst=to)


def _recv(group, source: int, device: torch.device) -> torch.Tensor:
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, group=group, group_src=source)
    header = torch.zeros(int(size.item()), dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=source)
    ndim = int(header[0])
    x = torch.empty(header[1:1 + ndim].tolist(), dtype=_DTYPES[int(header[1 + ndim])], device=device)
    dist.recv(x, group=group, group_src=source)
    return x


def pipeline_forward(stage_modules: Sequence[PipelineStageModule], batch: MultimodalBatch, owners: dict[int, int],
                     pp_rank: int, group, device: torch.device) -> list[torch.Tensor]:
    """One forward of ``batch`` through the whole pipeline, stage by stage in order (every pipeline
    rank calls it together); what this rank's stages return (the last stage: its LM loss sum)."""
    mine = {m.stage_index: m for m in stage_modules}
    kwargs = dict(images=batch.images, has_image=batch.has_image, segment_ids=batch.segment_ids)
    outputs, x = [], batch.text_ids
    for s in range(len(owners)):
        if s not in mine:
            continue
        if s > 0 and owners[s - 1] != pp_rank:
            x = _recv(group, owners[s - 1], device)
        out = mine[s](x, **kwargs)
        if mine[s].is_last:
            out = mine[s].rank_model.target_loss_sum(out, batch.labels)
        elif owners[s + 1] != pp_rank:
            _send(out, group, owners[s + 1])
        outputs.append(out)
        x = out  # the next stage, when this rank runs it too (zero_bubble's middle)
    return outputs


def plan_stage_recompute(stage_modules: Sequence[PipelineStageModule], memory: MemoryConfig, batch: MultimodalBatch,
                         owners: dict[int, int], pp_rank: int, group, device: torch.device,
                         in_flight: float, log: Callable[[str], None]) -> RecomputePlan:
    """Profile this rank's stages on ``batch`` (the densest micro-batch of the step's shape), choose
    and apply its auto plan (see the module docstring); ``in_flight``: micro-batches whose
    activations this rank holds at once. Rank 0 of the job logs every pipeline rank's plan."""
    recompute = RecomputeParts(RankStages(stage_modules))
    terms = [(len(m.terms), len(m.routed)) for m in stage_modules]
    profile = profile_parts(recompute, lambda: pipeline_forward(stage_modules, batch, owners, pp_rank, group, device),
                            [p for m in stage_modules for p in m.parameters()], device)
    for m, (t, r) in zip(stage_modules, terms):  # the profile's forward is no training micro-batch
        del m.terms[t:], m.routed[r:]
    budget = int(budget_bytes(memory, profile.saved_bytes(())) / (in_flight if memory.activation_budget_gb else 1))
    plan = choose_recompute(profile, budget)
    recompute.apply(plan.recompute)
    lines: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(lines, f"{in_flight:g} micro-batches in flight, {plan.summary(len(recompute.parts))}",
                           group=group)
    for r, line in enumerate(lines):
        log(f"pipeline rank {r}: {line}")
    return plan
