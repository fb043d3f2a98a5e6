"""Pipeline parallel in the planner (parallel.pipeline_parallel_size = p, parallel.pipeline_schedule,
parallel.pipeline_stages_per_rank = v): the block stack cut into p x v even stages, the image and
text embeddings in the first and the head and loss in the last; the accumulation micro-batches
are the pipeline's (m of them per step).

A rank is timed as an M6 model of its num_layers / p blocks with the embeddings and the head
(``stage_config``): its compute per micro-batch is then that of the slowest stage plus the
cheaper end's (the patch projection, or the head), an upper bound. ASSUMED for the time: the
blocks of a stage are as dense or MoE as the model's on average (moe.every divides the blocks per
rank). Its memory is sized rank by rank, each its own stages' blocks and ends, over torch's order
of its actions (m6.plan.pipeline_memory).

Schedules (torch.distributed.pipelining); a rank's bubble is the worst rank's idle time of
torch's own action order replayed at the design's costs (m6.plan.pipeline_replay: forward F,
backward 2F, ZB-V's input gradient (1 + a) F and weight gradient (1 - a) F with a the share of the
forward in attention's weightless matmuls; messages apart, below):
  1f1b         Schedule1F1B: replays to the idle share (p - 1) / (m + p - 1) (Narayanan et al.,
               SC'21, section 2.2).
  interleaved  ScheduleInterleaved1F1B, v chunks per rank: replays to (p - 1) / (v m + p - 1)
               (ibid., section 2.2.2).
  zero_bubble  ScheduleZBVZeroBubble, the ZB-V schedule of Qi et al., "Zero Bubble Pipeline
               Parallelism" (ICLR 2024, section 6; torch's docstring cites it): v = 2 chunks in a V
               (rank 0 holds the first and the last stage: the embeddings and the head), the
               weight gradients deferred into the bubble. torch's order is not the paper's
               bubble-free one: at a = 0 it idles 1/6 of a micro-batch's compute at p = 2 and 1/2
               at p = 4, m >= 6 (1 at m = 4: torch lays it out for max(m, 2p - 1) micro-batches
               and drops the missing ones' actions), and its first stage runs its
               whole backward as the weight-gradient action.
Point-to-point: each micro-batch's fp32 residual stream [B, S, D] crosses every stage boundary
forward and its gradient backward; ASSUMED not overlapped with compute, (v m + p - 1) x 2 sends on
a rank's critical path, on the intra-node link when adjacent stages share a node (pp is the
outermost mesh dim: stages are world / p ranks apart), else the inter-node one.
"""

from __future__ import annotations

import dataclasses

from m6.config import Config, num_patches
from m6.model.activation_bytes import RESIDUAL_BYTES
from m6.plan.pipeline_replay import schedule_idle

SCHEDULES = ("1f1b", "interleaved", "zero_bubble")
INTERLEAVED_CHUNKS = 2  # v the search tries for the interleaved schedule


def stages_per_rank(schedule: str) -> int:
    """v of each schedule as the search runs it (zero_bubble: ZB-V needs exactly 2)."""
    return {"1f1b": 1, "interleaved": INTERLEAVED_CHUNKS, "zero_bubble": 2}[schedule]


# What pipelines compose with in the search: recompute none or full (each stage recomputes its own
# blocks' parts; auto's per-rank budgets are not modelled), tensor parallel without sequence
# parallel (each tp rank of a stage sized as tp's rank model: m6.plan.tensor_parallel) and no
# sharding (its per-stage memory is not modelled by m6.plan.pipeline_memory yet); offload:
# m6.plan.pipeline_offload.
PP_RECOMPUTE, PP_SHARD = ("none", "full"), ("none",)


def pipeline_check_refusal(cfg: Config, pp: int, schedule: str, v: int, tp: int = 1) -> str | None:
    """The config check's own refusal of ``cfg`` at this pipeline (m6.config.check_pipeline, where
    this m6 has it), with the search's settings for pipelines (recompute and offload none) and
    ``tp`` tensor-parallel ranks per stage (no sequence parallel)."""
    from m6 import config as m6config
    check = getattr(m6config, "check_pipeline", None)
    if check is None:
        return None
    trial = dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, pipeline_parallel_size=pp, pipeline_schedule=schedule,
                                          pipeline_stages_per_rank=v, tensor_parallel_size=tp,
                                          sequence_parallel=False, shard="none"),
        memory=dataclasses.replace(cfg.memory, activation_checkpointing="none", offload="none"))
    try:
        check(trial)
    except m6config.ConfigError as e:
        return str(e)
    return None


def pipeline_refusal(cfg: Config, pp: int, v: int, micro_batches: int) -> str | None:
    """Why ``cfg`` cannot be cut into pp x v stages run over ``micro_batches``, or None."""
    L = cfg.model.num_layers
    if L % (pp * v):
        return f"model.num_layers ({L}) is not a multiple of {pp} ranks x {v} stages per rank"
    if micro_batches < pp:
        return f"{micro_batches} micro-batches per step are fewer than the {pp} pipeline ranks"
    if v > 1 and micro_batches % pp:
        return f"{micro_batches} micro-batches per step are not a multiple of the {pp} pipeline ranks"
    if cfg.model.share_layers > 1:
        return f"model.share_layers={cfg.model.share_layers}: shared blocks cross stages"
    return None


def stage_config(cfg: Config, pp: int) -> Config:
    """``cfg`` with the model of num_layers / pp blocks: the rank model the step time is profiled
    on (see the module docstring; the memory is sized per rank by ``PipelineMemory``)."""
    if pp == 1:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=cfg.model.num_layers // pp))


def bubble_s(schedule: str, pp: int, v: int, m: int, micro_s: float, attention_share: float) -> float:
    """Idle seconds of a rank per step, ``micro_s`` its forward+backward of one micro-batch and
    ``attention_share`` the share of its forward in attention's weightless matmuls: the worst
    rank's idle of torch's order replayed at the design's costs (m6.plan.pipeline_replay)."""
    if pp == 1:
        return 0.0
    return schedule_idle(schedule, pp, v, m, attention_share) * micro_s


def idle_share(schedule: str, pp: int, v: int, m: int, attention_share: float = 0.0) -> float:
    """The bubble as a share of the rank's step compute time (what docs and tests quote)."""
    busy = m * 1.0
    idle = bubble_s(schedule, pp, v, m, 1.0, attention_share)
    return idle / (busy + idle)


def p2p_s(cfg: Config, pp: int, v: int, m: int, micro_batch: int, world_size: int, gpus_per_node: int,
          latency_s: float, intra_Bps: float, inter_Bps: float) -> float:
    """Seconds per step of the rank's stage-boundary sends on its critical path."""
    if pp == 1:
        return 0.0
    nbytes = micro_batch * (num_patches(cfg.model) + cfg.data.seq_len) * cfg.model.d_model * RESIDUAL_BYTES
    bw = intra_Bps if world_size // pp < gpus_per_node else inter_Bps
    return (v * m + pp - 1) * 2 * (latency_s + nbytes / bw)


