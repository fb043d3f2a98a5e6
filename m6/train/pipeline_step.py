"""One optimizer step's forward/backward at pipeline parallel: the step's accumulation
micro-batches are the pipeline's micro-batches, run by one ``schedule.step`` (torch's
Schedule1F1B, ScheduleInterleaved1F1B or ScheduleZBVZeroBubble over this rank's stages).

The loss is the loop's (m6.train.loss.micro_batch_loss): the last stage's loss_fn returns the
micro-batch's target cross-entropy sum over the step's GLOBAL target count, and every stage's MoE
aux loss gets the gradient 1 / (accumulation x aux ranks) through its output
(m6.parallel.pipeline.AttachAuxLoss). The schedule does not scale gradients (scale_grads=False):
the losses are already the step's shares. Under fp16 both carry the loss scale, which the clip
divides out of the gradients (m6.train.update), as in the loop's own backward. Gradients are then reduced over each stage's data- and
expert-data-parallel groups (the loop's GradientSync, all buckets after the schedule), and the
step's loss terms summed over the pipeline in one all-reduce, so every stage reports (and agrees
on) the same numbers.

When a gradient is final: a stage's parameters accumulate over the step's micro-batches, each
backward inside the schedule, so the gradient sync (and offload's stream to the host, which it
drives) is off for all of them but the stage's last (torch's ``last_backward``, the hook its
DDP/FSDP integration uses): under 1f1b and interleaved a stage's gradients are reduced, and with
memory.offload leave for the host, as that backward writes them, overlapping the rest of the
schedule; zero_bubble splits weight gradients into a pass that writes ``.grad`` itself (no
accumulate hook), so its gradients are reduced and streamed after the schedule. The tied token
embedding's gradient stays on the device until the first and last stages have summed it.
With optim.delayed_update, step t's host update (m6.memory.delayed_update) runs beside step t+1's
whole schedule; ``update.finish`` after the schedule waits for it and copies its weights over.

memory.activation_checkpointing=full recomputes every block part of the rank's stages in their
backward (m6.memory.recompute: attention sub-block, local experts, dense MLP; routing, dispatch and
the stages' sends kept), applied here, not by the loop's ActivationMemory, whose plan profiles a
forward of the whole model, which no pipeline rank holds; auto profiles each rank's own stages on
the first step and chooses its parts against its own budget (m6.train.pipeline_recompute).
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleZBVZeroBubble)

from m6.config import Config, ConfigError
from m6.data.batch import MultimodalBatch
from m6.memory.recompute import RecomputeParts
from m6.parallel import ShardedModel
from m6.parallel.fsdp import local_part
from m6.train.expert_bias import ExpertBiasUpdate
from m6.train.pipeline_recompute import in_flight, plan_stage_recompute, stage_owners
from m6.train.step_scalars import AllReduceSum, LocalLosses, local_losses
from m6.train.update import ParameterUpdate

SCHEDULES = {"1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B, "zero_bubble": ScheduleZBVZeroBubble}


def check_micro_batches(cfg: Config, accumulation: int) -> None:
    """torch's schedules need at least one micro-batch per pipeline rank (1f1b: per stage), the
    multi-stage ones a whole number of rounds of pipeline_parallel_size micro-batches."""
    p = cfg.parallel
    pp = p.pipeline_parallel_size
    need = f"train.global_batch_size / train.micro_batch_size / data-parallel ranks = {accumulation} micro-batches"
    if accumulation < pp:
        raise ConfigError(f"parallel.pipeline_parallel_size={pp} needs at least {pp} micro-batches per step, got "
                          f"{need}: lower train.micro_batch_size or raise train.global_batch_size")
    if p.pipeline_schedule != "1f1b" and accumulation % pp:
        raise ConfigError(f"parallel.pipeline_schedule={p.pipeline_schedule} needs a multiple of "
                          f"parallel.pipeline_parallel_size={pp} micro-batches per step, got {need}")


class FinalBackwardStage(PipelineStage):
    """A PipelineStage whose gradient sync is on only during its last backward of the step
    (``on_last_backward(True)`` before it, ``(False)`` after), so every gradient is final when the
    sync sees it. Hooks torch's ``backward_maybe_with_nosync``, which its schedules call with
    ``last_backward`` for a stage's full and weight backwards (its own DDP/FSDP switch)."""

    def __init__(self, *args, on_last_backward, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._on_last_backward = on_last_backward

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if not last_backward or backward_type == "input":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        self._on_last_backward(True)
        try:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        finally:
            self._on_last_backward(False)


class PipelineStep:
    """Runs the step's micro-batches through this rank's pipeline stages and returns its losses."""

    def __init__(self, sharded: ShardedModel, cfg: Config, update: ParameterUpdate, expert_bias: ExpertBiasUpdate,
                 device: torch.device, accumulation: int, aux_ranks: int,
                 log: Callable[[str], None] = lambda line: None) -> None:
        check_micro_batches(cfg, accumulation)
        self.sharded, self.update, self.expert_bias, self.device = sharded, update, expert_bias, device
        self.accumulation, self.aux_ranks = accumulation, aux_ranks
        self.group = sharded.groups.pipeline
        self.stage_modules = sharded.stages
        if cfg.memory.activation_checkpointing == "full":  # every part of every block of this rank's stages
            for m in self.stage_modules:
                parts = RecomputeParts(m)
                parts.apply(parts.parts)
        self.num_stages = cfg.parallel.pipeline_parallel_size * len(self.stage_modules)
        # memory.activation_checkpointing=auto: this rank's plan, made on the first step (pipeline_recompute)
        self.memory, self.log, self.recompute_plan = cfg.memory, log, None
        p = cfg.parallel
        self.pp_rank = sharded.groups.layout.pp_rank
        self.stage_owners = stage_owners(p.pipeline_parallel_size, len(self.stage_modules), p.pipeline_schedule)
        self.in_flight = in_flight(p.pipeline_schedule, p.pipeline_parallel_size, len(self.stage_modules),
                                   accumulation, self.pp_rank)
        # Reduce (and offload) a stage's gradients in its last backward, inside the schedule (see the
        # module docstring): m6's gradient sync, on schedules whose every backward is a full one.
        self.sync_in_schedule = cfg.parallel.shard == "none" and cfg.parallel.pipeline_schedule != "zero_bubble"
        if sharded.groups.embedding is not None:
            update.hold_grads([sharded.model.text_embed.tokens.weight])
        self.schedule_class = SCHEDULES[cfg.parallel.pipeline_schedule]
        self.schedule = self._schedule(self.schedule_class, accumulation, self._loss, training=True)
        self._eval_schedules: dict[tuple, object] = {}
        self.last = next((m for m in self.stage_modules if m.is_last), None)
        self._step_targets = 1.0
        self._loss_scale = 1.0  # fp16: the loss scale's multiple rides on the losses (the clip unscales)
        self._lm_sums: list[torch.Tensor] = []

    def _schedule(self, schedule_class, num_micro_batches: int, loss_fn, training: bool = False):
        """A schedule over new PipelineStages of this rank's stage modules (each keeps its micro-batch
        count and shapes: training and each evaluation shape get their own)."""
        stage_class = PipelineStage
        if self.sync_in_schedule and training:  # evaluation runs no backward
            stage_class = functools.partial(FinalBackwardStage,
                                            on_last_backward=lambda last: self.update.begin_micro_batch(last=last))
        stages = [stage_class(m, m.stage_index, self.num_stages, self.device, group=self.group)
                  for m in self.stage_modules]
        one = len(stages) == 1 and schedule_class in (Schedule1F1B, ScheduleGPipe)
        return schedule_class(stages[0] if one else stages, num_micro_batches, loss_fn=loss_fn, scale_grads=False)

    def eval_loss_sum(self, batch: MultimodalBatch, autocast: AbstractContextManager) -> torch.Tensor:
        """The held-out batch's summed target loss (float64, on every pipeline rank): one forward
        through the stages, a forward-only pass of a one-micro-batch schedule (GPipe at one stage
        per rank, the training schedule's class at several), one per batch shape. Not on zero_bubble:
        torch's ScheduleZBVZeroBubble runs backward actions in its eval (config.check_pipeline refuses it)."""
        key = (tuple(batch.text_ids.shape), tuple(batch.images.shape))
        if key not in self._eval_schedules:
            eval_class = ScheduleGPipe if self.schedule_class is Schedule1F1B else self.schedule_class
            self._eval_schedules[key] = self._schedule(
                eval_class, 1, lambda hidden, labels: self.last.rank_model.target_loss_sum(hidden, labels))
        losses: list[torch.Tensor] = []
        with autocast:
            self._eval_schedules[key].eval(batch.text_ids, target=batch.labels, images=batch.images,
                                           has_image=batch.has_image, segment_ids=batch.segment_ids, losses=losses)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if losses:
            total = total + torch.stack(losses).sum().double()
        dist.all_reduce(total, group=self.group)  # the last stage's loss, on every stage
        return total

    def _loss(self, hidden_BLD: torch.Tensor, labels_BL: torch.Tensor) -> torch.Tensor:
        """The last stage's loss_fn: one micro-batch's share of the step's mean target loss."""
        lm_sum = self.last.rank_model.target_loss_sum(hidden_BLD, labels_BL)
        self._lm_sums.append(lm_sum.detach().double())
        return lm_sum * (self._loss_scale / self._step_targets)

    def step(self, batches: list[MultimodalBatch], step_targets: float, autocast: AbstractContextManager,
             all_reduce_sum: AllReduceSum, on_compute_done=lambda: None) -> LocalLosses:
        """Forward/backward of ``batches`` (the step's micro-batches, equal shapes), gradients
        reduced (the update's sync); the step's loss terms, the same on every pipeline rank."""
        shapes = {tuple(b.text_ids.shape) for b in batches}
        assert len(batches) == self.accumulation and len(shapes) == 1, f"micro-batch shapes {shapes}"
        self._step_targets = max(step_targets, 1)
        self._loss_scale = self.update.loss_scale.scale if self.update.loss_scale is not None else 1.0
        self._lm_sums = []
        for m in self.stage_modules:
            m.terms, m.routed = [], []
            m.aux_scale = self._loss_scale / (self.accumulation * self.aux_ranks)
        if self.memory.activation_checkpointing == "auto" and self.recompute_plan is None:
            with autocast:  # every pipeline rank together, before the schedule's first step
                self.recompute_plan = plan_stage_recompute(self.stage_modules, self.memory, batches[0].densest(),
                                                           self.stage_owners, self.pp_rank, self.group, self.device,
                                                           self.in_flight, self.log)
        cat = lambda name: torch.cat([getattr(b, name) for b in batches])  # noqa: E731 (split back by the schedule)
        self.update.begin_micro_batch(last=False)  # the schedule's backwards accumulate locally
        with autocast:
            # return_outputs=False: the last stage's hidden states are not merged into a whole-step copy
            self.schedule.step(cat("text_ids"), target=cat("labels"), images=cat("images"),
                               has_image=cat("has_image"), segment_ids=cat("segment_ids"), return_outputs=False)
        on_compute_done()
        self._add_routed_counts()
        self.update.begin_micro_batch(last=True)
        # every bucket reduced over its stage's groups, in the same order on its ranks; then the tied embedding
        self.update.finish(after_sync=self._sum_tied_embedding)
        return self._losses(all_reduce_sum)

    def _sum_tied_embedding(self) -> None:
        """Tied head on another rank than the embedding: the token embedding's gradient is the sum of
        the first stage's (lookups) and the last stage's (head), on both (m6.parallel.pipeline)."""
        group = self.sharded.groups.embedding
        if group is None:
            return
        weight = self.sharded.model.text_embed.tokens.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        # Under parallel.shard each holds the same rows (the same place in same-sized stages).
        dist.all_reduce(local_part(weight.grad), group=group)

    def _add_routed_counts(self) -> None:
        """The aux-free expert bias: this rank's layers' routed counts over the step's micro-batches
        (each stage's bias then moves with its stage's data-parallel ranks' counts: ExpertBiasUpdate.step)."""
        if not self.expert_bias.enabled:
            return
        totals: dict[int, torch.Tensor] = {}
        for m in self.stage_modules:
            for routed in m.routed[-self.accumulation:]:  # not the shape inference's forward
                for block, counts_E in routed.items():
                    totals[block] = counts_E if block not in totals else totals[block] + counts_E
        self.expert_bias.add_counts(torch.stack([totals[int(name.removeprefix("block"))]
                                                 for name in self.expert_bias.layers]))

    def _losses(self, all_reduce_sum: AllReduceSum) -> LocalLosses:
        """[lm sum, aux, balance, z, kept] summed over the micro-batches and this rank's stages, then
        over the pipeline (one all-reduce): the last stage holds the lm sum, each stage its layers' terms."""
        # The last ``accumulation`` entries: in its first step torch's stages infer their shapes
        # with a forward (and the last stage's loss_fn) on placeholder inputs before the real ones.
        n = self.accumulation
        sums = torch.zeros(5, dtype=torch.float64, device=self.device)
        if self._lm_sums:
            sums[0] = torch.stack(self._lm_sums[-n:]).sum()
        for m in self.stage_modules:
            if m.terms:
                sums[1:] += torch.stack(m.terms[-n:]).sum(0).to(sums.device)
        if self.group is not None:
            dist.all_reduce(sums, group=self.group)
        return local_losses(sums.tolist(), self.accumulation, self.aux_ranks, all_reduce_sum)

    def gather_over_stages(self, *parts: dict) -> tuple[dict, ...]:
        """Each of ``parts`` (per-layer log values keyed by layer, e.g. m6.train.metrics.expert_load's
        and ExpertBiasUpdate.log_values') merged over every stage of the pipeline, on every pipeline
        rank (one object all-gather over the pipeline, at logging steps)."""
        everyone: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, parts, group=self.group)
        merged: tuple[dict, ...] = tuple({} for _ in parts)
        for theirs in everyone:
            for into, part in zip(merged, theirs):
                into.update(part)
        return merged
