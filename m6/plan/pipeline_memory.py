"""Per-rank memory of a pipeline layout (parallel.pipeline_parallel_size = p, its schedule, v stages
per rank): each pipeline rank sized as what it holds and when; the plan's peak is the largest
rank's, and its breakdown names that rank and its stages.

What a rank holds (m6.parallel.pipeline places it; the same code drops the other stages' parts
from a ``meta`` model here, so the parameters are exactly the run's):
- its stages' blocks (dense and MoE as they fall: an interleaved rank r holds stages r, r + p, ...,
  a ZB-V rank r stages r and 2p - 1 - r; parallel.pipeline_stages' boundaries where given), the
  embeddings with stage 0, the final norm (and the LM head, or the tied head's copy of the token
  table) with the last stage; their fp32 weights, gradients (made at a stage's first backward,
  summed over the step's micro-batches) and optimizer state; the update's temporaries
  (m6.memory.estimate's rules); after the schedule, the gradient-sync buckets over each stage's
  data-parallel ranks;
- torch.distributed.pipelining's buffers, per stage and for every micro-batch of the step, made at
  its first step and kept (PipelineStage's args_recv_info and grad_recv_info): a receive buffer
  for the input of a stage that is not the first and one for the output's gradient of a stage that
  is not the last, each the [B, S, D] fp32 residual stream. A stage's received input is its first
  block's input, which that block saves: the activations count it once, as the buffer;
- activations, walked over the rank's actions in the order torch's schedule runs them
  (m6.parallel.pipeline_order): a forward keeps one micro-batch of the stage's units
  (m6.model.activation_bytes, recompute applied) and the stage's output, which the schedule keeps
  for the backward (the [B, S, D] residual; the last stage's [B, L, D] final-normed text); a full
  backward frees them; ZB-V's input-gradient pass keeps them (torch retains the graph) until the
  weight-gradient pass. torch's multi-stage schedules wait for their sends only at the step's
  end, so there the outputs sent to another rank and the input gradients sent back stay until
  then, and ZB-V's input gradients stay on their receive buffers until the next step clears them;
  at each backward the gradients made so far and a backward's transient ride on top;
- the step's inputs (images, ids, labels: the loader's micro-batches and the schedule's
  concatenated copy).
ASSUMED: ZB-V's input-gradient pass holds nothing beyond the forward's activations (torch also
keeps the gradients at the weights' inputs until W: W follows I at once except in the cool-down,
where fewer activations are held). A unit test holds each rank's prediction to the measured peak
of a real pipelined step (tests/dist/test_plan_pipeline_memory_dist.py).
"""

from __future__ import annotations

import copy
import dataclasses

from torch import nn

from m6.config import Config, is_moe_block, micro_batch_size, num_patches
from m6.memory.estimate import (MemoryReport, ModelFacts, activation_report, kept_activations,
                                recomputed_parts)
from m6.memory.shard_estimate import fused_update
from m6.model.activation_bytes import RESIDUAL_BYTES, ActivationBytes
from m6.model.param_groups import no_decay_ids
from m6.parallel.pipeline import drop_other_stages, rank_stage_indices, stage_first_blocks
from m6.plan.memory import rank_model
from m6.plan.pipeline_offload import offloaded_states
from m6.parallel.pipeline_order import rank_actions


def pipeline_firsts(cfg: Config, pp: int, schedule: str, v: int) -> list[int]:
    """The first block of every stage (and num_layers at the end) at this pipeline:
    parallel.pipeline_stages where it names pp x v stages, else the runtime's even cut."""
    stages = cfg.parallel.pipeline_stages
    parallel = dataclasses.replace(cfg.parallel, pipeline_parallel_size=pp, pipeline_schedule=schedule,
                                   pipeline_stages_per_rank=v,
                                   pipeline_stages=stages if stages is not None and len(stages) == pp * v else None)
    return stage_first_blocks(parallel, cfg.model.num_layers)


