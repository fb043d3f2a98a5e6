"""Exhaustive search over the layouts m6 can run: tensor parallel (with and without sequence
parallel; a tp group inside a node) and pipeline parallel (each schedule) beside EP size,
micro-batch x accumulation, recompute, offload (ZeRO-Offload's layout, zero, among them), the
delayed update, optim.apply_groups, the all-to-all dtype and (GPUs, EP > 1) its overlap degree;
infeasible ones dropped, the rest ranked by predicted tokens/s, layouts that differ only in
settings the predictions do not see (the update's groups, the all-to-all dtype where it is the
compute dtype, an auto recompute budget that holds every activation) collapsed into the simplest."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Optional, Union

from m6.config import Config, accumulation_steps, micro_batch_size, num_patches
from m6.memory.estimate import MemoryReport
from m6.memory.offload_blocks import AUTO_MEMORY_FRACTION, blocks_to_stream
from m6.model.flops import step_flops
from m6.plan.memory import RankMemory, rank_model
from m6.plan.offload_layouts import ZERO, runnable_offload_modes
from m6.memory.zero_partition_estimate import ADAMW_ONLY
from m6.plan.pipeline import (PP_RECOMPUTE, PP_SHARD, SCHEDULES, bubble_s, p2p_s,
                              pipeline_check_refusal, pipeline_refusal, stage_config, stages_per_rank)
from m6.plan.pipeline_memory import pipeline_memory
from m6.plan.pipeline_offload import PP_OFFLOAD
from m6.plan.tensor_parallel import (TP_OFFLOAD, TP_RECOMPUTE, TP_SHARD, rank_config, sequence_parallel_saving,
                                     tensor_parallel_refusal, tensor_parallel_s)
from m6.plan.timing import Hardware, HostProfile, StepTime, densest_counts, model_facts, step_time

RECOMPUTE = ("none", "auto", "full")
# memory.offload settings searched: those m6.config accepts (zero, ZeRO-Offload's layout, on GPUs with
# a 16-bit compute dtype, unsharded, once its runtime is there); PLANNED_OFFLOAD: all the planner models.
OFFLOAD = runnable_offload_modes()
# optim.delayed_update (GPUs, unsharded offload; with fp32 or 16-bit host gradients, double-buffered).
# search() tries the synchronous update unless asked; the CLI asks for both (--delayed-update).
DELAYED = (False, True)
SHARD = ("none", "optimizer", "full")  # parallel.shard; with sharding, offload none or (GPUs) optimizer+params
# or, with shard=optimizer, zero (its host states partitioned)
APPLY_GROUPS = (1, 2, 4, 8)
# With offload the update's temporaries are host memory, shared by a node's ranks: finer groups too.
OFFLOAD_APPLY_GROUPS = (16, 32)
HOST_GRADS = ("fp32", "compute")  # memory.host_grad_dtype, with m6's offload at one micro-batch per step
OVERLAP = (1, 2, 4)  # model.moe.a2a_overlap_degree, searched on GPUs at EP > 1 (m6.plan.timing)


@dataclass
class Candidate:
    """One layout with its predictions."""

    expert_parallel_size: int
    micro_batch: int
    recompute: str
    offload: str
    apply_groups: int
    a2a_dtype: Optional[str]
    memory: MemoryReport
    time: StepTime
    tokens_per_s: float
    mfu: Optional[float]
    budget_gb: Optional[float] = None
    shortfall: float = 0.0  # largest of device peak / device memory and a node's host peak / host memory
    shard: str = "none"  # parallel.shard
    a2a_overlap_degree: Union[int, str] = 1  # model.moe.a2a_overlap_degree
    a2a_dispatch: str = "flat"  # model.moe.a2a_dispatch
    offload_blocks: Optional[list[int]] = None  # memory.offload_blocks (None: all, with optimizer+params; zero: a list)
    host_grad_dtype: str = "fp32"  # memory.host_grad_dtype
    delayed_update: bool = False  # optim.delayed_update
    tensor_parallel_size: int = 1  # parallel.tensor_parallel_size
    sequence_parallel: bool = False  # parallel.sequence_parallel
    pipeline_parallel_size: int = 1  # parallel.pipeline_parallel_size
    pipeline_schedule: Optional[str] = None  # parallel.pipeline_schedule (pp > 1)
    pipeline_stages_per_rank: int = 1  # parallel.pipeline_stages_per_rank
    # Settings of layouts with this one's predictions, collapsed into it: setting -> their values.
    equivalents_by_setting: dict[str, list[str]] = field(default_factory=dict)

    @property
    def equivalents(self) -> list[str]:
        """The collapsed layouts' settings, e.g. ["apply_groups 2/4/8", "a2a bf16"]."""
        return [f"{name} {'/'.join(values)}" for name, values in self.equivalents_by_setting.items()]

    def _free_settings(self) -> dict[str, str]:
        recompute = self.recompute + (f" (budget {self.budget_gb:.2f} GiB)" if self.budget_gb is not None else "")
        return {"recompute": recompute, "apply_groups": str(self.apply_groups),
                "a2a": self.a2a_dtype or "compute dtype", "host gradients": self.host_grad_dtype}

    def prediction_key(self) -> tuple:
        """Everything but the free settings (_free_settings), and every prediction: equal keys are
        layouts the planner cannot tell apart."""
        mem = self.memory
        return (self.tensor_parallel_size, self.sequence_parallel, self.pipeline_parallel_size,
                self.pipeline_schedule, self.pipeline_stages_per_rank,
                self.expert_parallel_size, self.micro_batch, self.offload, self.shard, self.delayed_update,
                str(self.a2a_overlap_degree), self.a2a_dispatch,
                tuple(self.offload_blocks or ()), dataclasses.astuple(self.time), self.tokens_per_s,
                mem.peak_device, mem.peak_host, mem.peak_shared, tuple(sorted(mem.device.items())),
                tuple(sorted(mem.host.items())))

    def absorb(self, other: "Candidate") -> None:
        """Record ``other`` (same prediction_key) as an equivalent of this layout."""
        mine = self._free_settings()
        for name, value in other._free_settings().items():
            seen = self.equivalents_by_setting.setdefault(name, []) if value != mine[name] else None
            if seen is not None and value not in seen:
                seen.append(value)

    def overrides(self) -> list[str]:
        """The train.py ``key=value`` overrides that run this layout."""
        out = [f"parallel.expert_parallel_size={self.expert_parallel_size}",
               f"train.micro_batch_size={self.micro_batch}",
               f"memory.activation_checkpointing={self.recompute}",
               f"memory.offload={self.offload}", f"optim.apply_groups={self.apply_groups}",
               f"model.moe.a2a_dtype={self.a2a_dtype or 'null'}", f"parallel.shard={self.shard}",
               f"model.moe.a2a_overlap_degree={self.a2a_overlap_degree}", f"model.moe.a2a_dispatch={self.a2a_dispatch}"]
        if self.budget_gb is not None:
            out.append(f"memory.activation_budget_gb={self.budget_gb:.3f}")
        if self.offload_blocks is not None:
            out.append(f"memory.offload_blocks=[{','.join(map(str, self.offload_blocks))}]")
        if self.offload != "none" and (self.shard == "none" or self.offload == ZERO):
            out.append(f"memory.host_grad_dtype={self.host_grad_dtype}")
        if self.delayed_update:
            out.append("optim.delayed_update=true")
        out.append(f"parallel.tensor_parallel_size={self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1:
            out.append(f"parallel.sequence_parallel={str(self.sequence_parallel).lower()}")
        if self.pipeline_parallel_size > 1:  # the keys only where a pipeline is planned
            out += [f"parallel.pipeline_parallel_size={self.pipeline_parallel_size}",
                    f"parallel.pipeline_schedule={self.pipeline_schedule}",
                    f"parallel.pipeline_stages_per_rank={self.pipeline_stages_per_rank}"]
        return out

    def layout_name(self) -> str:
        """The 4-D layout in words: pp x dp x tp, EP inside dp."""
        parts = []
        if self.pipeline_parallel_size > 1:
            parts.append(f"PP {self.pipeline_parallel_size} ({self.pipeline_schedule}, v {self.pipeline_stages_per_rank})")
        if self.tensor_parallel_size > 1:
            parts.append(f"TP {self.tensor_parallel_size}" + (" + sequence parallel" if self.sequence_parallel else ""))
        return ", ".join(parts)


def apply_choice(cfg: Config, micro_batch: int, recompute: str, offload: str, groups: int,
                 a2a: Optional[str], budget_gb: Optional[float], precision: str, shard: Optional[str] = None,
                 overlap: Optional[int] = None, dispatch: Optional[str] = None,
                 offload_blocks: Optional[list[int]] = None, host_grads: str = "fp32", delayed: bool = False) -> Config:
    """``cfg`` with one candidate's settings (the config sections it touches replaced; ``shard``,
    ``overlap`` and ``dispatch`` None keep cfg's parallel.shard, model.moe.a2a_overlap_degree and
    model.moe.a2a_dispatch; ``offload_blocks`` None: every block streams with optimizer+params,
    none with zero; ``host_grads``: memory.host_grad_dtype, with offload; ``delayed``:
    optim.delayed_update)."""
    if offload == ZERO and offload_blocks is None:
        offload_blocks = []
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, shard=shard or cfg.parallel.shard),
        train=dataclasses.replace(cfg.train, micro_batch_size=micro_batch, precision=precision),
        memory=dataclasses.replace(cfg.memory, activation_checkpointing=recompute, offload=offload,
                                   offload_blocks="all" if offload_blocks is None
                                   or offload not in ("optimizer+params", ZERO) else offload_blocks,
                                   host_grad_dtype=host_grads if offload != "none" else "fp32",
                                   activation_budget_gb=budget_gb if recompute == "auto" else None,
                                   activation_budget_fraction=None),
        optim=dataclasses.replace(cfg.optim, apply_groups=groups, delayed_update=delayed and offload != "none",
                                  delayed_update_after=cfg.optim.delayed_update_after),
        model=dataclasses.replace(cfg.model, moe=dataclasses.replace(
            cfg.model.moe, a2a_dtype=a2a,
            a2a_overlap_degree=cfg.model.moe.a2a_overlap_degree if overlap is None else overlap,
            a2a_dispatch=dispatch or cfg.model.moe.a2a_dispatch)))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class SearchResult:
    feasible: list[Candidate]
    smallest: Optional[Candidate]  # the least device memory of all (what an infeasible request is told)
    considered: int  # layouts whose memory was estimated
    fitting: int = 0  # of them, those that fit (each timed with every exchange form)
    timed: int = 0  # fitting layouts x exchange forms; ``feasible`` holds those of distinct predictions
    # Tensor- or pipeline-parallel degrees the search left out, and why (a config check's words).
    skipped_splits: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelSplit:
    """How a layout splits the model itself: tp ranks per operator, pp ranks per block stack."""

    tp: int = 1
    sequence_parallel: bool = False
    pp: int = 1
    schedule: Optional[str] = None
    v: int = 1


