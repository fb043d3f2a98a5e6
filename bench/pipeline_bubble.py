"""Pipeline bubble: each rank's measured idle share of a step under torch's 1F1B, interleaved 1F1B
and zero-bubble (ZBV) schedules, as m6.train.pipeline_step drives them (the same classes,
scale_grads=False), against the schedule's formula: (p-1)/(m+p-1) for 1F1B, (p-1)/(v*m+p-1) for
interleaved with v stages per rank; ZBV is shown measured only (its bubble vanishes in theory when
forward, input-gradient and weight-gradient work take the same time, as here, and enough
micro-batches fill the V).

The stages do equal, known work: each micro-batch's forward holds its stage for ``forward_ms``, its
backward for ``forward_ms`` on the input-gradient path and ``forward_ms`` on the weight-gradient
path (sleeps inside autograd functions, divided by v when a rank runs v stages; 1F1B and
interleaved run both paths in one backward, ZBV runs the weight path later), so the work does not
compete for this machine's 2 cores and 4 ranks can run the pipeline p = 4. What is measured is the schedule's idle time, point-to-point messages included (a
[1, 4] activation per micro-batch over gloo); not a model's compute.

Idle share of rank r = 1 - busy_r / makespan: busy_r is the time rank r spent inside its stages'
holds (each timed by the monotonic clock around the sleep, oversleeping counted as busy); the
makespan runs from the common start after a barrier to the last rank's end of ``schedule.step``
(CLOCK_MONOTONIC is one clock for every process on the machine). The formula assumes the same
makespan for all ranks, with every rank busy m x (F + B). Median over rounds, with the range.

Beside the formula, the schedule's own idle share: torch's action order for the case replayed with
the design's costs and free messages (m6.plan.pipeline_replay, the planner's bubble), which says whether the order
itself idles more than the formula. Each round is then replayed on that order from its measured
holds (each hold tagged with its stage, kind and micro-batch; the bench checks every rank ran its
holds in the order replayed) to split the step's time beyond the ideal into the holds' oversleep,
the fixed time of an action outside its hold, the messages' time and the step's entry and exit.

    python -m bench.pipeline_bubble            # writes bench/results/pipeline_bubble-cpu-<n>core.{md,json}
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage

from bench.harness import free_port, machine_info, machine_tag, write_results
from bench.pipeline_schedule_sim import held_kinds, nominal_cost, replay_case
from m6.parallel.pipeline import rank_stage_indices
from m6.parallel.pipeline_order import Action, stage_rank
from m6.plan.pipeline_replay import action_inputs, schedule_order
from m6.train.pipeline_step import SCHEDULES


class TimedWork(torch.autograd.Function):
    """x -> x (a copy), holding the stage ``forward_s`` in forward and ``backward_s`` in backward;
    each hold goes to ``holds`` as (stage, kind, start, end): kind F in forward, ``backward_kind`` in
    backward (I on the activation's path, W on the weight's: its forward holds nothing, and the
    zero-bubble schedule runs it apart)."""

    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float, holds: list, stage: int, backward_kind: str):
        ctx.backward_s, ctx.holds, ctx.stage, ctx.backward_kind = backward_s, holds, stage, backward_kind
        if forward_s:
            t0 = time.monotonic()
            time.sleep(forward_s)
            holds.append((stage, "F", t0, time.monotonic()))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        t0 = time.monotonic()
        time.sleep(ctx.backward_s)
        ctx.holds.append((ctx.stage, ctx.backward_kind, t0, time.monotonic()))
        return grad, None, None, None, None, None


class EqualStage(nn.Module):
    """One stage of equal work: the activation's path holds the forward and the input-gradient
    work (behind a weight, so the first stage, whose input needs no gradient, still runs it, as a
    real first stage's layers do), a second weight's path the weight-gradient work."""

    def __init__(self, stage: int, forward_s: float, holds: list) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.weight = nn.Parameter(torch.ones(()))
        self.stage, self.forward_s, self.holds = stage, forward_s, holds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = TimedWork.apply(x * self.scale, self.forward_s, self.forward_s, self.holds, self.stage, "I")
        return h * TimedWork.apply(self.weight, 0.0, self.forward_s, self.holds, self.stage, "W")


def formula(schedule: str, p: int, m: int, v: int) -> float | None:
    if schedule == "zero_bubble":
        return None
    return (p - 1) / (m + p - 1) if schedule == "1f1b" else (p - 1) / (v * m + p - 1)


def _op_holds(rank_holds: list) -> dict[Action, list[tuple[float, float]]]:
    """A rank's holds of one step as (kind, stage, micro-batch) -> [(start, end)]: each stage runs
    its micro-batches' forwards, and each kind of backward, in micro-batch order."""
    count: dict[tuple, int] = {}
    out: dict[Action, list] = {}
    for stage, kind, t0, t1 in sorted(rank_holds, key=lambda h: h[2]):
        mb = count[(stage, kind)] = count.get((stage, kind), -1) + 1
        out[Action(kind, stage, mb)] = [(t0, t1)]
    return out


def decompose(order: dict[int, list[Action]], schedule: str, p: int, v: int, forward_s: float, everyone: list) -> dict:
    """One measured step replayed on its own schedule (bench.pipeline_schedule_sim), to say where
    its makespan beyond the schedule's ideal went, cumulatively: the holds' oversleep (this
    shared machine's load), the fixed time of every action outside its hold (torch's stage and
    schedule Python, autograd, this stage's small tensor ops, the loss), the messages' time beyond
    that, and the step's entry and exit. ``everyone``: per rank (step start, step end, holds)."""
    to_rank, num_stages = (lambda s: stage_rank(schedule, p, s)), p * v
    holds: dict[Action, list] = {}
    for _, _, rank_holds in everyone:
        holds.update(_op_holds(rank_holds))
    spans: dict[Action, list] = {}  # each action's holds
    for rank, ops in order.items():
        for op in ops:
            spans[op] = [h for k in held_kinds(op) for h in holds[Action(k, op.stage, op.micro_batch)]]
    for rank, ops in order.items():  # the run kept the order replayed
        ran = sorted((op for op in ops if spans[op]), key=lambda op: spans[op][0][0])
        if ran != [op for op in ops if spans[op]]:
            raise RuntimeError(f"rank {rank} ran its actions in another order than the replayed schedule's: {ran}")
    start = min(e[0] for e in everyone)
    makespan = max(e[1] for e in everyone) - start
    first = lambda op: min(h[0] for h in spans[op])  # noqa: E731
    last = lambda op: max(h[1] for h in spans[op])  # noqa: E731
    held = {op: sum(h[1] - h[0] for h in spans[op]) for op in spans}
    inner = {op: last(op) - first(op) - held[op] if spans[op] else 0.0 for op in spans}  # between B's holds
    local, hops = [], []
    for rank, ops in order.items():
        waits_on: dict[Action, list[Action]] = {}  # a held action's remote inputs, and those of the actions without holds
        pending: list[Action] = []  # before it (they wait on their inputs, then run nothing)
        for op in ops:
            pending += [i for i in action_inputs(op, num_stages) if i in spans and to_rank(i.stage) != rank]
            if spans[op]:
                waits_on[op], pending = pending, []
        ops = [op for op in ops if spans[op]]
        for before, op in zip([None] + ops[:-1], ops):
            remote = [i for i in waits_on[op] if spans[i]]
            free = last(before) if before is not None else None
            ready = max((last(i) for i in remote), default=None)
            if ready is not None and (free is None or ready > free):
                hops.append(first(op) - ready)  # waited on another rank's result
            elif free is not None:
                local.append(first(op) - free)
    gap = statistics.mean(local)
    message = max(0.0, statistics.mean(hops) - gap) if hops else 0.0
    own = {op: held[op] + inner[op] + (gap if spans[op] else 0.0) for op in spans}  # an action's time on its rank
    ideal = replay_case(schedule, p, v, order, lambda op: nominal_cost(op, v, forward_s)).makespan
    with_holds = replay_case(schedule, p, v, order, held.__getitem__).makespan
    with_ops = replay_case(schedule, p, v, order, own.__getitem__).makespan
    with_messages = replay_case(schedule, p, v, order, own.__getitem__, message).makespan
    ends = [min(first(op) for op in order[to_rank(0)] if spans[op]) - start,  # the step's entry
            max(e[1] for e in everyone) - max(last(op) for op in spans if spans[op])]  # and exit
    return {"makespan": makespan, "ideal": ideal, "oversleep": with_holds - ideal, "per_action": with_ops - with_holds,
            "messages": with_messages - with_ops, "entry_exit": sum(ends),
            "rest": makespan - with_messages - sum(ends), "gap_ms": 1000 * gap, "message_ms": 1000 * message}


EXCESS = ("oversleep", "per_action", "messages", "entry_exit", "rest")  # decompose's parts of the excess


def _spread_ms(seconds: list[float]) -> dict:
    return {"median": 1000 * statistics.median(seconds), "min": 1000 * min(seconds), "max": 1000 * max(seconds)}


def _rank(rank: int, world: int, port: int, cases: list[dict], forward_ms: float, rounds: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = []
    for case in cases:
        p, m, v, schedule = case["p"], case["m"], case["v"], case["schedule"]
        group = dist.new_group(list(range(p)))  # every rank creates it; ranks >= p sit the case out
        if rank >= p:
            continue
        holds: list[tuple] = []
        indices = rank_stage_indices(rank, p, v, schedule)
        stages = [PipelineStage(EqualStage(s, forward_ms / 1000 / v, holds), s, p * v, torch.device("cpu"), group=group)
                  for s in indices]
        cls = SCHEDULES[schedule]
        sched = cls(stages[0] if v == 1 else stages, m, loss_fn=lambda y, t: (y * t).sum(), scale_grads=False)
        order = schedule_order(schedule, p, v, m)
        x, target = torch.ones(m, 4), torch.ones(m, 4)
        idle, parts = [], []
        for r in range(rounds + 2):  # 2 warm-up steps (the first infers shapes)
            dist.barrier(group=group)
            holds.clear()
            start = time.monotonic()
            sched.step(x, target=target)
            end = time.monotonic()
            everyone: list = [None] * p
            dist.all_gather_object(everyone, (start, end, list(holds)), group=group)
            if r >= 2 and rank == 0:
                makespan = max(e for _, e, _ in everyone) - min(s for s, _, _ in everyone)
                idle.append([1 - sum(h[3] - h[2] for h in hs) / makespan for _, _, hs in everyone])
                parts.append(decompose(order, schedule, p, v, forward_ms / 1000, everyone))
        if rank == 0:
            unit = replay_case(schedule, p, v, order, lambda op: nominal_cost(op, v, 1.0))
            results.append({**case, "rounds": rounds, "formula": formula(schedule, p, m, v),
                            "schedule_idle_share": max(unit.idle_share()),
                            "idle_share_per_rank": [statistics.median(i[k] for i in idle) for k in range(p)],
                            "worst_rank_idle_share_per_round": [max(i) for i in idle],
                            "ideal_makespan_ms": 1000 * parts[0]["ideal"],
                            **{f"{k}_ms": _spread_ms([q[k] for q in parts]) for k in ("makespan", *EXCESS)},
                            "per_action_gap_ms": statistics.median(q["gap_ms"] for q in parts),
                            "message_ms": statistics.median(q["message_ms"] for q in parts)})
    alone = dist.new_group([0])
    if rank == 0:
        out.put({"cases": results, "action_cpu_ms": {v: action_cpu_ms(v, alone) for v in (1, 2)}})
    dist.barrier()
    dist.destroy_process_group()


def action_cpu_ms(v: int, group, num_micro_batches: int = 32, steps: int = 9) -> float:
    """The CPU time of one schedule action with empty holds, on a one-rank pipeline (v stages, no
    messages), median over steps: torch's schedule and stage Python, autograd and this bench's
    stage, what each action costs before this machine's load stretches it."""
    stages = [PipelineStage(EqualStage(s, 0.0, []), s, v, torch.device("cpu"), group=group) for s in range(v)]
    cls = SCHEDULES["1f1b" if v == 1 else "interleaved"]
    sched = cls(stages[0] if v == 1 else stages, num_micro_batches, loss_fn=lambda y, t: (y * t).sum(),
                scale_grads=False)
    x = torch.ones(num_micro_batches, 4)
    seconds = []
    for r in range(steps + 2):
        t0 = time.process_time()
        sched.step(x, target=x)
        if r >= 2:
            seconds.append(time.process_time() - t0)
    return 1000 * statistics.median(seconds) / (2 * v * num_micro_batches)


NOTE = ("How to read it. *schedule's own*: the schedule's idle share replayed from torch's own action order "
        "(bench/pipeline_schedule_sim.py; forward 1, backward 2 per micro-batch split over v, messages free): "
        "where it equals the formula, torch's order adds no idle of its own. *measured*: the median per rank over "
        "rounds, and the worst rank's share against the formula as median [least, most] over rounds. The step's "
        "time beyond the ideal is then replayed on the same order from each round's measured holds: "
        "*oversleep* is the holds' overrun of their sleeps (this shared machine's load; each rank counts its own "
        "as busy, but the ranks waiting on it idle), *per action* the fixed time each action spends outside its "
        "hold (torch's stage and schedule Python, autograd, the stage's small tensor ops, the loss; the mean "
        "in ms beside it), *messages* a message's time beyond that (gloo over loopback; mean per message beside "
        "it), *entry/exit* the step's start before the first action and its end after the last, *rest* what the "
        "replay leaves unexplained. The formula counts none of these; interleaved has v times the actions and "
        "messages of 1F1B per micro-batch, each of 1/v the work, so the same fixed time per action weighs v "
        "times more against a bubble v times smaller. Stages of more work per micro-batch shrink the excess in "
        "proportion. Zero bubble has no formula here.")


def _table(results: list[dict]) -> list[str]:
    lines = ["| schedule | p | v | m | formula | schedule's own | measured idle per rank | worst rank vs formula "
             "(median [range]) | step ms (ideal) | excess ms: oversleep / per action / messages / entry, exit / rest "
             "| per action, per message ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        shares = ", ".join(f"{s:.3f}" for s in r["idle_share_per_rank"])
        if r["formula"] is None:
            versus = "-"
        else:
            rel = sorted((w - r["formula"]) / r["formula"] for w in r["worst_rank_idle_share_per_round"])
            versus = f"{statistics.median(rel):+.1%} [{rel[0]:+.1%}, {rel[-1]:+.1%}]"
        formula_text = "-" if r["formula"] is None else f"{r['formula']:.3f}"
        excess = " / ".join(f"{r[f'{k}_ms']['median']:.0f}" for k in EXCESS)
        lines.append(f"| {r['schedule']} | {r['p']} | {r['v']} | {r['m']} | {formula_text} | "
                     f"{r['schedule_idle_share']:.3f} | {shares} | {versus} | {r['makespan_ms']['median']:.0f} "
                     f"({r['ideal_makespan_ms']:.0f}) | {excess} | "
                     f"{r['per_action_gap_ms']:.2f}, {r['message_ms']:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forward-ms", type=float, default=100.0, help="each micro-batch's forward per rank (backward 2x)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    cases = [{"schedule": s, "p": p, "m": m, "v": 1 if s == "1f1b" else 2}
             for p in (2, 4) for m in (4, 8) for s in ("1f1b", "interleaved", "zero_bubble")]
    world = max(c["p"] for c in cases)
    queue = mp.get_context("spawn").SimpleQueue()
    t0 = time.monotonic()
    mp.start_processes(_rank, args=(world, free_port(), cases, args.forward_ms, args.rounds, queue), nprocs=world,
                       start_method="spawn")
    measured = queue.get()
    results, action_cpu = measured["cases"], measured["action_cpu_ms"]
    tag = machine_tag(torch.device("cpu"))
    lines = [f"# Pipeline bubble: measured idle share per rank vs the schedule's formula ({tag})",
             "",
             f"Stages of equal work: forward {args.forward_ms:g} ms, backward {2 * args.forward_ms:g} ms (half input "
             f"gradient, half weight gradient) per micro-batch per rank (a sleep, split over the v stages a rank "
             f"runs), {args.rounds} rounds after 2 warm-up steps; torch's Schedule1F1B / ScheduleInterleaved1F1B / "
             f"ScheduleZBVZeroBubble as m6.train.pipeline_step builds them. Idle share = 1 - busy / makespan (see "
             f"bench/pipeline_bubble.py). Load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores. "
             f"Total wall {time.monotonic() - t0:.0f} s.",
             "", *_table(results), "",
             f"One action's CPU time alone (a one-rank pipeline with empty holds, no messages, "
             f"bench.pipeline_bubble.action_cpu_ms): {action_cpu[1]:.2f} ms at one stage per rank, "
             f"{action_cpu[2]:.2f} ms at two; the *per action* column's wall time beyond it is waiting, for a core on this shared "
             f"machine and for gloo's threads to post the action's messages."]
    write_results(args.out, f"pipeline_bubble-{tag}",
                  {"cases": results, "action_cpu_ms": action_cpu, "forward_ms": args.forward_ms,
                   "load_average": os.getloadavg()[0], "machine": machine_info(torch.device("cpu"))},
                  "\n".join(lines + ["", NOTE]))


if __name__ == "__main__":
    main()
