"""memory.activation_checkpointing=auto: profile the recomputable parts once, then choose which to
recompute so the activations kept for backward fit a budget at the least recompute time.

The profile runs one forward with *every* part recomputed (so profiling itself needs the least
memory) and, beside each part, runs that part again on the same inputs without recompute,
measuring what its ops save (bytes, exactly, by storage) and how long it takes; the side run's
outputs are dropped at once, so at most one part's activations exist beyond the checkpointed
forward's. What is kept outside all parts (router, dispatch,
combine, embeddings, loss) and what each part keeps when recomputed (its inputs) come from the
main forward. Storages are tracked by identity, so a tensor kept by two parts, or by a part and
the code around it, is counted once in every prediction.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Collection, Iterable, Optional

import torch

from m6.config import MemoryConfig
from m6.memory.recompute import RecomputeParts, checkpointed
from m6.model import RecomputablePart
from m6.memory.activation_meter import SavedActivationMeter, StorageKey

Held = dict[StorageKey, int]  # storage -> bytes


@dataclass
class PartProfile:
    """One part: what it keeps when recomputed (its inputs) or not (what its ops save), and the
    time of one forward of it (= what recomputing it costs)."""

    inputs: Held
    saved: Held
    forward_s: float


@dataclass
class ActivationProfile:
    """Storages kept for backward in one profiled forward, outside the parts and per part (in
    forward order), and which storages were already kept when each part started."""

    outside: Held
    parts: dict[str, PartProfile]
    entry: dict[str, frozenset] = field(default_factory=dict)  # part -> keys held as it started

    def saved_bytes(self, recompute: Collection[str]) -> int:
        """Bytes kept for backward when exactly the parts ``recompute`` are recomputed."""
        held = dict(self.outside)
        for name, part in self.parts.items():
            held.update(part.inputs if name in recompute else part.saved)
        return sum(held.values())

    def tail_bytes(self) -> int:
        """Bytes kept outside every part after the last part started (the last MoE combine, final
        norm, LM head, loss): no recompute choice can change them once they are reached."""
        if not self.parts or not self.entry:
            return 0
        before = self.entry.get(list(self.parts)[-1], frozenset())
        in_parts = set().union(*(p.inputs.keys() | p.saved.keys() for p in self.parts.values()))
        return sum(b for k, b in self.outside.items() if k not in before and k not in in_parts)

    def bytes_at_entry(self, name: str, recompute: Collection[str]) -> int:
        """Bytes kept for backward as part ``name`` starts, when the parts ``recompute`` are recomputed."""
        before = self.entry.get(name, frozenset())
        held = {k: b for k, b in self.outside.items() if k in before}
        for other, part in self.parts.items():
            if other == name:
                break
            held.update(part.inputs if other in recompute else part.saved)
        return sum(held.values())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_parts(recompute: RecomputeParts, forward: Callable[[], object],
                  parameters: Iterable[torch.Tensor], device: torch.device) -> ActivationProfile:
    """Profile every part during one call of ``forward`` (a model forward building its graph).

    Every process must call it at the same point: ``forward`` runs the model's collectives once,
    as a training forward does (the side runs contain none). The RNG is left as it was found, and
    nothing of the forward is kept.
    """
    params = list(parameters)
    outer = SavedActivationMeter(params)
    measured: dict[str, tuple[Held, float]] = {}
    entry: dict[str, frozenset] = {}

    def wrap(part: RecomputablePart, original: Callable) -> Callable:
        recomputed = checkpointed(original)

        def run(*args, **kwargs):
            entry[part.name] = frozenset(outer.held())
            outer.region = part.name  # the meter sees only what the checkpoint keeps: the inputs
            try:
                out = recomputed(*args, **kwargs)
            finally:
                outer.region = None
            # Detached inputs share their storages, so what the side run saves of them is
            # recognised as the same memory the main forward holds.
            side_args = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                         for a in args]
            side = SavedActivationMeter(params, shared_keys=set(outer.held()), private_prefix=part.name)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [],
                                       device_type=device.type), side:
                times = []
                # Twice, keeping the faster: the first call of a kernel pays one-off set-up costs
                # (lazy initialisation, allocator growth) that a recompute later does not.
                for attempt in range(2):
                    _sync(device)
                    t0 = time.perf_counter()
                    side_out = original(*side_args, **kwargs)
                    _sync(device)
                    times.append(time.perf_counter() - t0)
                    if attempt == 0:
                        saved = side.held()
                    del side_out
                measured[part.name] = (saved, min(times))
            return out
        return run

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        with recompute.wrapped(wrap), outer:
            result = forward()
            by_region = outer.held_by_region()
            del result
    missing = [n for n in recompute.parts if n not in measured]
    if missing:
        raise RuntimeError(f"the profiled forward never ran the parts {missing}")
    return ActivationProfile(
        outside=by_region.get(None, {}),
        parts={n: PartProfile(by_region.get(n, {}), *measured[n]) for n in recompute.parts},
        entry=entry,
    )


@dataclass(frozen=True)
class RecomputePlan:
    """The parts to recompute and the numbers behind the choice (bytes per process)."""

    recompute: tuple[str, ...]
    budget_bytes: Optional[int]  # None: memory.activation_checkpointing=full, no budget
    predicted_bytes: int
    no_checkpoint_bytes: int
    all_checkpoint_bytes: int
    recompute_s: float  # profiled forward time of the recomputed parts, added to every backward
    margin: float = 1.0  # chosen to fit budget_bytes / margin (batches that keep more than the profiled one)

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.predicted_bytes * self.margin <= self.budget_bytes

    def summary(self, num_parts: int) -> str:
        mb = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
        budget = "none (full)" if self.budget_bytes is None else mb(self.budget_bytes)
        if self.margin != 1.0:
            budget += f" planned with margin x{self.margin:.3f}"
        text = (f"activation checkpointing: recompute {len(self.recompute)}/{num_parts} parts "
                f"[{', '.join(self.recompute) or '-'}]; saved activations {mb(self.predicted_bytes)} "
                f"(profiled: {mb(self.no_checkpoint_bytes)} without checkpointing, "
                f"{mb(self.all_checkpoint_bytes)} recomputing every part), budget {budget}, "
                f"recompute {self.recompute_s * 1e3:.2f} ms per micro-batch")
        if not self.fits:
            text += " -- WARNING: the budget cannot be met even recomputing every part"
        return text


def budget_bytes(memory: MemoryConfig, no_checkpoint_bytes: int) -> int:
    """memory.activation_budget_gb (GiB), or activation_budget_fraction (default 0.5) of the
    profiled no-checkpointing bytes."""
    if memory.activation_budget_gb is not None:
        return int(memory.activation_budget_gb * 2**30)
    fraction = 0.5 if memory.activation_budget_fraction is None else memory.activation_budget_fraction
    return int(fraction * no_checkpoint_bytes)


def _plan(profile: ActivationProfile, recompute: Iterable[str], budget: Optional[int]) -> RecomputePlan:
    chosen = tuple(n for n in profile.parts if n in set(recompute))
    return RecomputePlan(chosen, budget, profile.saved_bytes(chosen), profile.saved_bytes(()),
                          profile.saved_bytes(tuple(profile.parts)),
                          sum(profile.parts[n].forward_s for n in chosen))


def full_plan(profile: ActivationProfile) -> RecomputePlan:
    """memory.activation_checkpointing=full: every part."""
    return _plan(profile, profile.parts, None)


def choose_recompute(profile: ActivationProfile, budget: int, margin: float = 1.0) -> RecomputePlan:
    """The cheapest set of parts whose recompute brings the kept bytes under ``budget / margin``.

    A 0/1 knapsack (free >= need bytes at the least time). Greedy: repeatedly recompute the part
    that frees the most bytes per second of recompute *given the parts already chosen* (shared
    storages make the gains interact, so they are re-evaluated each round), then drop, most
    expensive first, any chosen part the budget no longer needs. Greedy by ratio is what the
    fractional knapsack solves exactly; with many similar parts (two per block, repeated per
    layer) it is within one part of optimal, and it needs no discretisation of bytes, which an
    exact dynamic programme would. If the budget cannot be met, the plan recomputes every part
    that still lowers the kept bytes and says it does not fit (``fits``).
    """
    holders: Counter = Counter()
    size: dict[StorageKey, int] = {}
    for held in [profile.outside] + [p.saved for p in profile.parts.values()]:
        holders.update(held.keys())
        size.update(held)
    for p in profile.parts.values():
        size.update(p.inputs)
    total = sum(size[k] for k, n in holders.items() if n > 0)

    def delta(part: PartProfile, to_recompute: bool) -> int:
        """Change of kept bytes when ``part`` switches to (or back from) being recomputed."""
        drop, add = (part.saved, part.inputs) if to_recompute else (part.inputs, part.saved)
        change = 0
        for k in drop.keys() | add.keys():
            before = holders[k]
            after = before - (k in drop) + (k in add)
            change += size[k] * ((after > 0) - (before > 0))
        return change

    def switch(part: PartProfile, to_recompute: bool) -> None:
        drop, add = (part.saved, part.inputs) if to_recompute else (part.inputs, part.saved)
        holders.subtract(drop.keys())
        holders.update(add.keys())

    budget_for_profile = int(budget / margin)
    chosen: list[str] = []
    while total > budget_for_profile:
        best, best_rate, best_delta = None, 0.0, 0
        for name, part in profile.parts.items():
            if name in chosen:
                continue
            d = delta(part, True)
            rate = -d / max(part.forward_s, 1e-9)
            if d < 0 and rate > best_rate:
                best, best_rate, best_delta = name, rate, d
        if best is None:
            break
        switch(profile.parts[best], True)
        chosen.append(best)
        total += best_delta
    for name in sorted(chosen, key=lambda n: -profile.parts[n].forward_s):
        d = delta(profile.parts[name], False)
        if total + d <= budget_for_profile:
            switch(profile.parts[name], False)
            chosen.remove(name)
            total += d
    return replace(_plan(profile, chosen, budget), margin=margin)
