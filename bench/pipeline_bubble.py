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
forward and backward work (each timed by the monotonic clock around the sleep, oversleeping counted
as busy); the makespan runs from the common start after a barrier to the last rank's end of
``schedule.step`` (CLOCK_MONOTONIC is one clock for every process on the machine). The formula
assumes the same makespan for all ranks, with every rank busy m x (F + B). Median over rounds.

    python -m bench.pipeline_bubble            # writes bench/results/pipeline_bubble-cpu-<n>core.{md,json}
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage

from bench.harness import free_port, machine_info, machine_tag, write_results
from m6.parallel.pipeline import rank_stage_indices
from m6.train.pipeline_step import SCHEDULES


class TimedWork(torch.autograd.Function):
    """x -> x (a copy), holding the stage ``forward_s`` in forward and ``backward_s`` in backward;
    each hold's measured seconds go to ``busy``. On the weight's path (``forward_s`` 0) its
    backward is the weight-gradient work, which the zero-bubble schedule runs apart."""

    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float, busy: list):
        ctx.backward_s, ctx.busy = backward_s, busy
        if forward_s:
            t0 = time.monotonic()
            time.sleep(forward_s)
            busy.append(time.monotonic() - t0)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        t0 = time.monotonic()
        time.sleep(ctx.backward_s)
        ctx.busy.append(time.monotonic() - t0)
        return grad, None, None, None


class EqualStage(nn.Module):
    """One stage of equal work: the activation's path holds the forward and the input-gradient
    work (behind a weight, so the first stage, whose input needs no gradient, still runs it, as a
    real first stage's layers do), a second weight's path the weight-gradient work."""

    def __init__(self, forward_s: float, busy: list) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.weight = nn.Parameter(torch.ones(()))
        self.forward_s, self.busy = forward_s, busy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = TimedWork.apply(x * self.scale, self.forward_s, self.forward_s, self.busy)  # forward, input gradient
        return h * TimedWork.apply(self.weight, 0.0, self.forward_s, self.busy)  # weight gradient


def formula(schedule: str, p: int, m: int, v: int) -> float | None:
    if schedule == "zero_bubble":
        return None
    return (p - 1) / (m + p - 1) if schedule == "1f1b" else (p - 1) / (v * m + p - 1)


def _rank(rank: int, world: int, port: int, cases: list[dict], forward_ms: float, rounds: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = []
    for case in cases:
        p, m, v, schedule = case["p"], case["m"], case["v"], case["schedule"]
        group = dist.new_group(list(range(p)))  # every rank creates it; ranks >= p sit the case out
        if rank >= p:
            continue
        busy: list[float] = []
        indices = rank_stage_indices(rank, p, v, schedule)
        stages = [PipelineStage(EqualStage(forward_ms / 1000 / v, busy), s, p * v, torch.device("cpu"), group=group)
                  for s in indices]
        cls = SCHEDULES[schedule]
        sched = cls(stages[0] if v == 1 else stages, m, loss_fn=lambda y, t: (y * t).sum(), scale_grads=False)
        x, target = torch.ones(m, 4), torch.ones(m, 4)
        idle, makespans = [], []
        for r in range(rounds + 2):  # 2 warm-up steps (the first infers shapes)
            dist.barrier(group=group)
            busy.clear()
            start = time.monotonic()
            sched.step(x, target=target)
            end = time.monotonic()
            everyone: list = [None] * p
            dist.all_gather_object(everyone, (start, end, sum(busy)), group=group)
            if r >= 2:
                makespan = max(e for _, e, _ in everyone) - min(s for s, _, _ in everyone)
                idle.append([1 - b / makespan for _, _, b in everyone])
                makespans.append(makespan)
        if rank == 0:
            per_rank = [statistics.median(round_[i] for round_ in idle) for i in range(p)]
            ideal = (m + (p - 1) / v) * 3 * forward_ms  # every op on time, messages free
            results.append({**case, "idle_share_per_rank": per_rank, "formula": formula(schedule, p, m, v),
                            "makespan_ms": 1000 * statistics.median(makespans), "ideal_makespan_ms": ideal,
                            "rounds": rounds})
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


NOTE = ("The formula counts no time between operations; the measured step also holds each micro-batch's "
        "point-to-point messages (gloo, through this shared 2-core machine's loopback) and the schedule's own "
        "Python work: under 1F1B the step exceeds the formula's by 1.5-3 ms per forward or backward here. "
        "Interleaved exceeds its formula more (twice the messages per micro-batch, each operation half the "
        "work; the rest of its excess is not broken down here). Stages of more work per micro-batch shrink "
        "the excess in proportion. Zero bubble has no formula here; its measured idle share is the lowest.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forward-ms", type=float, default=100.0, help="each micro-batch's forward per rank (backward 2x)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    cases = [{"schedule": s, "p": p, "m": m, "v": 1 if s == "1f1b" else 2}
             for p in (2, 4) for m in (4, 8) for s in ("1f1b", "interleaved", "zero_bubble")]
    world = max(c["p"] for c in cases)
    queue = mp.get_context("spawn").SimpleQueue()
    t0 = time.monotonic()
    mp.start_processes(_rank, args=(world, free_port(), cases, args.forward_ms, args.rounds, queue), nprocs=world,
                       start_method="spawn")
    results = queue.get()
    lines = [f"# Pipeline bubble: measured idle share per rank vs the schedule's formula ({machine_tag(torch.device('cpu'))})",
             "",
             f"Stages of equal work: forward {args.forward_ms:g} ms, backward {2 * args.forward_ms:g} ms (half input "
             f"gradient, half weight gradient) per "
             f"micro-batch per rank (a sleep, split over the v stages a rank runs), {args.rounds} rounds after 2 "
             f"warm-up steps, median per rank; torch's Schedule1F1B / ScheduleInterleaved1F1B / ScheduleZBVZeroBubble as "
             f"m6.train.pipeline_step builds them. Idle share = 1 - busy / makespan (see bench/pipeline_bubble.py). "
             f"Total wall {time.monotonic() - t0:.0f} s.",
             "",
             "| schedule | p | v | m | formula | idle share per rank | worst rank vs formula | step ms (formula's) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        shares = ', '.join(f'{s:.3f}' for s in r['idle_share_per_rank'])
        if r["formula"] is None:
            lines.append(f"| {r['schedule']} | {r['p']} | {r['v']} | {r['m']} | - | {shares} | - | "
                         f"{r['makespan_ms']:.0f} |")
            continue
        worst = max(r["idle_share_per_rank"], key=lambda s: abs(s - r["formula"]))
        lines.append(f"| {r['schedule']} | {r['p']} | {r['v']} | {r['m']} | {r['formula']:.3f} | {shares} | "
                     f"{(worst - r['formula']) / r['formula']:+.1%} | {r['makespan_ms']:.0f} ({r['ideal_makespan_ms']:.0f}) |")
    write_results(args.out, f"pipeline_bubble-{machine_tag(torch.device('cpu'))}",
                  {"cases": results, "forward_ms": args.forward_ms, "machine": machine_info(torch.device("cpu"))},
                  "\n".join(lines + ["", NOTE]))


if __name__ == "__main__":
    main()