def model_splits(cfg: Config, world_size: int, gpus_per_node: int, tps: tuple[int, ...],
                 pps: tuple[int, ...], schedules: tuple[str, ...]) -> tuple[list[ModelSplit], dict[str, str]]:
    """Every (tp, sequence parallel, pp, schedule) the search tries, tp inside a node and tp x pp
    dividing the world; and the degrees left out with why."""
    splits, skipped = [], {}
    for tp in tps:
        if tp > 1 and (world_size % tp or tp > gpus_per_node or gpus_per_node % tp):
            continue
        if tp > 1 and (why := tensor_parallel_refusal(cfg, tp)):
            skipped[f"tp {tp}"] = why
            continue
        for pp in pps:
            if world_size % (tp * pp):
                continue
            for schedule in (SCHEDULES if pp > 1 else (None,)):
                if schedule is not None and schedule not in schedules:
                    continue
                v = stages_per_rank(schedule) if schedule else 1
                if pp > 1 and cfg.model.num_layers % (pp * v):
                    skipped[f"pp {pp} {schedule}"] = (f"model.num_layers ({cfg.model.num_layers}) is not a multiple "
                                                      f"of {pp} ranks x {v} stages per rank")
                    continue
                if pp > 1 and (why := pipeline_check_refusal(cfg, pp, schedule, v, tp)):
                    skipped[f"pp {pp} {schedule}" + (f" x tp {tp}" if tp > 1 else "")] = why
                    continue
                # A stage sends whole sequences: pipelines refuse sequence parallel (config.check_pipeline).
                for sp in ((False, True) if tp > 1 and pp == 1 else (False,)):
                    splits.append(ModelSplit(tp, sp, pp, schedule, v))
    return splits, skipped


