"""Planning a mixed inventory (``--gpus 8xh100,8xv100``): each kind's share of the global batch and
of the experts, by its compute and memory (Whale's objective: minimise the gap between each
device's share of the work and its share of the compute, under its memory limit).

Every figure is PREDICTED: a kind's speed is the datasheet peak x the assumed efficiency of
m6.plan.timing.GPUS over the model FLOPs of the densest sample; its memory is m6.memory.estimate
for the rank's own share of the model (its experts, laid out by m6.parallel.expert_ranges). The
shares are proportional to the speeds (water-filling: a kind whose memory holds less keeps what it
holds, the rest is split over the others by speed), so the ranks would finish their compute
together; the experts' work is assumed to follow the batch share (balanced routing, experts laid
out by the same weights). The step time compared with an even split is the compute part only:
the collectives are the same for both splits.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

from m6.config import Config, ConfigError
from m6.memory.memory_report import estimate_memory
from m6.model.flops import forward_flop_rates, step_flops
from m6.model.param_groups import no_decay_ids
from m6.parallel.expert_ranges import describe_ranges
from m6.parallel.layout import LayoutError, build_layout, resolve_expert_parallel_size
from m6.plan.memory import rank_model
from m6.plan.sizes import parse_size
from m6.plan.timing import GPUS, Hardware, densest_counts

_ENTRY = re.compile(r"\s*(\d+)\s*x\s*([a-z0-9]+)\s*(?::\s*([0-9.]+\s*[kKmMgGtT]?i?[bB]?))?\s*")


@dataclass(frozen=True)
class DeviceKind:
    """``count`` devices of one kind (its memory possibly overridden: ``8xv100:16GB``)."""

    count: int
    hw: Hardware


def parse_inventory(text: str, flag: str = "--gpus") -> list[DeviceKind]:
    """``8xh100,8xv100:16GB`` (comma- or line-separated; ``#`` starts a comment) -> device kinds, in
    rank order (the first kind's devices are ranks 0 .. n-1)."""
    kinds = []
    for entry in re.split(r"[,\n]", re.sub(r"#[^\n]*", "", text)):
        if not entry.strip():
            continue
        m = _ENTRY.fullmatch(entry.lower())
        if not m or m.group(2) not in GPUS or int(m.group(1)) <= 0:
            raise ConfigError(f"{flag}: cannot read {entry.strip()!r} as COUNTxKIND[:MEMORY] with KIND one of "
                              f"{sorted(GPUS)} (e.g. 8xh100,8xv100:16GB)")
        hw = GPUS[m.group(2)]
        if m.group(3):
            hw = dataclasses.replace(hw, memory_gib=parse_size(m.group(3), flag))
        kinds.append(DeviceKind(int(m.group(1)), hw))
    if not kinds:
        raise ConfigError(f"{flag}: no devices given")
    return kinds


def read_inventory(path: str) -> list[DeviceKind]:
    """An inventory file: one ``COUNTxKIND[:MEMORY]`` per line (or comma-separated)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--inventory {path}: {e.strerror}") from e
    return parse_inventory(text, f"--inventory {path}")


@dataclass
class KindPlan:
    """What one kind of device gets (every device of the kind the same)."""

    kind: DeviceKind
    first_rank: int
    seconds_per_sample: float  # PREDICTED compute of one densest sample, forward + backward
    share: float  # samples of the global batch per device (before train.py rounds to whole samples)
    cap: float  # the most samples per device its memory holds (by the memory estimate)
    experts: str  # the global ids of the experts its first device holds
    peak_bytes: float  # PREDICTED device memory peak at its share


@dataclass
class MixedPlan:
    kinds: list[KindPlan]
    expert_parallel_size: int
    num_micro: int
    weights: list[float]  # parallel.balance, one per rank
    step_s: float  # PREDICTED compute part of a step with these shares (the slowest device)
    even_step_s: float  # the same with the even split
    even_fits: bool  # whether every device holds the even share

    def overrides(self) -> list[str]:
        return [f"parallel.expert_parallel_size={self.expert_parallel_size}",
                "parallel.balance=[" + ",".join(f"{w:.4g}" for w in self.weights) + "]"]


def _seconds_per_sample(cfg: Config, model, hw: Hardware) -> float:
    counts = densest_counts(cfg, 1)
    kept = counts.positions * cfg.model.moe.top_k * cfg.model.moe.num_prototypes * len(model.moe_layers())
    return step_flops(forward_flop_rates(model), counts, kept) / (hw.peak_tflops * 1e12 * hw.compute_efficiency)


def _peak(cfg: Config, model, world: int, ep: int, rows: int, num_micro: int) -> float:
    """The memory estimate's device peak of a rank running ``num_micro`` micro-batches of ``rows``."""
    train = dataclasses.replace(cfg.train, global_batch_size=rows * num_micro * world, micro_batch_size=rows)
    return estimate_memory(dataclasses.replace(cfg, train=train), model, no_decay_ids(model), world, ep,
                           "cuda").peak_device


def _rows_that_fit(cfg: Config, model, world: int, ep: int, num_micro: int, limit: float) -> int:
    low, high = 0, cfg.train.global_batch_size
    while low < high:  # the peak grows with the rows: the last row count within the limit
        mid = (low + high + 1) // 2
        if _peak(cfg, model, world, ep, mid, num_micro) <= limit:
            low = mid
        else:
            high = mid - 1
    return low


def water_fill(total: float, speeds: list[float], caps: list[float], floor: float = 0.0) -> list[float]:
    """Shares of ``total`` proportional to ``speeds``, none above its cap nor below ``floor`` (a capped
    or floored one keeps that bound, the rest goes to the others by speed): Whale's objective under
    memory limits; the floor is the sample per micro-batch every rank must run."""
    if sum(caps) < total:
        raise ValueError(f"the devices hold at most {sum(caps):g} samples together, the global batch is {total:g}")
    if min(caps) < floor or floor * len(speeds) > total:
        raise ValueError(f"every device must take at least {floor:g} samples (one per micro-batch); caps {caps}, "
                         f"global batch {total:g}")
    fixed: dict[int, float] = {}
    while True:
        free = [i for i in range(len(speeds)) if i not in fixed]
        rest = total - sum(fixed.values())
        shares = {i: rest * speeds[i] / sum(speeds[j] for j in free) for i in free}
        over = {i: caps[i] for i in free if shares[i] > caps[i] + 1e-9}
        under = {i: floor for i in free if shares[i] < floor - 1e-9}
        if not over and not under:
            return [fixed.get(i, shares.get(i)) for i in range(len(speeds))]
        fixed.update(over or under)  # caps first: lifting a floor then takes from the uncapped only


def plan_mixed(cfg: Config, inventory: list[DeviceKind]) -> MixedPlan:
    """Each kind's share and experts for ``cfg`` on ``inventory`` (a ConfigError when it cannot fit)."""
    if any(k.hw.peak_tflops is None for k in inventory):
        raise ConfigError("a mixed inventory plans GPU kinds only")
    world = sum(k.count for k in inventory)
    G, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    if G < world:
        raise ConfigError(f"train.global_batch_size ({G}) gives some of the {world} devices no sample")
    try:
        ep = resolve_expert_parallel_size(cfg.parallel.expert_parallel_size, world, cfg.model.moe.num_experts)
        if world % ep:
            raise LayoutError(f"parallel.expert_parallel_size ({ep}) must divide the number of devices ({world})")
    except LayoutError as e:
        raise ConfigError(str(e)) from e
    firsts = [sum(k.count for k in inventory[:i]) for i in range(len(inventory))]
    seconds = [_seconds_per_sample(cfg, rank_model(cfg, world, ep, 0), k.hw) for k in inventory]
    rank_kind = [i for i, k in enumerate(inventory) for _ in range(k.count)]
    weights = [1.0 / seconds[i] for i in rank_kind]  # speeds: samples/s per device
    speeds = list(weights)
    caps = [float(G)] * len(inventory)
    # Experts follow the weights and memory the experts: settle both. A kind's cap only ever
    # shrinks (a capped kind holds fewer experts, which would let it hold more rows, which would
    # give it more experts again ...), so this ends, at a split every kind's memory holds.
    for _ in range(8):
        num_micro = 1 if mbs is None else math.ceil(max(G * w / sum(weights) for w in weights) / mbs)
        models = [rank_model(cfg, world, ep, firsts[i], weights) for i in range(len(inventory))]
        caps = [min(caps[i], _rows_that_fit(cfg, models[i], world, ep, num_micro, k.hw.memory_gib * 2**30) * num_micro)
                for i, k in enumerate(inventory)]
        try:
            shares = water_fill(G, speeds, [caps[i] for i in rank_kind], floor=num_micro)
        except ValueError as e:
            raise ConfigError(f"no split fits the devices' memory: {e} (the memory estimate, see docs/memory.md)") from e
        if all(abs(s - w * G / sum(weights)) < 1e-6 * G for s, w in zip(shares, weights)):
            break
        weights = shares
    weights = shares
    layout = build_layout(world, 0, ep, cfg.model.moe.num_experts, world, rank_weights=weights)
    ranges = describe_ranges(list(layout.expert_counts))
    kinds = []
    for i, k in enumerate(inventory):
        share = shares[firsts[i]]
        rows = max(1, math.ceil(share / num_micro))
        kinds.append(KindPlan(k, firsts[i], seconds[i], share, caps[i], ranges[firsts[i] % ep],
                              _peak(cfg, models[i], world, ep, rows, num_micro)))
    even = G / world
    even_model = [rank_model(cfg, world, ep, firsts[i]) for i in range(len(inventory))]
    even_fits = all(_peak(cfg, even_model[i], world, ep, max(1, math.ceil(even / num_micro)), num_micro)
                    <= k.hw.memory_gib * 2**30 for i, k in enumerate(inventory))
    return MixedPlan(kinds, ep, num_micro, weights, max(kp.share * kp.seconds_per_sample for kp in kinds),
                     max(even * s for s in seconds), even_fits)


def describe_mixed(plan: MixedPlan) -> list[str]:
    """The lines the CLI prints for a mixed plan."""
    GiB = 2**30
    lines = []
    for kp in plan.kinds:
        k = kp.kind
        last = kp.first_rank + k.count - 1
        lines.append(f"  {k.count} x {k.hw.name} (ranks {kp.first_rank}-{last}): PREDICTED "
                     f"{1 / kp.seconds_per_sample:,.1f} samples/s each; share {kp.share:.4g} samples each "
                     f"({kp.share * k.count / sum(p.share * p.kind.count for p in plan.kinds):.1%} of the batch, "
                     f"memory holds {kp.cap:g}); experts {kp.experts} on rank {kp.first_rank}; predicted peak "
                     f"{kp.peak_bytes / GiB:,.2f} GiB of {k.hw.memory_gib:g}")
    even = f"{plan.even_step_s:.4g} s" + ("" if plan.even_fits else " (and the even share does not fit every device)")
    lines.append(f"  PREDICTED compute per step {plan.step_s:.4g} s with these shares vs {even} with an even split: "
                 f"{plan.even_step_s / plan.step_s:.2f}x (collectives not included: the same for both)")
    return lines
