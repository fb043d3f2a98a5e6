"""memory.activation_checkpointing=auto at pipeline parallel (m6.train.pipeline_recompute), real
gloo: each pipeline rank profiles its own stages on the first step and recomputes parts of its own
blocks only, against its share of the budget; recompute is exact in fp32, so the curve is one
process's without it."""

from __future__ import annotations

import re

import pytest
from test_pipeline_parallel_dist import NO_CHECKPOINTS, run
from test_train_world_sizes import assert_same_curve

BUDGET_GIB = 0.0009  # between the stages' all-recomputed and no-recompute bytes per micro-batch (~0.3 / ~1 MiB)
PLAN = re.compile(r"pipeline rank (\d): ([\d.]+) micro-batches in flight, activation checkpointing: recompute "
                  r"(\d+)/(\d+) parts \[([^\]]*)\].*budget ([\d.]+) MiB")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, no recompute: the curve every plan must reproduce."""
    return run(tmp_path_factory.mktemp("w1"), 1, NO_CHECKPOINTS, "data.eval_samples=0")


@pytest.mark.parametrize("schedule, blocks", [("1f1b", [{0, 1}, {2, 3}]), ("zero_bubble", [{0, 3}, {1, 2}])])
def test_pp2_auto_recompute_plans_each_ranks_own_stages(tmp_path, reference, schedule, blocks):
    rows = run(tmp_path, 2, NO_CHECKPOINTS, "data.eval_samples=0", "parallel.pipeline_parallel_size=2",
               f"parallel.pipeline_schedule={schedule}", "memory.activation_checkpointing=auto",
               f"memory.activation_budget_gb={BUDGET_GIB}")
    plans = {int(m[1]): m for m in PLAN.finditer(run.stdout)}
    assert sorted(plans) == [0, 1], run.stdout
    for rank, m in plans.items():
        in_flight, chosen, parts, names = float(m[2]), int(m[3]), int(m[4]), [n for n in m[5].split(", ") if n]
        # The rank's own blocks' parts: attention and the FFN (MoE experts or dense MLP) of each.
        assert parts == 4 and 0 < chosen == len(names), m[0]
        assert {int(n.split(".")[1]) for n in names} <= blocks[rank], m[0]
        # The process budget shared by the micro-batches the rank holds at once (1f1b: stage s, 2 - s).
        assert in_flight == (2 - rank if schedule == "1f1b" else 2), m[0]
        assert float(m[6]) == pytest.approx(BUDGET_GIB * 1024 / in_flight, abs=0.006), m[0]
    assert_same_curve(rows, reference)