def pipeline_builds() -> bool:
    """Whether this m6 has pipeline parallel (parallel.pipeline_parallel_size): plans with pp > 1
    are searched only then, so every printed plan runs."""
    from m6.config import ParallelConfig
    return "pipeline_parallel_size" in {f.name for f in dataclasses.fields(ParallelConfig)}


def search(cfg: Config, world_size: int, gpus_per_node: int, hw: Hardware, host: HostProfile,
           host_memory_gib: float, cores: int = 0, eps: Optional[list[int]] = None,
           recompute: tuple[str, ...] = RECOMPUTE, offload: tuple[str, ...] = OFFLOAD,
           apply_groups: tuple[int, ...] = APPLY_GROUPS, a2a: tuple[Optional[str], ...] = (None, "bf16"),
           micro_batches: Optional[list[int]] = None, shard: tuple[str, ...] = SHARD,
           overlap: tuple[int, ...] = OVERLAP, tps: Optional[tuple[int, ...]] = None,
           pps: Optional[tuple[int, ...]] = None, schedules: tuple[str, ...] = SCHEDULES,
           delayed: tuple[bool, ...] = (False,)) -> SearchResult:
    """Every combination; the ones whose device peak fits hw.memory_gib and host peak (all ranks
    of a node) fits ``host_memory_gib``, fastest first. ``tps`` / ``pps``: the tensor- and
    pipeline-parallel degrees to try (None: tp every power of two within a node; pp every divisor
    of the world up to 16 where this m6 builds pipelines, else 1); ``eps``: EP sizes (those that
    divide each layout's data-parallel ranks are tried); ``delayed``: the optim.delayed_update settings
    to try."""
    if tps is None:
        tps = tuple(t for t in (1, 2, 4, 8) if t <= gpus_per_node)
    builds = pipeline_builds()
    if pps is None:
        pps = tuple(d for d in divisors(world_size) if d <= 16) if builds else (1,)
    splits, skipped = model_splits(cfg, world_size, gpus_per_node, tps, pps, schedules)
    if not builds and pps == (1,):
        skipped["pp"] = ("this m6 has no parallel.pipeline_parallel_size: pipelines not searched (a search with "
                         "explicit pipeline sizes models them all the same: m6.plan.search.search(pps=...))")
    E = cfg.model.moe.num_experts
    limit = hw.memory_gib * 2**30
    ranks_per_node = min(world_size, gpus_per_node)
    tokens = cfg.train.global_batch_size * (num_patches(cfg.model) + cfg.data.seq_len)
    device_type = "cpu" if hw.peak_tflops is None else "cuda"
    feasible, smallest, considered, fitting = [], None, 0, 0
    rank_memories: dict[tuple, RankMemory] = {}
    for split in splits:
        dp = world_size // (split.tp * split.pp)
        if cfg.train.global_batch_size % dp:
            continue
        split_model = split.tp > 1 or split.pp > 1
        base = stage_config(rank_config(cfg, split.tp), split.pp)
        per_rank = cfg.train.global_batch_size // dp
        node_share = max(1, gpus_per_node // split.tp)  # a node's ranks of one tp coordinate
        for ep in ([d for d in eps if dp % d == 0] if eps else [d for d in divisors(dp) if E % d == 0]):
            # With and without sequence parallel the rank holds the same model: built once.
            key = (split.tp, split.pp, dp, ep)
            rm = rank_memories.get(key) or rank_memories.setdefault(key, RankMemory(base, dp, ep, device_type))
            for mb, rc, off, groups, wire, sh, hg, dl in itertools.product(
                    micro_batches or divisors(per_rank), recompute, offload,
                    (*apply_groups, *OFFLOAD_APPLY_GROUPS), a2a, shard, HOST_GRADS, delayed):
                if wire is not None and ep == 1:
                    continue  # no all-to-all to compress
                if groups in OFFLOAD_APPLY_GROUPS and (off == "none" or apply_groups != APPLY_GROUPS):
                    continue
                # ZeRO-Offload with partitioned host states (shard=optimizer: each rank's chunks on
                # its host, AdamW only, every block resident; m6.memory.zero_partition_estimate).
                zero_partitioned = off == ZERO and sh == "optimizer"
                if off == ZERO:
                    # ZeRO-Offload's layout: 16-bit weights on a GPU, unsharded or partitioned; host
                    # gradients fp32 or 16-bit (with accumulation these add up on the device in 16 bits).
                    if hw.peak_tflops is None or hw.precision == "fp32" or sh not in ("none", "optimizer") \
                            or (zero_partitioned and (cfg.optim.name != ADAMW_ONLY or dp == 1)):
                        continue
                # 16-bit host gradients: m6's own offload, one micro-batch per step, a 16-bit compute dtype.
                elif hg != "fp32" and (off == "none" or sh != "none" or mb != per_rank or hw.precision == "fp32"):
                    continue
                # The delayed update: m6's unsharded offload on a GPU, host gradients fp32 or 16-bit
                # (either double-buffered: a second set on the host, counted by the memory estimate).
                if dl and (off == "none" or (sh != "none" and not zero_partitioned) or hw.peak_tflops is None):
                    continue
                # Sharding: with offload only FSDP2's CPU offload of everything (optimizer+params), on a
                # GPU (on a CPU host it moves nothing); not with auto recompute (a config error);
                # nothing to shard at one data-parallel rank.
                if sh != "none" and not zero_partitioned and (
                        (off != "none" and (off != "optimizer+params" or hw.peak_tflops is None)) or rc == "auto"
                        or dp == 1):
                    continue
                # Tensor and pipeline parallel: with what they are built with (TP_*, PP_*).
                if split.tp > 1 and (rc not in TP_RECOMPUTE or off not in TP_OFFLOAD or sh not in TP_SHARD or dl):
                    continue
                if split.pp > 1 and (rc not in PP_RECOMPUTE or off not in PP_OFFLOAD or sh not in PP_SHARD or dl
                                     or pipeline_refusal(cfg, split.pp, split.v, per_rank // mb)):
                    continue
                budget = None
                trial = apply_choice(base, mb, rc, off, groups, wire, None, hw.precision, sh, host_grads=hg, delayed=dl)
                if rc == "auto":
                    # The budget: what the device has left after the step's other memory (half the
                    # no-recompute activations when that is less: auto between none and full).
                    none = rm.report(apply_choice(base, mb, "none", off, groups, wire, None, hw.precision, sh,
                                                  host_grads=hg, delayed=dl))
                    spare = limit - (none.peak_device - none.device["activations (per micro-batch)"])
                    budget = max(min(0.95 * spare, none.device["activations (per micro-batch)"]), 2**20) / 2**30
                    trial = apply_choice(base, mb, rc, off, groups, wire, budget, hw.precision, sh, host_grads=hg,
                                         delayed=dl)
                elif off == ZERO and not zero_partitioned:
                    # ZeRO-Offload's layout keeps every block's 16-bit weights on the device that fit
                    # (with auto recompute all of them, the budget taking the rest), streaming the
                    # first ones the device cannot keep, as memory.offload_blocks=auto would pick them.
                    def zero_peak(streamed: list[int]) -> float:
                        return rm.report(apply_choice(base, mb, rc, off, groups, wire, None, hw.precision, sh,
                                                      offload_blocks=streamed, host_grads=hg, delayed=dl)).peak_device
                    trial = apply_choice(base, mb, rc, off, groups, wire, None, hw.precision, sh, host_grads=hg,
                                         delayed=dl, offload_blocks=blocks_to_stream(len(rm.model.blocks), zero_peak,
                                                                                     AUTO_MEMORY_FRACTION * limit))
                considered += 1
                mem = split_memory(trial, rm, split, dp, ep, mb, per_rank // mb, device_type, rank_config(cfg, split.tp))
                cand = Candidate(ep, mb, rc, off, groups, wire, mem, None, 0.0, None, budget, shard=sh,  # type: ignore[arg-type]
                                 host_grad_dtype=hg if off != "none" else "fp32", delayed_update=dl,
                                 offload_blocks=list(trial.memory.offload_blocks) if off == ZERO else None,
                                 tensor_parallel_size=split.tp, sequence_parallel=split.sequence_parallel,
                                 pipeline_parallel_size=split.pp, pipeline_schedule=split.schedule,
                                 pipeline_stages_per_rank=split.v)
                cand.shortfall = max(mem.peak_device / limit, mem.peak_host * ranks_per_node / (host_memory_gib * 2**30))
                if smallest is None or cand.shortfall < smallest.shortfall:
                    smallest = cand
                if mem.peak_device > limit or mem.peak_host * ranks_per_node > host_memory_gib * 2**30:
                    continue
                fitting += 1
                if off == "optimizer+params" and sh == "none" and hw.peak_tflops is not None and rc != "auto":
                    # Granular offload: stream only the blocks the device cannot keep (what
                    # memory.offload_blocks=auto picks at start-up, as an explicit list), the rest resident.
                    def peak(streamed: list[int]) -> float:
                        return rm.report(apply_choice(base, mb, rc, off, groups, wire, None, hw.precision, sh,
                                                      offload_blocks=streamed, host_grads=hg, delayed=dl)).peak_device
                    streamed = blocks_to_stream(len(rm.model.blocks), peak, AUTO_MEMORY_FRACTION * limit)
                    if 0 < len(streamed) < len(rm.model.blocks):
                        trial = apply_choice(base, mb, rc, off, groups, wire, None, hw.precision, sh,
                                             offload_blocks=streamed, host_grads=hg, delayed=dl)
                        cand.memory, cand.offload_blocks = rm.report(trial), streamed
                # The exchange's form changes only the time (not the memory estimate): each overlap
                # degree a candidate, of the flat exchange and, where the expert-parallel group spans
                # nodes, of node-aware dispatch (not with tensor parallel: refused there).
                if ep > 1 and hw.peak_tflops is not None:
                    forms = ("flat", "node_aware") if ep > node_share and split.tp == 1 else ("flat",)
                    exchanges = [(d, form) for form in forms for d in overlap]
                else:
                    exchanges = [(trial.model.moe.a2a_overlap_degree, trial.model.moe.a2a_dispatch)]
                for degree, dispatch in exchanges:
                    timed = dataclasses.replace(cand)
                    timed.a2a_overlap_degree, timed.a2a_dispatch = degree, dispatch
                    run = apply_choice(trial, mb, rc, off, groups, wire, budget, hw.precision, sh, degree, dispatch,
                                       cand.offload_blocks, host_grads=hg, delayed=dl)
                    timed.time = split_step_time(cfg, run, split, world_size, dp, ep, gpus_per_node, hw, host, cores,
                                                 rm.model) if split_model else \
                        step_time(run, world_size, ep, gpus_per_node, hw, host, cores, rm.model)
                    timed.tokens_per_s = tokens / timed.time.total
                    if hw.peak_tflops:
                        timed.mfu = timed.time.model_flops / (timed.time.total * world_size * hw.peak_tflops * 1e12)
                    feasible.append(timed)
    feasible.sort(key=lambda c: -c.tokens_per_s)
    return SearchResult(collapse_equivalents(feasible), smallest, considered, fitting, len(feasible), skipped)


def split_memory(trial: Config, rm: RankMemory, split: ModelSplit, dp: int, ep: int, micro_batch: int,
                 num_micro: int, device_type: str, whole: Config) -> MemoryReport:
    """The memory estimate of the rank model (``rm``: the tp rank's share of the blocks, at the
    data-parallel world ``dp``), with sequence parallel's saving; with a pipeline, the largest
    pipeline rank's (m6.plan.pipeline_memory: each rank's own stages of ``whole``, the tp rank's
    whole model, with ``trial``'s settings)."""
    if split.pp > 1:
        sized = pipeline_memory(whole, split.pp, split.schedule, split.v, dp, ep, device_type)
        return sized.report(dataclasses.replace(trial, model=whole.model))
    mem = rm.report(trial)
    if split.sequence_parallel:
        saved = sequence_parallel_saving(trial, split.tp, micro_batch)
        device = dict(mem.device)
        device["activations (per micro-batch)"] -= saved
        mem = dataclasses.replace(mem, device=device, peak_device=mem.peak_device - saved,
                                  peak_shared=mem.peak_shared - saved)
    return mem


def split_step_time(whole: Config, run: Config, split: ModelSplit, world_size: int, dp: int, ep: int,
                    gpus_per_node: int, hw: Hardware, host: HostProfile, cores: int, model) -> StepTime:
    """step_time of the rank model (``run``: the tp rank's share of the pipeline rank's blocks) at
    the data-parallel world, its groups' ranks per node those of one tp coordinate; plus the tp
    regions' collectives, the pipeline's bubble and sends; MFU's FLOPs those of the whole model
    (``whole``) over the job's micro-batches."""
    node_share = max(1, gpus_per_node // split.tp)
    t = step_time(run, dp, ep, node_share, hw, host, cores, model)
    mb, m = micro_batch_size(run.train, dp), accumulation_steps(run.train, dp)
    if hw.peak_tflops is None:  # world > dp: the step's scalar all-reduces run all the same
        t.small_collectives = max(t.small_collectives, (5 + (ep > 1)) * hw.latency_s)
    intra = hw.intra_node_GBps * 1e9
    t.tensor_parallel = tensor_parallel_s(run, split.tp, split.sequence_parallel, mb, m, hw.latency_s, intra,
                                          hw.gather_scatter_cost)
    counts = densest_counts(run, mb)
    K = whole.model.moe.top_k * whole.model.moe.num_prototypes
    rates = model_facts(model).rates
    if split.pp > 1:
        forward = step_flops(rates, counts, counts.positions * K * len(model.moe_layers())) / 3
        attention = rates.per_attention_pair * counts.attention_pairs / max(forward, 1.0)
        t.pipeline_bubble = bubble_s(split.schedule, split.pp, split.v, m, t.compute / m, attention)
        t.pipeline_p2p = p2p_s(run, split.pp, split.v, m, mb, world_size, gpus_per_node, hw.latency_s, intra,
                               hw.inter_node_GBps * 1e9)
    t.model_flops = whole_model_flops(whole, mb) * m * dp
    return t


def whole_model_flops(cfg: Config, micro_batch: int) -> float:
    """Forward+backward model FLOPs of one densest micro-batch through the whole model (every block,
    every head; the MoE counted once): MFU's numerator at tensor and pipeline parallel."""
    key = repr(cfg.model)
    if key not in _WHOLE:
        # FLOP rates read one expert's shapes: one expert per rank at EP = E builds the least.
        E = cfg.model.moe.num_experts
        _WHOLE[key] = rank_model(cfg, E, E)
    model = _WHOLE[key]
    counts = densest_counts(cfg, micro_batch)
    K = cfg.model.moe.top_k * cfg.model.moe.num_prototypes
    return step_flops(model_facts(model).rates, counts, counts.positions * K * len(model.moe_layers()))


_WHOLE: dict[int, object] = {}


def collapse_equivalents(ranked: list[Candidate]) -> list[Candidate]:
    """``ranked`` with each group of layouts of the same predictions (Candidate.prediction_key)
    kept once: the first, which is the simplest (the search tries fewer update groups, the
    compute dtype on the wire and fp32 host gradients first, and the sort is stable), naming
    the others."""
    kept: dict[tuple, Candidate] = {}
    for c in ranked:
        first = kept.setdefault(c.prediction_key(), c)
        if first is not c:
            first.absorb(c)
    return list(kept.values())
