"""memory.activation_checkpointing=auto in training: hold every micro-batch to the budget.

The plan (recompute_plan.choose_recompute) is chosen on one profiled micro-batch, but what the
parts it keeps and the code around them keep for backward changes with the batch: the number of
routed (non-padding) tokens sets the size of the dispatch buffers and of the expert activations,
and under expert parallelism so does how many tokens this rank receives. A plan that fits the
profiled batch can then exceed the budget on a heavier one. The guard:

- meters each training micro-batch with saved-tensor hooks, and as each part the plan keeps
  starts, predicts the micro-batch's final bytes: what is kept now, plus the rest of the plan's
  profiled bytes scaled by how much more this micro-batch keeps than the profiled one did at the
  same point; the tail after the last part (LM head and loss, sized by the loss targets, known
  before the forward) is scaled by at least the ratio of target counts. If the prediction exceeds
  the budget, this part is recomputed too, on this call only (an *extra* recompute; a part has no
  collective, so ranks may choose differently);
- after a step that needed extras or still ended over budget, re-plans on the same profile with a
  margin, the largest ratio of measured to predicted bytes seen so far, so the cheapest parts
  absorb heavy batches and extras become rare.

Recomputing is exact (RNG replayed), so none of this changes the training math.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator, Optional

import torch

from m6.memory.recompute import RecomputeParts
from m6.memory.activation_meter import SavedActivationMeter
from m6.memory.recompute_plan import ActivationProfile, RecomputePlan, choose_recompute


class ActivationBudgetGuard:
    """Applies an auto plan to ``checkpointing`` and keeps each metered micro-batch under ``budget`` bytes."""

    def __init__(self, recompute: RecomputeParts, profile: ActivationProfile, budget: int,
                 parameters: Iterable[torch.Tensor], profiled_targets: int = 0) -> None:
        """``profiled_targets``: loss targets of the profiled micro-batch (0: unknown)."""
        self.parts, self.profile, self.budget = recompute, profile, budget
        self.parameters = list(parameters)
        self.profiled_targets = profiled_targets
        self._tail = profile.tail_bytes()
        self._tail_scale = 1.0
        self._cache: dict = {}  # (part, recompute set) -> _profiled; recompute set -> _predicted
        self.plan: RecomputePlan = choose_recompute(profile, budget)
        self.parts.apply(self.plan.recompute, escalate=self._escalate)
        self._meter: Optional[SavedActivationMeter] = None
        self._recompute: set[str] = set()
        self._ratio = 1.0  # largest measured / predicted bytes of a micro-batch so far
        self.step_extras = 0  # extra part recomputes in this step's micro-batches
        self.step_peak_bytes = 0  # most bytes kept by one of this step's micro-batches
        self._step_ratio = 1.0

    @contextmanager
    def micro_batch(self, num_targets: int = 0) -> Iterator[SavedActivationMeter]:
        """Meter one training forward (enter before it, leave before its backward);
        ``num_targets``: its loss targets (0: unknown)."""
        self._recompute = set(self.plan.recompute)
        known = num_targets > 0 and self.profiled_targets > 0
        self._tail_scale = max(1.0, num_targets / self.profiled_targets) if known else 1.0
        with SavedActivationMeter(self.parameters) as meter:
            self._meter = meter
            try:
                yield meter
            finally:
                self._meter = None
        held = meter.held_bytes()
        predicted = self._predicted(frozenset(self._recompute))
        self.step_peak_bytes = max(self.step_peak_bytes, held)
        if predicted:
            self._step_ratio = max(self._step_ratio, held / predicted)

    def _escalate(self, name: str) -> bool:
        """Asked as a kept part starts: recompute it on this call too?"""
        if self._meter is None:  # not a metered training forward (profiling, the check, evaluation)
            return False
        held = self._meter.held_bytes()
        expected, rest = self._profiled(name, frozenset(self._recompute))
        scale = max(1.0, held / expected) if expected else 1.0
        if held + scale * rest + max(scale, self._tail_scale) * self._tail <= self.budget:
            return False
        self._recompute.add(name)
        self.step_extras += 1
        return True

    def _predicted(self, recompute: frozenset) -> int:
        """Profiled bytes kept with ``recompute`` (cached like ``_profiled``)."""
        if recompute not in self._cache:
            self._cache[recompute] = self.profile.saved_bytes(recompute)
        return self._cache[recompute]

    def _profiled(self, name: str, recompute: frozenset) -> tuple[int, int]:
        """(bytes kept as part ``name`` starts, bytes kept from then to the tail) in the profile;
        cached: the same few recompute sets recur every micro-batch, and each sum walks every storage."""
        key = (name, recompute)
        if key not in self._cache:
            expected = self.profile.bytes_at_entry(name, recompute)
            self._cache[key] = expected, self._predicted(recompute) - expected - self._tail
        return self._cache[key]

    def end_step(self) -> Optional[RecomputePlan]:
        """Close a step's accounting; returns the new plan when the step made the guard re-plan."""
        replan = (self.step_extras > 0 or self.step_peak_bytes > self.budget) and self._step_ratio > self._ratio
        self.step_extras, self.step_peak_bytes = 0, 0
        self._ratio = max(self._ratio, self._step_ratio)
        self._step_ratio = 1.0
        if not replan:
            return None
        plan = choose_recompute(self.profile, self.budget, margin=self._ratio)
        if plan.recompute == self.plan.recompute:
            self.plan = plan
            return None
        self.plan = plan
        self.parts.apply(plan.recompute, escalate=self._escalate)
        return plan
