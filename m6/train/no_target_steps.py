"""Stops a run whose data gives it nothing to learn from.

A record the loader skips becomes an all-padding row (m6.data.batch.collate), so a corpus whose
every record is skipped (each too long for data.seq_len, each without a usable task, ...) would
otherwise "train" to the end on empty batches: loss 0, 0 tokens/s, exit 0. The loop hands each
step's job-wide target-token count (the same number on every rank: it is all-reduced) to
``NoTargetSteps.check``; after ``MAX_EMPTY_STEPS`` consecutive steps with none (or a whole run
shorter than that), it raises ``NoTrainingTargets`` naming the skip reasons and their counts.
"""

from __future__ import annotations

from collections.abc import Callable

# A step with no target token can happen by chance (a small global batch of mostly bad records);
# this many in a row cannot, on any corpus worth training on.
MAX_EMPTY_STEPS = 5


class NoTrainingTargets(ValueError):
    """The training data gave no target token for too many steps in a row (bad input: exit 2)."""


class NoTargetSteps:
    """Counts consecutive steps without a target token on any rank and stops the run at the limit.

    ``skips_by_reason``: the job-wide skipped records by reason (SkipLedger.by_reason, a collective:
    it is called on every rank at once, which holds because every rank sees the same count)."""

    def __init__(self, skips_by_reason: Callable[[], dict[str, int]], seq_len: int, max_steps: int,
                 limit: int = MAX_EMPTY_STEPS) -> None:
        self.skips_by_reason, self.seq_len = skips_by_reason, seq_len
        self.limit = max(1, min(limit, max_steps))
        self.empty_in_a_row = 0

    def check(self, num_targets: float, step: int) -> None:
        """Record step ``step`` (counted from 1) with ``num_targets`` target tokens job-wide."""
        self.empty_in_a_row = 0 if num_targets > 0 else self.empty_in_a_row + 1
        if self.empty_in_a_row >= self.limit:
            raise NoTrainingTargets(self.message(step))

    def message(self, step: int) -> str:
        first = step - self.empty_in_a_row + 1
        steps = f"step {step}" if first == step else f"steps {first}-{step}"
        reasons = self.skips_by_reason()
        if not reasons:
            why = "no record was skipped: the records drawn have no target text"
        else:
            counts = ", ".join(f"{reason}: {n}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]))
            why = f"every record drawn was skipped (skipped records by reason: {counts})"
            if "too_long" in reasons:
                why += (f"; too_long: the source leaves no room for a target token at data.seq_len={self.seq_len}"
                        " (raise data.seq_len or shorten the sources)")
        return (f"data: {steps} had no target token on any rank ({self.empty_in_a_row} in a row, the limit): "
                f"{why}; stopping instead of training on empty batches")