@dataclasses.dataclass
class _Walk:
    """What walking a rank's schedule found: the peak of activations, kept sends and gradients
    made so far (with a backward's transient), the most activations and sends held at once, and
    what stays past the schedule (ZB-V's input gradients)."""

    peak: float
    held: float
    left_after: float


@dataclasses.dataclass
class _Rank:
    """One pipeline rank: its stages, the model of their parts (on ``meta``) and each stage's
    gradient bytes."""

    index: int
    stages: list[int]
    facts: ModelFacts
    no_decay: set[int]
    stage_grads: dict[int, float]


def _rank_view(whole: nn.Module) -> nn.Module:
    """A module over ``whole``'s parts (the same parameter objects) whose own part list
    drop_other_stages may cut without touching ``whole``: its blocks list and its text embedding
    (the tied head's copy drops the positions) are its own; a rank model without building one."""
    view = nn.Module()
    for name, child in whole.named_children():
        setattr(view, name, child)
    view.blocks = nn.ModuleList(list(whole.blocks))
    if whole.text_embed is not None:
        text = copy.copy(whole.text_embed)
        text._modules = dict(text._modules)
        view.text_embed = text
    view.lm_head = whole.lm_head
    return view


class PipelineMemory:
    """Memory of every pipeline rank at one (model, pp, schedule, v, data-parallel ranks, EP size):
    the rank models built once, each candidate's settings sized on them (``report``)."""

    def __init__(self, cfg: Config, pp: int, schedule: str, v: int, dp: int, ep: int, device_type: str) -> None:
        self.pp, self.schedule, self.v, self.dp, self.ep, self.device_type = pp, schedule, v, dp, ep, device_type
        self.firsts = pipeline_firsts(cfg, pp, schedule, v)
        self.num_stages = len(self.firsts) - 1
        whole = _whole_rank_model(cfg, dp, ep)
        self.ranks = []
        for r in range(pp):
            stages = rank_stage_indices(r, pp, v, schedule)
            model = _rank_view(whole)
            drop_other_stages(model, stages, self.firsts)
            grads = {s: 0.0 for s in stages}
            for name, p in model.named_parameters():
                if p.requires_grad:
                    grads[self._stage_of(name, stages)] += 4.0 * p.numel()
            self.ranks.append(_Rank(r, stages, ModelFacts(model), no_decay_ids(model), grads))

    def stage_units(self, stage: int) -> list[str]:
        """The activation units (m6.model.activation_bytes) a stage's forward keeps."""
        units = [f"blocks.{i}" for i in range(self.firsts[stage], self.firsts[stage + 1])]
        return units + (["embeddings"] if stage == 0 else []) + (["head"] if stage == self.num_stages - 1 else [])

    def report(self, cfg: Config) -> MemoryReport:
        """The largest rank's MemoryReport for ``cfg`` (its train/memory/optim settings; the whole
        model's config), its components named after that rank."""
        acts = activation_report(cfg, self.dp, self.ep, self.device_type)
        return max((self.rank_report(cfg, rank, acts) for rank in self.ranks), key=lambda rep: rep.peak_shared)

    def rank_report(self, cfg: Config, rank: _Rank, acts: ActivationBytes | None = None) -> MemoryReport:
        """One pipeline rank's memory (see the module docstring); ``acts``: the whole model's
        activation bytes at this layout (activation_report)."""
        acts = acts or activation_report(cfg, self.dp, self.ep, self.device_type)
        mb = micro_batch_size(cfg.train, self.dp)
        m = cfg.train.global_batch_size // (mb * self.dp)
        residual = mb * (num_patches(cfg.model) + cfg.data.seq_len) * cfg.model.d_model * RESIDUAL_BYTES
        per_micro, buffers = self._stage_bytes(cfg, rank, acts, mb, m, residual)
        facts = rank.facts
        transient = self._backward_transient(cfg, rank, acts, residual)
        inputs = 2 * step_input_bytes(cfg, self.dp)  # the loader's micro-batches and their concatenation
        walk = self._walk(rank, m, per_micro, transient, residual)
        states = {"params": 4.0 * facts.numel, "grads": 4.0 * facts.numel,
                  "optimizer state": facts.optimizer_state_bytes(cfg.optim.name),
                  "optimizer step temporaries": 0.0 if fused_update(cfg, self.device_type)
                  else 4.0 * facts.largest_call(cfg.optim.apply_groups, rank.no_decay)}
        states, offloaded = offloaded_states(cfg, facts, states, self.device_type)
        buckets = facts.walk(self.dp, self.ep, cfg.parallel.bucket_size_mb * 2**20).most_in_flight()
        where = f"pipeline rank {rank.index} of {self.pp} (stages {', '.join(map(str, rank.stages))})"
        device = {**{k: b for k, b in states.items() if b or not offloaded}, "activations (per micro-batch)": max(per_micro.values()),
                  f"{where}: activations and sends held at the peak": walk.held,
                  f"{where}: receive buffers (inputs, output gradients)": buffers,
                  "backward transients": transient, "gradient-sync buckets": buckets, "step inputs": inputs}
        resident = states["params"] + states["optimizer state"] + buffers
        # After the schedule: its concatenated copy of the inputs and the sends it kept are gone.
        after = states["grads"] + inputs / 2 + walk.left_after
        peak = resident + max(inputs + walk.peak, after + buckets, after + states["optimizer step temporaries"])
        staging = facts.staging_bytes(cfg)  # cached per optimizer on the stage model's facts
        host = {**offloaded, **({"checkpoint staging": staging} if staging else {})}
        peak_host = sum(host.values())  # the host update's temporaries counted beside what stays
        return MemoryReport(device=device, host=host, peak_device=peak, peak_host=peak_host,
                            peak_shared=peak + peak_host)

    def _stage_bytes(self, cfg: Config, rank: _Rank, acts: ActivationBytes, mb: int, m: int,
                     residual: float) -> tuple[dict[int, float], float]:
        """Per stage of ``rank``, what one micro-batch's forward keeps until its backward; and the
        receive buffers of the rank's stages (see the module docstring)."""
        by_unit = acts.kept_by_unit(recomputed_parts(cfg, acts))
        last, local = self.num_stages - 1, set(rank.stages)
        per_micro, buffers = {}, 0.0
        for s in rank.stages:
            held = sum(by_unit.get(u, 0.0) for u in self.stage_units(s))
            if s > 0:
                held -= residual  # its first block's saved input is the receive buffer
                buffers += m * residual
            if s < last:
                buffers += m * residual  # the output's gradient, received
                # The output the schedule keeps for backward, unless it is the next (local) stage's input buffer.
                held += 0.0 if s + 1 in local else residual
            else:
                held += mb * cfg.data.seq_len * cfg.model.d_model * RESIDUAL_BYTES  # the final-normed text
            per_micro[s] = held
        return per_micro, buffers

    def _backward_transient(self, cfg: Config, rank: _Rank, acts: ActivationBytes, residual: float) -> float:
        """A backward's worst moment on top of what is held: the largest transient of the rank's
        layers (or its MoE layers' all-to-all payload, or a recomputed part), beside a parameter's
        new gradient before autograd sums it into the step's (every pipeline step accumulates over
        micro-batches); at 1f1b also the input gradient on its way to the previous stage (the
        multi-stage schedules keep theirs: ``_walk``)."""
        units = [u for s in rank.stages for u in self.stage_units(s)]
        layers = max(acts.transient_by_unit.get(u, 0.0) for u in units)
        moe = any(u.startswith("blocks.") and is_moe_block(cfg.model, int(u.split(".")[1])) for u in units)
        _, redo = kept_activations(cfg, acts)
        new_grad = 4.0 * rank.facts.largest_numel
        sending = residual if self.schedule == "1f1b" and rank.stages[0] > 0 else 0.0
        return max(acts.a2a_buffers if moe else 0.0, layers, redo) + new_grad + sending

    def _walk(self, rank: _Rank, m: int, per_micro: dict[int, float], transient: float,
              residual: float) -> "_Walk":
        """The rank's actions in torch's order (m6.parallel.pipeline_order): the most activations,
        kept sends and gradients alive at once. torch's multi-stage schedules (interleaved, ZB-V)
        wait for their sends at the step's end: a stage's output sent to another rank and an input
        gradient sent back stay until then; ZB-V's input-gradient pass also leaves that gradient
        on the input's receive buffer (until the next step clears it), past the schedule."""
        last, local = self.num_stages - 1, set(rank.stages)
        keeps_sends = self.schedule != "1f1b"
        sent_output = {s: residual if keeps_sends and s < last and s + 1 not in local else 0.0 for s in rank.stages}
        sent_grad = {s: residual if keeps_sends and s > 0 and s - 1 not in local else 0.0 for s in rank.stages}
        held, grads, grads_made, peak, most_held = 0.0, 0.0, set(), 0.0, 0.0
        for kind, s, _ in rank_actions(self.schedule, self.pp, self.v, m, rank.index):
            if kind == "I" and s == 0:
                continue  # torch runs the first stage's whole backward in its W
            if kind == "F":
                held += per_micro[s]
                most_held = max(most_held, held)
                peak = max(peak, held + grads)
                continue
            if kind != "I" and s not in grads_made:
                grads_made.add(s)
                grads += rank.stage_grads[s]
            if kind != "W":
                held += sent_grad[s]  # the input gradient, sent (and kept) from here on
            peak = max(peak, held + grads + transient)
            if kind != "I":  # B or W: the micro-batch's activations go, a kept send stays
                held -= per_micro[s] - sent_output[s]
        left = m * sum(sent_grad.values()) if self.schedule == "zero_bubble" else 0.0
        return _Walk(peak, most_held, left)

    def _stage_of(self, name: str, stages: list[int]) -> int:
        """The rank's stage a parameter of its model belongs to."""
        if name.startswith("blocks."):
            block = int(name.split(".")[1])
            return next(s for s in stages if self.firsts[s] <= block < self.firsts[s + 1])
        if name.startswith(("final_norm.", "lm_head.")) or (name.startswith("text_embed.") and 0 not in stages):
            return self.num_stages - 1
        return 0


