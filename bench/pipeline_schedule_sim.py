"""A pipeline schedule's own idle time: each rank runs its compute actions in the schedule's order,
an action starting when its rank is free and its input is ready (the previous stage's forward of
the micro-batch, or the next stage's input-gradient backward), with the time an action takes and
a message's time given. With textbook costs (forward F, backward 2F, messages free) this is the
schedule's ideal, to set beside the textbook formula; with the costs a run measured it replays
the run (bench/pipeline_bubble.py).

Actions are (stage, kind, micro-batch) with torch's kinds: F forward, B full backward, I
input-gradient backward, W weight-gradient backward. The orders are torch's: a runtime schedule's
``pipeline_order`` (ScheduleInterleaved1F1B, ScheduleZBVZeroBubble: the list its ``step`` walks,
``None`` slots skipped), and Schedule1F1B's hand-written loop (its own ``_get_pipeline_order``, a
drawing, does not match the loop it runs) rewritten by ``one_f_one_b_order``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple


class Op(NamedTuple):
    stage: int
    kind: str  # F, B, I or W
    micro_batch: int


COMPUTE_KINDS = ("F", "B", "I", "W")


def one_f_one_b_order(p: int, m: int) -> dict[int, list[Op]]:
    """Schedule1F1B._step_microbatches' order on each of p ranks (stage r on rank r): min(m, p - r)
    warm-up forwards, then backward, forward alternately, then the remaining backwards."""
    order = {}
    for r in range(p):
        warmup = min(m, p - r)
        ops = [Op(r, "F", i) for i in range(warmup)]
        forwards = warmup
        for b in range(m):
            ops.append(Op(r, "B", b))
            if forwards < m:
                ops.append(Op(r, "F", forwards))
                forwards += 1
        order[r] = ops
    return order


def torch_order(pipeline_order: dict) -> dict[int, list[Op]]:
    """A torch runtime schedule's ``pipeline_order`` (rank -> [_Action | None]) as compute Ops."""
    return {rank: [Op(a.stage_index, a.computation_type.value, a.microbatch_index) for a in actions
                   if a is not None and a.computation_type.value in COMPUTE_KINDS]
            for rank, actions in pipeline_order.items()}


class Replay(NamedTuple):
    makespan: float
    busy: dict[int, float]  # rank -> the seconds of its actions
    spans: dict[Op, tuple[float, float]]  # each action's (start, end)

    def idle_share(self) -> list[float]:
        return [1 - self.busy[r] / self.makespan for r in sorted(self.busy)]


def action_inputs(op: Op, num_stages: int) -> list[Op]:
    """The actions whose results ``op`` needs (on any rank)."""
    s, mb = op.stage, op.micro_batch
    if op.kind == "F":
        return [Op(s - 1, "F", mb)] if s > 0 else []
    if op.kind in ("B", "I"):
        return [Op(s, "F", mb)] + ([Op(s + 1, "B", mb), Op(s + 1, "I", mb)] if s < num_stages - 1 else [])
    return [Op(s, "I", mb)]  # W after its own input-gradient backward


def simulate(order: dict[int, list[Op]], stage_rank: Callable[[int], int], num_stages: int,
             cost: Callable[[Op], float], message_s: float = 0.0) -> Replay:
    """Run ``order`` (rank -> its actions in schedule order): an action starts at the later of its
    rank's previous action's end and its inputs' ends (+ ``message_s`` for an input from another
    rank), and takes ``cost(op)`` seconds."""
    scheduled = {op for ops in order.values() for op in ops}  # of B and I, only the kind the schedule runs
    end: dict[Op, float] = {}
    spans: dict[Op, tuple[float, float]] = {}
    free = {r: 0.0 for r in order}
    busy = {r: 0.0 for r in order}
    position = {r: 0 for r in order}
    while any(position[r] < len(order[r]) for r in order):
        progressed = False
        for r in order:
            while position[r] < len(order[r]):
                op = order[r][position[r]]
                inputs = [i for i in action_inputs(op, num_stages) if i in scheduled]
                if any(i not in end for i in inputs):
                    break
                start = max([free[r]] + [end[i] + (message_s if stage_rank(i.stage) != r else 0.0) for i in inputs])
                took = cost(op)
                end[op] = free[r] = start + took
                spans[op] = (start, start + took)
                busy[r] += took
                position[r] += 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule's order deadlocks: an action waits on one that never runs before it")
    return Replay(max(free.values()), busy, spans)
