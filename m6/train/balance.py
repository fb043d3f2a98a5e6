"""parallel.balance: each data-parallel rank's share of the global batch, in proportion to its
speed (Whale's hardware-aware batch placement).

``even`` keeps the equal split; a list gives one weight per rank; ``auto`` times a few forward +
backward passes of the real model at the run's micro-batch shape on every rank, alone (no
collective inside the timed passes), and all ranks agree on the measured speeds with one
all-gather. A rank's share may be capped (``caps``: the most rows per micro-batch its memory
holds, by the memory estimate), the rest going to the others in proportion to their weights.

The token loss's gradient does not depend on the split: it is normalised by the global step's
target count (m6.train.loss) and capacity is decided per sequence, so the ranks' summed gradients
are those of the same global batch. The MoE aux losses (balance and z) depend on it as soon as a
rank runs more than one micro-batch: each is formed from the routing statistics of one
micro-batch (micro-batch i of every rank together with aux_loss_scope=global, this rank's alone
with local) and averaged over the micro-batches, so moving rows between ranks changes which rows
share statistics, and the aux losses and their gradients with it (docs/moe.md). With one
micro-batch per rank and aux_loss_scope=global they are the whole global batch's, whatever the
split. Every rank runs the same number of micro-batches (m6.data.shares), so the per-micro-batch
collectives of the MoE layers still match.
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from m6.config import Config, ConfigError, accumulation_steps, micro_batch_size
from m6.memory.memory_report import estimate_memory
from m6.model.param_groups import no_decay_ids
from m6.data.shares import batch_shares, micro_batch_sizes, num_micro_batches
from m6.moe import MoELayer
from m6.moe.routing_stats import LocalRoutingStats
from m6.parallel.launch import DistEnv
from m6.parallel.speed_probe import rank_layout_model, speeds_size_experts


@dataclass(frozen=True)
class BatchPlan:
    """How the global batch is split: samples per rank, the micro-batches every rank runs, the
    weights behind it and, for auto, the measured speeds (samples/s per rank)."""

    mode: str  # "even", "weights" or "auto"
    weights: list[float]
    shares: list[int]
    num_micro: int
    speeds: list[float] | None = None

    def micro_rows(self, rank: int) -> list[int]:
        return micro_batch_sizes(self.shares[rank], self.num_micro)

    @property
    def max_micro_batch(self) -> int:
        """The largest micro-batch any rank runs (the first of the largest share)."""
        return max(self.micro_rows(r)[0] for r in range(len(self.shares)))


def cap_shares(global_batch: int, weights: list[float], caps: list[int]) -> list[int]:
    """``batch_shares`` with rank r given at most ``caps[r]`` samples: a capped rank keeps its
    cap and the others split the rest by their weights (repeated until no share exceeds its cap)."""
    if sum(caps) < global_batch:
        raise ValueError(f"the ranks hold at most {sum(caps)} samples together ({caps}), the global batch is "
                         f"{global_batch}")
    fixed: dict[int, int] = {}
    while True:
        free = [r for r in range(len(weights)) if r not in fixed]
        rest = batch_shares(global_batch - sum(fixed.values()), [weights[r] for r in free])
        over = [r for r, s in zip(free, rest) if s > caps[r]]
        if not over:
            shares = dict(zip(free, rest)) | fixed
            return [shares[r] for r in range(len(weights))]
        fixed.update({r: caps[r] for r in over})


def rows_that_fit(cfg: Config, model: torch.nn.Module, world_size: int, expert_parallel_size: int,
                  limit_bytes: float, device_type: str = "cuda", accumulates: bool = False) -> int:
    """The most rows per micro-batch whose estimated step peak (m6.memory.estimate, for this rank's
    share of ``model``) stays within ``limit_bytes``; 0 when not even one row fits. ``accumulates``:
    the rank runs more than one micro-batch (gradients then live through the next backward)."""
    no_decay = no_decay_ids(model)

    def peak(rows: int) -> float:
        accum = 2 if accumulates else 1
        train = dataclasses.replace(cfg.train, global_batch_size=rows * accum * world_size, micro_batch_size=rows)
        return estimate_memory(dataclasses.replace(cfg, train=train), model, no_decay, world_size,
                               expert_parallel_size, device_type).peak_device

    low, high = 0, cfg.train.global_batch_size
    while low < high:  # the peak grows with the rows: the last row count within the limit
        mid = (low + high + 1) // 2
        if peak(mid) <= limit_bytes:
            low = mid
        else:
            high = mid - 1
    return low


def rows_that_fit_layout(cfg: Config, env: DistEnv, expert_parallel_size: int, speeds: list[float],
                         limit_bytes: float, accumulates: bool = False) -> int:
    """``rows_that_fit`` for this rank's share of the model at the layout the run will use: at
    expert parallelism under parallel.balance=auto the measured ``speeds`` size the experts
    (m6.parallel.speed_probe.speeds_size_experts), so a faster rank holds more of them than the even
    probe it was timed on, and its memory cap must count them."""
    weights = list(speeds) if speeds_size_experts(cfg, expert_parallel_size) else None
    model = rank_layout_model(cfg, env, expert_parallel_size, weights)
    return rows_that_fit(cfg, model, env.world_size, expert_parallel_size, limit_bytes, "cuda", accumulates)


def plan_batch(cfg: Config, world_size: int, speeds: list[float] | None = None,
               caps: list[int] | None = None) -> BatchPlan:
    """The split parallel.balance asks for at ``world_size`` ranks (auto: from ``speeds``, each
    rank's micro-batches at most ``caps[r]`` rows, what its memory holds); a ConfigError naming
    the key when it cannot be done."""
    balance, t = cfg.parallel.balance, cfg.train
    if balance == "even":  # micro_batch_size raises when the batch does not split evenly
        micro_batch_size(t, world_size)
        return BatchPlan("even", [1.0] * world_size, [t.global_batch_size // world_size] * world_size,
                         accumulation_steps(t, world_size))
    if balance == "auto":
        assert speeds is not None and len(speeds) == world_size
        weights, mode = list(speeds), "auto"
    else:
        if len(balance) != world_size:
            raise ConfigError(f"parallel.balance has {len(balance)} weights, the job has {world_size} ranks: give "
                              f"one weight per rank (or even / auto)")
        weights, mode = [float(w) for w in balance], "weights"
    if t.global_batch_size < world_size:
        raise ConfigError(f"train.global_batch_size ({t.global_batch_size}) gives some of the {world_size} ranks no "
                          f"sample; parallel.balance needs at least one per rank")
    if caps and min(caps) < 1:
        raise ConfigError(f"parallel.balance={balance}: not even one sample per micro-batch fits in the memory of rank "
                          f"{caps.index(min(caps))} (the memory estimate; see docs/memory.md)")
    try:
        shares = batch_shares(t.global_batch_size, weights)
        num_micro = num_micro_batches(shares, t.micro_batch_size)
        if caps:
            # A rank holding caps[r] rows per micro-batch takes at most caps[r] x num_micro samples. Moving
            # samples off it may shrink the largest share; the ranks then keep num_micro micro-batches (more
            # than the largest share needs is allowed), so no capped rank's micro-batch grows past its cap.
            shares = cap_shares(t.global_batch_size, weights, [c * num_micro for c in caps])
            num_micro = max(num_micro, num_micro_batches(shares, t.micro_batch_size))
    except ValueError as e:
        raise ConfigError(f"parallel.balance={balance}: {e}") from e
    if min(shares) < num_micro:
        raise ConfigError(f"parallel.balance={balance} gives rank {shares.index(min(shares))} {min(shares)} samples "
                          f"(shares {shares}), fewer than the {num_micro} micro-batches every rank runs "
                          f"(train.micro_batch_size={t.micro_batch_size}): raise train.micro_batch_size or "
                          f"train.global_batch_size")
    return BatchPlan(mode, weights, shares, num_micro, speeds)


@contextmanager
def local_routing_stats(model: torch.nn.Module) -> Iterator[None]:
    """Each MoE layer forms its balance statistics from this rank's tokens only, for the duration:
    a timed pass then issues no collective, so it measures this rank alone."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    saved = [layer.stats_reducer for layer in layers]
    for layer in layers:
        layer.stats_reducer = LocalRoutingStats()
    try:
        yield
    finally:
        for layer, reducer in zip(layers, saved):
            layer.stats_reducer = reducer


def measure_speed(forward_backward: Callable[[], None], rows: int, device: torch.device, passes: int = 3) -> float:
    """Samples per second of this rank: one warm-up pass, then the median of ``passes`` timed ones
    of ``forward_backward`` (a micro-batch of ``rows`` samples)."""
    def timed() -> float:
        t0 = time.perf_counter()
        forward_backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    timed()
    seconds = sorted(timed() for _ in range(passes))[passes // 2]
    return rows / seconds


def gather_objects(value, world_size: int) -> list:
    """``value`` of every rank, in rank order (one all-gather; the value itself on one process)."""
    if world_size == 1:
        return [value]
    out: list = [None] * world_size
    dist.all_gather_object(out, value)
    return out


def balance_line(plan: BatchPlan, devices: list[str], experts: list[str] | None = None) -> str:
    """The banner's line: each rank's device, measured speed (auto), share and micro-batches, and
    with expert parallelism the global ids of the experts it holds (``experts``, one per rank)."""
    parts = []
    for r, (device, share) in enumerate(zip(devices, plan.shares)):
        speed = f", {plan.speeds[r]:.3g} samples/s" if plan.speeds else ""
        held = f", experts {experts[r]}" if experts else ""
        parts.append(f"rank {r} {device}{speed}: {share} samples{held}")
    how = {"even": "even", "weights": f"weights {plan.weights}", "auto": "auto (measured speeds)"}[plan.mode]
    return f"balance  {how}, {plan.num_micro} micro-batch(es) per rank | " + "; ".join(parts)


def rank_slots(value: float, rank: int, world_size: int) -> list[float]:
    """``value`` in this rank's slot of a world-size vector of zeros: summed over ranks (one
    all-reduce the step makes anyway) it gives every rank's value. Empty on one process."""
    if world_size == 1:
        return []
    return [value if r == rank else 0.0 for r in range(world_size)]


def split_notes(cfg: Config, plan: BatchPlan) -> list[str]:
    """Start-up lines for an uneven split whose losses depend on it (the user should know)."""
    if plan.mode == "even" or cfg.model.moe.aux_loss_scope != "local":
        return []
    return [f"parallel.balance={cfg.parallel.balance} with model.moe.aux_loss_scope=local: each rank's aux loss is a "
            f"mean over its own tokens and the ranks count equally, so the uneven shares {plan.shares} change the aux "
            f"loss (the LM loss does not); aux_loss_scope=global keeps it independent of the split"]


def finite_or_error(speeds: list[float]) -> list[float]:
    """The measured speeds, or a clear error naming the rank whose timing failed."""
    for r, s in enumerate(speeds):
        if not (s > 0 and math.isfinite(s)):
            raise RuntimeError(f"parallel.balance=auto: rank {r} measured a speed of {s} samples/s")
    return speeds