_SIZED: dict[tuple, PipelineMemory] = {}
_WHOLE: dict[tuple, nn.Module] = {}


def _whole_rank_model(cfg: Config, dp: int, ep: int) -> nn.Module:
    """The whole model with this rank's experts (m6.plan.memory.rank_model), on ``meta``, made once
    per process: each pipeline rank's view cuts its own stages out of it."""
    key = (repr(cfg.model), dp, ep)
    if key not in _WHOLE:
        _WHOLE[key] = rank_model(cfg, dp, ep)
    return _WHOLE[key]


def pipeline_memory(cfg: Config, pp: int, schedule: str, v: int, dp: int, ep: int, device_type: str) -> PipelineMemory:
    """The PipelineMemory of this layout, made once per process (the search sizes many candidates
    on each)."""
    key = (repr(cfg.model), cfg.parallel.pipeline_stages, pp, schedule, v, dp, ep, device_type)
    if key not in _SIZED:
        _SIZED[key] = PipelineMemory(cfg, pp, schedule, v, dp, ep, device_type)
    return _SIZED[key]


def step_input_bytes(cfg: Config, dp: int) -> float:
    """Bytes of one data-parallel rank's step inputs: images (fp32) and the int64 token ids,
    labels and segment ids of its micro-batches, and the has-image flags."""
    model = cfg.model
    rows = cfg.train.global_batch_size // dp
    image = model.image_channels * model.image_size ** 2 * 4 if num_patches(model) else 0
    return float(rows * (image + 3 * 8 * cfg.data.seq_len + 1))

