"""The order in which one pipeline rank runs its stages' forwards and backwards, as torch's
schedules lay it out (torch.distributed.pipelining.schedules, the schedules m6 runs:
m6.train.pipeline_step), for the planner's memory model (m6.plan.pipeline_memory) and the
trainer's count of micro-batches in flight (auto recompute's budget share at pipeline parallel).

Actions are (kind, stage, micro-batch) with kind F (forward), B (full backward: input and weight
gradients), I (input gradient only, the graph kept for W) and W (weight gradient):
  1f1b         Schedule1F1B on stage r: min(m, p - r) forwards, then a backward and a forward
               in turn, then the remaining backwards.
  interleaved  ScheduleInterleaved1F1B (_get_1f1b_rank_ops): rounds of p micro-batches, each
               forward step on stage ((step // per round) mod v) p + r; warm-up
               (v - 1) x per round + 2 (p - 1 - r) forwards (at most v m), then F and B in turn,
               then the cool-down's backwards, the stage of a backward step counted from the last.
  zero_bubble  ScheduleZBVZeroBubble's V on stages r and 2p - 1 - r: 2 (p - r) - 1 forwards of the
               first, r pairs (F second, F first), p - r triples (F, I, W of the second), then
               (F first, I first, W first, F second, I second, W second) until every forward ran,
               then r pairs of I (first, second), p - r pairs (I first, W first) and the W left;
               laid out for max(m, 2p - 1) micro-batches, the ones past m dropped.
A unit test holds each to torch's own generator (tests/unit/test_plan_pipeline_memory.py).
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple


class Action(NamedTuple):
    kind: str  # F, B, I or W
    stage: int
    micro_batch: int


def rank_actions(schedule: str, pp: int, v: int, m: int, rank: int) -> list[Action]:
    """Pipeline rank ``rank``'s compute actions in run order (see the module docstring)."""
    if schedule == "1f1b":
        return _one_f_one_b(pp, m, rank)
    if schedule == "interleaved":
        return _interleaved(pp, v, m, rank)
    if schedule == "zero_bubble":
        return _zero_bubble_v(pp, m, rank)
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def stage_rank(schedule: str, pp: int, stage: int) -> int:
    """The pipeline rank that runs ``stage`` (m6.parallel.pipeline.rank_stage_indices' inverse):
    stages in loop order, rank r running r, r + p, ..., or zero_bubble's V, rank r running r and
    2p - 1 - r."""
    if schedule == "zero_bubble":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def _one_f_one_b(pp: int, m: int, rank: int) -> list[Action]:
    warmup = min(m, pp - rank)
    out: list[Action] = [Action("F", rank, i) for i in range(warmup)]
    forward = warmup
    for backward in range(m):
        out.append(Action("B", rank, backward))
        if forward < m:
            out.append(Action("F", rank, forward))
            forward += 1
    return out


def _interleaved(pp: int, v: int, m: int, rank: int) -> list[Action]:
    rounds = max(1, m // pp)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    total = v * m
    forward_count: dict[int, int] = defaultdict(int)
    backward_count: dict[int, int] = defaultdict(int)
    out: list[Action] = []

    def forward(step: int) -> None:
        stage = ((step // per_round) % v) * pp + rank
        out.append(Action("F", stage, forward_count[stage]))
        forward_count[stage] += 1

    def backward(step: int) -> None:
        stage = (v - 1 - ((step - warmup) // per_round) % v) * pp + rank
        out.append(Action("B", stage, backward_count[stage]))
        backward_count[stage] += 1

    for step in range(total + warmup):
        if step < warmup:
            forward(step)
        elif step < total:
            forward(step)
            backward(step)
        else:
            backward(step)
    return out


def _zero_bubble_v(pp: int, m: int, rank: int) -> list[Action]:
    n = max(2 * pp - 1, m)
    first, second = rank, 2 * pp - 1 - rank
    count = {(kind, stage): 0 for kind in "FIW" for stage in (first, second)}
    out: list[Action] = []

    def act(kind: str, stage: int, index_of: str | None = None) -> None:
        key = (index_of or kind, stage)
        out.append(Action(kind, stage, count[key]))
        count[key] += 1

    for _ in range(2 * (pp - rank) - 1):
        act("F", first)
    for _ in range(rank):
        act("F", second)
        act("F", first)
    for _ in range(pp - rank):
        act("F", second)
        act("I", second)
        act("W", second)
    while count["F", second] < count["F", first] or count["F", first] < n:
        if count["F", first] < n:
            act("F", first)
        act("I", first)
        act("W", first)
        act("F", second)
        act("I", second)
        act("W", second)
    for _ in range(rank):
        act("I", first)
        act("I", second)
    for _ in range(pp - rank):
        act("I", first)
        act("W", first)
    while count["W", second] < count["I", second]:
        act("W", second)
    while count["W", first] < count["I", first]:
        act("W", first)
    return [a for a in out if a[2] < m]


def most_in_flight(schedule: str, pp: int, v: int, m: int, rank: int) -> float:
    """The most micro-batches' activations ``rank`` holds at once over its actions, in units of
    one micro-batch through all its stages (a stage's forward adds 1/v; a full backward, or ZB-V's
    weight-gradient pass, which frees the graph its input-gradient pass kept, takes it away)."""
    held = most = 0.0
    for kind, _stage, _micro in rank_actions(schedule, pp, v, m, rank):
        if kind == "F":
            held += 1 / v
            most = max(most, held)
        elif kind in ("B", "W"):
            held -= 1 / v
    return most
