"""The offloaded gradient clip's norm on the host: m6's sum of squares (each gradient viewed as rows
of 4096 elements, one fused norm per row, the rows' squares summed in float64) against the formula
it replaced (``pow(2).sum()`` per gradient: a squared copy of every gradient, then a sum), one fused
``torch.linalg.vector_norm`` per gradient, and torch's own total norm
(``torch.nn.utils.get_total_norm``, foreach), on the same host gradients.

    python -m bench.host_clip            # ~2 min on 2 CPU cores, ~1.5 GiB of memory
    python -m bench.host_clip --quick    # small sizes: a harness check, not a measurement

The gradients have the shapes of configs/m6-base-moe.yaml's parameters (fp32), taken in model
order up to --gib of them. Timed on 1 thread and on every core (torchrun gives each process one
thread unless OMP_NUM_THREADS says otherwise), implementations round-robin in one process, rounds
with another process on a core dropped (bench.harness). Also the relative error of each against
a float64 sum. The process re-executes itself once with pinned threads and MALLOC_MMAP_MAX_=0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from bench.harness import machine_info, machine_tag, time_round_robin, write_results
from m6.config import load
from m6.model import build_meta_model
from m6.parallel.grad_sync import _sum_sq

PIN_ENV = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores", "MALLOC_MMAP_MAX_": "0"}


def previous_sum_sq(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The formula m6 used before (kept here as the anchor)."""
    grads = [p.grad.detach().float().pow(2).sum() for p in params if p.grad is not None]
    return torch.stack(grads).sum()


def whole_norm_sum_sq(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """One fused norm over each whole gradient (fast, but fp32 lanes over tens of millions of values)."""
    return torch.stack([torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in params]).double().square().sum()


def torch_sum_sq(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.nn.utils.get_total_norm([p.grad for p in params], 2.0).square()


def host_gradients(gib: float) -> list[torch.nn.Parameter]:
    """Parameters with gradients shaped like m6-base-moe's, in model order, up to ``gib`` GiB."""
    model = build_meta_model(load("configs/m6-base-moe.yaml", []).model)
    out, total = [], 0
    generator = torch.Generator().manual_seed(0)
    for p in model.parameters():
        if total + p.numel() * 4 > gib * 2**30:
            continue
        param = torch.nn.Parameter(torch.empty(p.shape))
        param.grad = torch.randn(p.shape, generator=generator) * 1e-3
        out.append(param)
        total += p.numel() * 4
    return out


def run(args) -> dict:
    params = host_gradients(args.gib)
    nbytes = sum(p.grad.numel() * 4 for p in params)
    exact = sum(float(p.grad.double().square().sum()) for p in params)
    impls = {"m6 (row norms)": _sum_sq, "previous (pow(2).sum())": previous_sum_sq,
             "vector_norm per tensor": whole_norm_sum_sq, "torch get_total_norm (foreach)": torch_sum_sq}
    errors = {name: abs(float(fn(params)) - exact) / exact for name, fn in impls.items()}
    by_threads = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        # One core's worth is the floor at any thread count: these reductions may run on one thread
        # however many they are given (CPU time / wall is recorded), so only rounds in which another
        # process took the core are dropped.
        timings = time_round_robin({name: (lambda fn=fn: fn(params)) for name, fn in impls.items()},
                                   torch.device("cpu"), min_rounds=args.rounds, max_rounds=4 * args.rounds,
                                   min_cpu_util=0.75)
        by_threads[threads] = {
            "median_s": {n: timings.median(n) for n in impls},
            "spread_s": {n: timings.spread(n) for n in impls},
            "previous_over_m6": timings.paired_ratio("previous (pow(2).sum())", "m6 (row norms)"),
            "torch_over_m6": timings.paired_ratio("torch get_total_norm (foreach)", "m6 (row norms)"),
            "rounds_kept": timings.rounds_kept, "rounds_dropped": timings.rounds_dropped,
            "median_cpu_util": {n: statistics.median(timings.cpu_util[n]) for n in impls},
        }
    return {"gradient_bytes": nbytes, "tensors": len(params), "relative_error_vs_float64": errors,
            "by_threads": by_threads}


def render(result: dict) -> str:
    gib = result["gradient_bytes"] / 2**30
    lines = [f"# Host clip norm ({result['machine']['cpu_model']}, {result['machine']['cpu_count']} cores, "
             f"torch {result['machine']['torch']})", "",
             f"`{result['command']}`: the sum of squared gradients the offloaded clip needs, over "
             f"{gib:.2f} GiB of fp32 host gradients ({result['tensors']} tensors shaped like m6-base-moe's), "
             f"median of the kept rounds (min-max).", "",
             "| threads | m6 (row norms) | previous (pow(2).sum()) | vector_norm per tensor | torch get_total_norm | "
             "previous / m6 | torch / m6 | CPU time / wall (same order) | rounds kept (dropped) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for threads, r in result["by_threads"].items():
        cells = []
        for name in ("m6 (row norms)", "previous (pow(2).sum())", "vector_norm per tensor",
                     "torch get_total_norm (foreach)"):
            lo, hi = r["spread_s"][name]
            cells.append(f"{r['median_s'][name] * 1e3:.0f} ms ({lo * 1e3:.0f}-{hi * 1e3:.0f})")
        ratios = [f"{m:.2f}x ({lo:.2f}-{hi:.2f})" for m, lo, hi in (r["previous_over_m6"], r["torch_over_m6"])]
        util = ", ".join(f"{u:.2f}" for u in r["median_cpu_util"].values())
        lines.append(f"| {threads} | {' | '.join(cells)} | {' | '.join(ratios)} | {util} | "
                     f"{r['rounds_kept']} ({r['rounds_dropped']}) |")
    errors = ", ".join(f"{n} {e:.1e}" for n, e in result["relative_error_vs_float64"].items())
    lines += ["", f"Relative error of the sum against float64: {errors}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of fp32 gradients (default 1)")
    parser.add_argument("--rounds", type=int, default=7, help="clean rounds per thread count (default 7)")
    parser.add_argument("--quick", action="store_true", help="64 MiB, 2 rounds: a harness check")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    if any(os.environ.get(k) != v for k, v in PIN_ENV.items()):
        env = dict(os.environ, **PIN_ENV)
        env.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
        os.execve(sys.executable, [sys.executable, "-m", "bench.host_clip", *(argv or sys.argv[1:])], env)
    if args.quick:
        args.gib, args.rounds = 1 / 16, 2
    started = time.time()
    result = {"benchmark": "host_clip", "command": "python -m bench.host_clip" + (" --quick" if args.quick else ""),
              "machine": machine_info(torch.device("cpu")), **run(args)}
    result["wall_s"] = round(time.time() - started, 1)
    write_results(args.out, f"host_clip-{machine_tag(torch.device('cpu'))}" + ("-quick" if args.quick else ""),
                  result, render(result))


if __name__ == "__main__":
    main()
