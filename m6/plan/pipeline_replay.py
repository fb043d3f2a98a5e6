"""A pipeline schedule's idle time from torch's own action order (m6.parallel.pipeline_order): each
rank runs its actions in that order, an action starting when its rank is free and its inputs are
ready (the previous stage's forward of the micro-batch; for a backward, the stage's own forward
and the next stage's input-gradient or full backward; for a weight-gradient action, the stage's
input-gradient one), with the time an action takes and a message's time given.

The planner's bubble (m6.plan.pipeline.bubble_s) is this replay at the design's costs, messages
free (the planner adds the sends apart): with one micro-batch's forward on a rank 1 (each of its
v stages 1 / v), F 1, a full backward B 2, the split backward I 1 + a and W 1 - a, a the share of
the forward in attention's QK^T and PV (weightless matmuls: their backward is all input
gradient; each linear layer's is one matmul for the input and one for the weight gradient, each
the forward's cost). torch's first stage runs no input-gradient pass (its input needs none) and
its weight-gradient action runs the whole backward (PipelineStage.backward_one_chunk), so there
I is 0 and W 2. ASSUMED: each part runs at the same efficiency.

bench/pipeline_bubble.py replays the same orders from a run's measured holds
(bench.pipeline_schedule_sim).
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache
from typing import Callable, NamedTuple

from m6.parallel.pipeline_order import Action, rank_actions, stage_rank


class Replay(NamedTuple):
    makespan: float
    busy: dict[int, float]  # rank -> the time of its actions
    spans: dict[Action, tuple[float, float]]  # each action's (start, end)

    def idle_share(self) -> list[float]:
        return [1 - self.busy[r] / self.makespan for r in sorted(self.busy)]


def schedule_order(schedule: str, pp: int, v: int, m: int) -> dict[int, list[Action]]:
    """Every pipeline rank's actions in torch's order."""
    return {rank: rank_actions(schedule, pp, v, m, rank) for rank in range(pp)}


def action_inputs(action: Action, num_stages: int) -> list[Action]:
    """The actions whose results ``action`` needs (on any rank); of a next stage's B and I, the
    schedule runs one."""
    s, mb = action.stage, action.micro_batch
    if action.kind == "F":
        return [Action("F", s - 1, mb)] if s > 0 else []
    if action.kind in ("B", "I"):
        after = [Action("B", s + 1, mb), Action("I", s + 1, mb)] if s < num_stages - 1 else []
        return [Action("F", s, mb)] + after
    return [Action("I", s, mb)]  # W after its own input-gradient backward


def replay(order: dict[int, list[Action]], rank_of: Callable[[int], int], num_stages: int,
           cost: Callable[[Action], float], message_s: float = 0.0) -> Replay:
    """Run ``order`` (rank -> its actions in schedule order): an action starts at the later of its
    rank's previous action's end and its inputs' ends (+ ``message_s`` for an input from another
    rank, ``rank_of(stage)``), and takes ``cost(action)``. An order in which an action waits on one
    that never runs before it is refused (ValueError), not a hang."""
    scheduled = {a for actions in order.values() for a in actions}
    end: dict[Action, float] = {}
    spans: dict[Action, tuple[float, float]] = {}
    free = {r: 0.0 for r in order}
    busy = {r: 0.0 for r in order}
    position = {r: 0 for r in order}
    blocked_on: dict[Action, list[int]] = {}  # an action not yet run -> the ranks waiting for it
    runnable = deque(order)
    while runnable:
        r = runnable.popleft()
        while position[r] < len(order[r]):
            action = order[r][position[r]]
            inputs = [i for i in action_inputs(action, num_stages) if i in scheduled]
            missing = next((i for i in inputs if i not in end), None)
            if missing is not None:
                blocked_on.setdefault(missing, []).append(r)
                break
            start = max([free[r]] + [end[i] + (message_s if rank_of(i.stage) != r else 0.0) for i in inputs])
            took = cost(action)
            end[action] = free[r] = start + took
            spans[action] = (start, start + took)
            busy[r] += took
            position[r] += 1
            runnable.extend(blocked_on.pop(action, ()))
    if any(position[r] < len(order[r]) for r in order):
        raise ValueError("the schedule's order deadlocks: an action waits on one that never runs before it")
    return Replay(max(free.values()), busy, spans)


def design_cost(action: Action, v: int, attention_share: float = 0.0) -> float:
    """An action's work at the design's costs (module docstring), one micro-batch's forward on a
    rank 1."""
    first = action.stage == 0
    units = {"F": 1.0, "B": 2.0, "I": 0.0 if first else 1.0 + attention_share,
             "W": 2.0 if first else 1.0 - attention_share}[action.kind]
    return units / v


def schedule_idle(schedule: str, pp: int, v: int, m: int, attention_share: float = 0.0) -> float:
    """The worst rank's idle time per step of torch's order at the design's costs, in units of
    one micro-batch's forward and backward on a rank (the 1f1b and interleaved schedules run no
    split backward: ``attention_share`` does not change them)."""
    return _replayed_idle(schedule, pp, v, m, attention_share if schedule == "zero_bubble" else 0.0)


@lru_cache(maxsize=None)  # the search asks for the same few layouts at every candidate
def _replayed_idle(schedule: str, pp: int, v: int, m: int, attention_share: float) -> float:
    done = replay(schedule_order(schedule, pp, v, m), lambda s: stage_rank(schedule, pp, s), pp * v,
                  lambda a: design_cost(a, v, attention_share))
    return max(done.makespan - busy for busy in done.busy.values()) / 3.0
