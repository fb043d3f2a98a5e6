"""The micro-batches a pipeline rank holds at once: the trainer's count (auto recompute's budget
share, m6.train.pipeline_recompute) and the planner's (m6.plan.pipeline) are one formula."""

from __future__ import annotations

import pytest

from m6.plan.pipeline import in_flight as planned
from m6.train.pipeline_recompute import in_flight


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zero_bubble", 2)])
def test_trainer_and_planner_count_the_same_micro_batches_in_flight(schedule, v):
    for pp in (2, 3, 4, 8):
        for m in (pp, 2 * pp, 4 * pp):
            for rank in range(pp):
                assert in_flight(schedule, pp, v, m, rank) == planned(schedule, pp, v, m, rank), (pp, m, rank)
    assert in_flight("1f1b", 4, 1, 8, 0) == 4 and in_flight("1f1b", 4, 1, 8, 3) == 1
