"""The bench's replays of a pipeline schedule (bench/pipeline_bubble.py), on the planner's own:
torch's order of each rank's actions (m6.parallel.pipeline_order, held to torch's generators by
tests/unit/test_plan_pipeline_memory.py) run by m6.plan.pipeline_replay. What only the bench
needs lives here: which of its stages' timed holds an action runs, the design's costs in seconds
(every hold ``forward_s`` / v), and a replay of a case at any costs, those a run measured
included.
"""

from __future__ import annotations

from typing import Callable

from m6.parallel.pipeline_order import Action, stage_rank
from m6.plan.pipeline_replay import Replay, design_cost, replay


def held_kinds(action: Action) -> tuple[str, ...]:
    """The holds an action runs: a full backward both; under the split backward (zero bubble) the
    first stage's input-gradient action nothing (no input needs a gradient) and its weight-gradient
    action the whole backward (torch's PipelineStage.backward_one_chunk)."""
    if action.kind == "B" or (action.stage == 0 and action.kind == "W"):
        return ("I", "W")
    return () if action.stage == 0 and action.kind == "I" else (action.kind,)


def nominal_cost(action: Action, v: int, forward_s: float) -> float:
    """The seconds of work an action holds its rank for, by design (each hold forward_s / v): the
    planner's design cost with no attention share (the bench's I and W holds are equal)."""
    return design_cost(action, v) * forward_s


def replay_case(schedule: str, p: int, v: int, order: dict[int, list[Action]], cost: Callable[[Action], float],
                message_s: float = 0.0) -> Replay:
    """``order`` (rank -> actions) of a case with p ranks of v stages each replayed at ``cost``."""
    return replay(order, lambda s: stage_rank(schedule, p, s), p * v, cost, message_s)
