"""The offloaded host update's Adafactor: m6's C++ op (m6.memory.host_adafactor) against torch's
foreach Adafactor, the fallback, on fp32 host tensors shaped as a transformer's (matrices, an expert
stack, norm vectors), interleaved round-robin on all threads and on one.

    OMP_PROC_BIND=close OMP_PLACES=cores python -m bench.host_optimizer [--params 25e6]

Writes bench/results/host_adafactor-<machine>.{json,md} (docs/memory.md: Host optimizer).
"""

from __future__ import annotations

import argparse
import os

import torch

from bench.harness import machine_info, machine_tag, time_round_robin, write_results
from m6.memory.host_adafactor import HostAdafactor, load_adafactor_op


def _params(total: float, seed: int) -> list[torch.Tensor]:
    """~``total`` parameters: per 'layer' two 1024x2048 matrices, an expert stack [4, 512, 1024]
    and four 1024-vectors (norms, biases)."""
    g = torch.Generator().manual_seed(seed)
    shapes = []
    while sum(torch.Size(s).numel() for s in shapes) < total:
        shapes += [(1024, 2048), (2048, 1024), (4, 512, 1024)] + [(1024,)] * 4
    params = []
    for s in shapes:
        p = torch.randn(s, generator=g).requires_grad_()
        p.grad = torch.randn(s, generator=g)
        params.append(p)
    return params


def _groups(params: list[torch.Tensor]) -> list[dict]:
    return [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=25e6)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--util", type=float, default=0.6, help="drop a round where a step got under this share of its threads")
    args = ap.parse_args()
    op = load_adafactor_op(print)
    cpu = torch.device("cpu")
    a, b = _params(args.params, 0), _params(args.params, 0)
    numel = sum(p.numel() for p in a)
    steps = {"m6 C++": HostAdafactor(_groups(a), op, lr=1e-3).step,
             "torch foreach": torch.optim.Adafactor(_groups(b), lr=1e-3, foreach=True).step}
    rows, result = [], {"params": numel, "machine": machine_info(cpu), "threads": {}}
    all_threads = torch.get_num_threads()
    for threads in sorted({all_threads, 1}, reverse=True):
        torch.set_num_threads(threads)
        t = time_round_robin(steps, cpu, min_rounds=args.rounds, max_rounds=60, min_cpu_util=args.util * threads)
        ratio = t.paired_ratio("torch foreach", "m6 C++")
        result["threads"][threads] = {
            "median_s": {n: t.median(n) for n in steps}, "spread_s": {n: t.spread(n) for n in steps},
            "torch_over_cpp": ratio, "rounds_kept": t.rounds_kept, "rounds_dropped": t.rounds_dropped,
            "ns_per_param_core": {n: t.median(n) * threads / numel * 1e9 for n in steps}}
        for n in steps:
            lo, hi = t.spread(n)
            rows.append(f"| {threads} | {n} | {t.median(n):.4f} [{lo:.4f}-{hi:.4f}] | "
                        f"{t.median(n) * threads / numel * 1e9:.2f} | "
                        + (f"{ratio[0]:.2f}x [{ratio[1]:.2f}-{ratio[2]:.2f}]" if n == "torch foreach" else "1.00x")
                        + f" | {t.rounds_kept} kept, {t.rounds_dropped} dropped |")
    torch.set_num_threads(all_threads)
    env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES")}
    md = (f"# Host Adafactor: m6's C++ op vs torch's foreach Adafactor (CPU, fp32)\n\n"
          f"Machine: {result['machine'].get('cpu_model', '')}, {os.cpu_count()} CPUs, torch {torch.__version__}; env {env}.  \n"
          f"{numel / 1e6:.1f}M parameters (matrices, expert stacks, vectors; decay on matrices). Both "
          f"optimizers interleaved round-robin after 2 warm-up rounds; a round is dropped when a step's CPU "
          f"time / wall time falls under "
          f"{args.util:.0%} of its threads. Medians over kept rounds [min-max]; the ratio is "
          f"the median of per-round paired ratios [min-max].\n\n"
          f"| threads | optimizer | median s/step [min-max] | ns per parameter x core | time vs m6 C++ | rounds |\n"
          f"|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    write_results(args.out, f"host_adafactor-{machine_tag(cpu)}", result, md)


if __name__ == "__main__":
    main()
