"""Exhaustive search over the layouts m6 can run: EP size, micro-batch x accumulation, recompute,
offload (ZeRO-Offload's layout, zero, among them), the delayed update, optim.apply_groups, the
all-to-all dtype and (GPUs, EP > 1) its overlap degree; infeasible ones dropped, the rest ranked
by predicted tokens/s, layouts that differ only in settings the predictions do not see (the
update's groups, the all-to-all dtype where it is the compute dtype, an auto recompute budget that
holds every activation) collapsed into the simplest."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Optional, Union

from m6.config import Config, num_patches
from m6.memory.estimate import MemoryReport
from m6.memory.offload_blocks import AUTO_MEMORY_FRACTION, blocks_to_stream
from m6.plan.memory import RankMemory
from m6.plan.offload_layouts import ZERO, runnable_offload_modes
from m6.plan.timing import Hardware, HostProfile, StepTime, step_time

RECOMPUTE = ("none", "auto", "full")
# memory.offload settings searched: those m6.config accepts (zero, ZeRO-Offload's layout, on GPUs with
# a 16-bit compute dtype, unsharded, once its runtime is there); PLANNED_OFFLOAD: all the planner models.
OFFLOAD = runnable_offload_modes()
# optim.delayed_update (GPUs, unsharded offload; with fp32 or 16-bit host gradients, double-buffered).
# search() tries the synchronous update unless asked; the CLI asks for both (--delayed-update).
DELAYED = (False, True)
SHARD = ("none", "optimizer", "full")  # parallel.shard; with sharding, offload none or (GPUs) optimizer+params
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
        return (self.expert_parallel_size, self.micro_batch, self.offload, self.shard, self.delayed_update,
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
        if self.offload != "none" and self.shard == "none":
            out.append(f"memory.host_grad_dtype={self.host_grad_dtype}")
        if self.delayed_update:
            out.append("optim.delayed_update=true")
        return out


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


def search(cfg: Config, world_size: int, gpus_per_node: int, hw: Hardware, host: HostProfile,
           host_memory_gib: float, cores: int = 0, eps: Optional[list[int]] = None,
           recompute: tuple[str, ...] = RECOMPUTE, offload: tuple[str, ...] = OFFLOAD,
           apply_groups: tuple[int, ...] = APPLY_GROUPS, a2a: tuple[Optional[str], ...] = (None, "bf16"),
           micro_batches: Optional[list[int]] = None, shard: tuple[str, ...] = SHARD,
           overlap: tuple[int, ...] = OVERLAP, delayed: tuple[bool, ...] = (False,)) -> SearchResult:
    """Every combination; the ones whose device peak fits hw.memory_gib and host peak (all ranks
    of a node) fits ``host_memory_gib``, fastest first. ``delayed``: the optim.delayed_update
    settings to try."""
    E = cfg.model.moe.num_experts
    per_rank = cfg.train.global_batch_size // world_size
    eps = eps or [d for d in divisors(world_size) if E % d == 0]
    micro_batches = micro_batches or divisors(per_rank)
    limit = hw.memory_gib * 2**30
    ranks_per_node = min(world_size, gpus_per_node)
    tokens = cfg.train.global_batch_size * (num_patches(cfg.model) + cfg.data.seq_len)
    feasible, smallest, considered, fitting = [], None, 0, 0
    for ep in eps:
        rm = RankMemory(cfg, world_size, ep, "cpu" if hw.peak_tflops is None else "cuda")
        for mb, rc, off, groups, wire, sh, hg, dl in itertools.product(micro_batches, recompute, offload,
                                                                       (*apply_groups, *OFFLOAD_APPLY_GROUPS), a2a,
                                                                       shard, HOST_GRADS, delayed):
            if wire is not None and ep == 1:
                continue  # no all-to-all to compress
            if groups in OFFLOAD_APPLY_GROUPS and (off == "none" or apply_groups != APPLY_GROUPS):
                continue
            if off == ZERO:
                # ZeRO-Offload's layout: 16-bit weights on a GPU, unsharded; host gradients fp32 or
                # 16-bit (with accumulation these add up on the device in 16 bits).
                if hw.peak_tflops is None or hw.precision == "fp32" or sh != "none":
                    continue
            # 16-bit host gradients: m6's own offload, one micro-batch per step, a 16-bit compute dtype.
            elif hg != "fp32" and (off == "none" or sh != "none" or mb != per_rank or hw.precision == "fp32"):
                continue
            # The delayed update: m6's unsharded offload on a GPU, host gradients fp32 or 16-bit
            # (either double-buffered: a second set on the host, counted by the memory estimate).
            if dl and (off == "none" or sh != "none" or hw.peak_tflops is None):
                continue
            # Sharding: with offload only FSDP2's CPU offload of everything (optimizer+params), on a
            # GPU (on a CPU host it moves nothing); not with auto recompute (a config error);
            # nothing to shard at world 1.
            if sh != "none" and ((off != "none" and (off != "optimizer+params" or hw.peak_tflops is None))
                                 or rc == "auto" or world_size == 1):
                continue
            budget = None
            trial = apply_choice(cfg, mb, rc, off, groups, wire, None, hw.precision, sh, host_grads=hg, delayed=dl)
            if rc == "auto":
                # The budget: what the device has left after the step's other memory (half the
                # no-recompute activations when that is less: auto between none and full).
                none = rm.report(apply_choice(cfg, mb, "none", off, groups, wire, None, hw.precision, sh,
                                              host_grads=hg, delayed=dl))
                spare = limit - (none.peak_device - none.device["activations (per micro-batch)"])
                budget = max(min(0.95 * spare, none.device["activations (per micro-batch)"]), 2**20) / 2**30
                trial = apply_choice(cfg, mb, rc, off, groups, wire, budget, hw.precision, sh, host_grads=hg,
                                     delayed=dl)
            elif off == ZERO:
                # ZeRO-Offload's layout keeps every block's 16-bit weights on the device that fit
                # (with auto recompute all of them, the budget taking the rest), streaming the
                # first ones the device cannot keep, as memory.offload_blocks=auto would pick them.
                def zero_peak(streamed: list[int]) -> float:
                    return rm.report(apply_choice(cfg, mb, rc, off, groups, wire, None, hw.precision, sh,
                                                  offload_blocks=streamed, host_grads=hg, delayed=dl)).peak_device
                trial = apply_choice(cfg, mb, rc, off, groups, wire, None, hw.precision, sh, host_grads=hg, delayed=dl,
                                     offload_blocks=blocks_to_stream(len(rm.model.blocks), zero_peak,
                                                                     AUTO_MEMORY_FRACTION * limit))
            considered += 1
            mem = rm.report(trial)
            cand = Candidate(ep, mb, rc, off, groups, wire, mem, None, 0.0, None, budget, shard=sh,  # type: ignore[arg-type]
                             host_grad_dtype=hg if off != "none" else "fp32", delayed_update=dl,
                             offload_blocks=list(trial.memory.offload_blocks) if off == ZERO else None)
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
                    return rm.report(apply_choice(cfg, mb, rc, off, groups, wire, None, hw.precision, sh,
                                                  offload_blocks=streamed, host_grads=hg, delayed=dl)).peak_device
                streamed = blocks_to_stream(len(rm.model.blocks), peak, AUTO_MEMORY_FRACTION * limit)
                if 0 < len(streamed) < len(rm.model.blocks):
                    trial = apply_choice(cfg, mb, rc, off, groups, wire, None, hw.precision, sh, offload_blocks=streamed,
                                         host_grads=hg, delayed=dl)
                    cand.memory, cand.offload_blocks = rm.report(trial), streamed
            # The exchange's form changes only the time (not the memory estimate): each overlap
            # degree a candidate, of the flat exchange and, where the expert-parallel group spans
            # nodes, of node-aware dispatch.
            if ep > 1 and hw.peak_tflops is not None:
                forms = ("flat", "node_aware") if ep > gpus_per_node else ("flat",)
                exchanges = [(d, form) for form in forms for d in overlap]
            else:
                exchanges = [(trial.model.moe.a2a_overlap_degree, trial.model.moe.a2a_dispatch)]
            for degree, dispatch in exchanges:
                timed = dataclasses.replace(cand)
                timed.a2a_overlap_degree, timed.a2a_dispatch = degree, dispatch
                run = apply_choice(trial, mb, rc, off, groups, wire, budget, hw.precision, sh, degree, dispatch,
                                   cand.offload_blocks, host_grads=hg, delayed=dl)
                timed.time = step_time(run, world_size, ep, gpus_per_node, hw, host, cores, rm.model)
                timed.tokens_per_s = tokens / timed.time.total
                if hw.peak_tflops:
                    timed.mfu = timed.time.model_flops / (timed.time.total * world_size * hw.peak_tflops * 1e12)
                feasible.append(timed)
    feasible.sort(key=lambda c: -c.tokens_per_s)
    return SearchResult(collapse_equivalents(feasible), smallest, considered, fitting, len(feasible))


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
