"""Host optimizer benchmark (memory.host_optimizer): the offloaded AdamW update on the CPU with
DeepSpeed's CPU Adam against torch's AdamW, and the whole offloaded train step of a small model.

    python -m bench.host_optimizer            # ~6 min on 2 CPU cores (needs ~7 GiB of memory)
    python -m bench.host_optimizer --quick    # small sizes: a harness check, not a measurement

1. The optimizer step alone, fp32 on host tensors, at 25M and 100M parameters (1024 x 4096
   matrices with weight decay, two 1024-vectors per matrix without, as in a transformer):
   m6's DeepSpeedHostAdamW (m6/memory/deepspeed_adam.py), DeepSpeed's stock DeepSpeedCPUAdam
   (adamw_mode), torch.optim.AdamW foreach, for-loop and fused (CPU). Each variant has its own
   parameters and state; all read the same gradients. Then DeepSpeed's op and torch's foreach
   AdamW on one thread against all threads (the OMP_NUM_THREADS note of memory.host_optimizer).
2. The whole train step of bench/memory's 25M-parameter MoE model (synthetic data, fp32): no
   offload, offload=optimizer with torch's AdamW, offload=optimizer with DeepSpeed's CPU Adam; the
   host update's own time (GroupedApply.step) is read inside each step.

Variants run round-robin in one process (bench.harness.time_round_robin); a round is dropped
when a variant's CPU time / wall time shows another process took a core. On CPU the process
re-executes itself once with pinned threads (OMP_PROC_BIND=close OMP_PLACES=cores) and
MALLOC_MMAP_MAX_=0.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import os
import statistics
import sys
import tempfile
import time
from typing import Callable

import torch

from bench.harness import Timings, machine_info, machine_tag, time_round_robin, write_results
from bench.memory import COMMON, MODEL, PIN_ENV
from m6.config import OptimConfig, load
from m6.memory.host_optimizer import load_cpu_adam
from m6.train.loop import Trainer

MATRIX = (1024, 4096)
VECTOR = 1024
LR, BETAS, EPS, WD = 1e-4, (0.9, 0.95), 1e-8, 0.1


def make_params(num_params: int, generator: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(decayed matrices, undecayed vectors) holding about ``num_params`` values in all."""
    per_matrix = MATRIX[0] * MATRIX[1] + 2 * VECTOR
    count = max(1, round(num_params / per_matrix))
    matrices = [torch.randn(MATRIX, generator=generator) * 0.02 for _ in range(count)]
    vectors = [torch.ones(VECTOR) for _ in range(2 * count)]
    return matrices, vectors


def build_optimizer(kind: str, matrices: list[torch.Tensor], vectors: list[torch.Tensor]) -> torch.optim.Optimizer:
    groups = [{"params": matrices, "weight_decay": WD}, {"params": vectors, "weight_decay": 0.0}]
    if kind == "deepspeed (m6)":
        from m6.memory.deepspeed_adam import DeepSpeedHostAdamW
        return DeepSpeedHostAdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    if kind == "deepspeed (stock)":
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(groups, lr=LR, betas=BETAS, eps=EPS, adamw_mode=True)
    flags = {"torch foreach": {"foreach": True}, "torch for-loop": {"foreach": False}, "torch fused": {"fused": True}}
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, **flags[kind])


OPTIMIZERS = ["deepspeed (m6)", "deepspeed (stock)", "torch foreach", "torch for-loop", "torch fused"]


def optimizer_steps(kinds: list[str], num_params: int) -> tuple[dict[str, Callable[[], None]], int]:
    """One step function per optimizer kind, each over its own copy of the same parameters, all
    reading one shared set of gradients (no AdamW variant writes to them)."""
    g = torch.Generator().manual_seed(0)
    matrices, vectors = make_params(num_params, g)
    grads = [torch.randn(t.shape, generator=g) * 1e-3 for t in matrices + vectors]
    steps = {}
    for kind in kinds:
        mats, vecs = [m.clone() for m in matrices], [v.clone() for v in vectors]
        for p, grad in zip(mats + vecs, grads):
            p.grad = grad
        opt = build_optimizer(kind, mats, vecs)
        steps[kind] = opt.step
    return steps, sum(t.numel() for t in matrices + vectors)


def with_threads(step: Callable[[], None], threads: int) -> Callable[[], None]:
    """``step`` run with torch's (and so the op's OpenMP) thread count set to ``threads``."""
    def run() -> None:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            step()
        finally:
            torch.set_num_threads(before)
    return run


def summarise(t: Timings, anchor: str) -> dict:
    rows = {}
    for name in t.seconds:
        lo, hi = t.spread(name)
        ratio = t.paired_ratio(name, anchor)
        rows[name] = {"median_s": t.median(name), "min_s": lo, "max_s": hi,
                      f"vs_{anchor}": {"median": ratio[0], "min": ratio[1], "max": ratio[2]},
                      "cpu_util_median": statistics.median(t.cpu_util[name])}
    return {"rounds_kept": t.rounds_kept, "rounds_dropped": t.rounds_dropped,
            "dropped_round_cpu_util": t.dropped_util, "rows": rows}


def bench_optimizers(sizes: list[int], args) -> dict:
    out = {}
    for size in sizes:
        steps, exact = optimizer_steps(OPTIMIZERS, size)
        t = time_round_robin(steps, torch.device("cpu"), min_rounds=args.rounds, max_rounds=args.max_rounds,
                             min_cpu_util=args.min_cpu_util)
        out[str(exact)] = summarise(t, "deepspeed (m6)")
        print(f"optimizer step at {exact / 1e6:.1f}M params: {t.rounds_kept} rounds kept, {t.rounds_dropped} dropped",
              file=sys.stderr, flush=True)
        del steps
        gc.collect()
    return out


def bench_threads(size: int, args) -> dict:
    """DeepSpeed's op and torch's foreach AdamW at 1 thread and at all of them."""
    steps, exact = optimizer_steps(["deepspeed (m6)", "torch foreach"], size)
    threads = torch.get_num_threads()
    variants = {f"{kind}, {n} thread{'s' if n > 1 else ''}": with_threads(steps[kind], n)
                for kind in steps for n in sorted({1, threads}, reverse=True)}
    scale = 0.75 if args.min_cpu_util is None else 0.0
    floors = {name: scale * (1 if ", 1 thread" in name else threads) for name in variants}
    anchor = f"deepspeed (m6), {threads} thread{'s' if threads > 1 else ''}"
    t = time_round_robin(variants, torch.device("cpu"), min_rounds=args.rounds, max_rounds=args.max_rounds,
                         min_cpu_util=floors)
    print(f"threads at {exact / 1e6:.1f}M params: {t.rounds_kept} rounds kept, {t.rounds_dropped} dropped",
          file=sys.stderr, flush=True)
    del steps, variants
    gc.collect()
    return {"num_params": exact, "anchor": anchor, **summarise(t, anchor)}


TRAIN_VARIANTS = {
    "no offload": ["memory.offload=none"],
    "offload, torch AdamW": ["memory.offload=optimizer", "memory.host_optimizer=torch"],
    "offload, DeepSpeed CPU Adam": ["memory.offload=optimizer", "memory.host_optimizer=deepspeed"],
}


def bench_train_step(model: list[str], args) -> dict:
    root = tempfile.mkdtemp(prefix="m6-bench-host-optimizer-")
    trainers = {name: Trainer(load("configs/tiny.yaml", [*COMMON, *model, "train.device=cpu",
                                                         f"run.dir={root}/{i}", *extra]))
                for i, (name, extra) in enumerate(TRAIN_VARIANTS.items())}
    update_s: dict[str, list[float]] = {n: [] for n in trainers}
    losses: dict[str, list[float]] = {n: [] for n in trainers}
    for name, tr in trainers.items():
        apply_step = tr.update.apply.step

        def timed(after_group=None, apply_step=apply_step, name=name) -> None:
            t0 = time.perf_counter()
            apply_step(after_group)
            update_s[name].append(time.perf_counter() - t0)
        tr.update.apply.step = timed  # an instance attribute shadows the method

    def stepper(name: str) -> Callable[[], None]:
        return lambda: losses[name].append(trainers[name].train_step()["loss"])

    t = time_round_robin({n: stepper(n) for n in trainers}, torch.device("cpu"), min_rounds=args.rounds,
                         max_rounds=args.max_rounds, min_cpu_util=args.min_cpu_util)
    print(f"train step: {t.rounds_kept} rounds kept, {t.rounds_dropped} dropped", file=sys.stderr, flush=True)
    result = summarise(t, "no offload")
    for name in trainers:
        result["rows"][name]["update_median_s_all_steps"] = statistics.median(update_s[name])
    num_params = sum(p.numel() for p in trainers["no offload"].model.parameters())
    last = {n: v[-1] for n, v in losses.items()}
    return {"model_overrides": model, "num_params": num_params, "steps_per_variant": len(losses["no offload"]),
            "last_losses": last, **result}


def render(result: dict) -> str:
    m = result["machine"]
    lines = [
        "# Host optimizer benchmark (CPU, fp32)", "",
        f"Command: `{result['command']}`  ",
        f"Machine: {m['cpu_model']}, {m['cpu_count']} CPUs, torch {m['torch']}, deepspeed {result['deepspeed']} "
        f"(cpu_adam op built with {result['simd']}), {m['num_threads']} threads; env {m['env']}; total wall "
        f"{result['wall_s']} s.  ",
        "Variants interleaved round-robin in one process after 2 warm-up rounds; a round is dropped when a "
        "variant's CPU time / wall time falls under 75% of its threads (another process took a core). Medians "
        "over kept rounds [min-max]; ratios are medians of per-round paired ratios [min-max].", "",
        "## Optimizer step alone (host tensors, AdamW, 2 groups)", "",
    ]
    for size, block in result["optimizer_step"].items():
        lines += [f"{int(size) / 1e6:.1f}M parameters: {block['rounds_kept']} rounds kept, "
                  f"{block['rounds_dropped']} dropped (CPU util of dropped rounds {block['dropped_round_cpu_util']}).", "",
                  "| optimizer | median s/step [min-max] | time vs deepspeed (m6) | CPU util |", "|---|---|---|---|"]
        for name, r in block["rows"].items():
            v = r["vs_deepspeed (m6)"]
            lines.append(f"| {name} | {r['median_s']:.4f} [{r['min_s']:.4f}-{r['max_s']:.4f}] | {v['median']:.2f}x "
                         f"[{v['min']:.2f}-{v['max']:.2f}] | {r['cpu_util_median']:.2f} |")
        lines.append("")
    th = result["threads"]
    lines += [f"## Threads ({th['num_params'] / 1e6:.1f}M parameters)", "",
              f"{th['rounds_kept']} rounds kept, {th['rounds_dropped']} dropped.", "",
              f"| variant | median s/step [min-max] | time vs {th['anchor']} | CPU util |", "|---|---|---|---|"]
    for name, r in th["rows"].items():
        v = r[f"vs_{th['anchor']}"]
        lines.append(f"| {name} | {r['median_s']:.4f} [{r['min_s']:.4f}-{r['max_s']:.4f}] | {v['median']:.2f}x "
                     f"[{v['min']:.2f}-{v['max']:.2f}] | {r['cpu_util_median']:.2f} |")
    tr = result["train_step"]
    lines += ["", f"## Whole train step, offload=optimizer ({tr['num_params'] / 1e6:.1f}M-parameter MoE model)", "",
              f"configs/tiny.yaml with `{' '.join(tr['model_overrides'])}`, synthetic data, fp32, one micro-batch "
              f"per step; {tr['rounds_kept']} rounds kept, {tr['rounds_dropped']} dropped. *host update* = "
              "GroupedApply.step inside the step (median over every timed step, dropped rounds included). On a "
              "CPU-only machine the offload copies run inline and nothing overlaps.", "",
              "| variant | median s/step [min-max] | vs no offload | host update s (median) | loss at the last step |",
              "|---|---|---|---|---|"]
    for name, r in tr["rows"].items():
        v = r["vs_no offload"]
        lines.append(f"| {name} | {r['median_s']:.3f} [{r['min_s']:.3f}-{r['max_s']:.3f}] | {v['median']:.2f}x "
                     f"[{v['min']:.2f}-{v['max']:.2f}] | {r['update_median_s_all_steps']:.4f} | "
                     f"{tr['last_losses'][name]:.12g} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4M/8M parameters and a tiny model: a harness check")
    p.add_argument("--rounds", type=int, default=11, help="clean rounds to keep")
    p.add_argument("--max-rounds", type=int, default=30)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    args.min_cpu_util = 0.0 if args.quick else None  # quick: every round counts (None: the harness's 75%)
    if any(os.environ.get(k) != v for k, v in PIN_ENV.items()):
        # Thread pinning and the malloc setting must be in place before torch starts its pools.
        env = dict(os.environ, **PIN_ENV)
        env.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
        os.execve(sys.executable, [sys.executable, "-m", "bench.host_optimizer", *(argv or sys.argv[1:])], env)
    started = time.time()
    device = torch.device("cpu")
    load_cpu_adam(lambda line: print(line, file=sys.stderr, flush=True))
    from deepspeed.ops.op_builder import CPUAdamBuilder
    sizes = [4_000_000, 8_000_000] if args.quick else [25_000_000, 100_000_000]
    result = {"benchmark": "host_optimizer", "command": "python -m bench.host_optimizer" + (" --quick" if args.quick else ""),
              "device": "cpu", "machine": machine_info(device), "deepspeed": importlib.metadata.version("deepspeed"),
              "simd": CPUAdamBuilder().simd_width(), "optim_defaults": {"lr": LR, "betas": BETAS, "eps": EPS,
                                                                        "weight_decay": WD}}
    assert OptimConfig().eps == EPS  # the same eps as m6's default
    result["optimizer_step"] = bench_optimizers(sizes, args)
    result["threads"] = bench_threads(sizes[-1], args)
    result["train_step"] = bench_train_step(MODEL["quick" if args.quick else "full"], args)
    result["wall_s"] = round(time.time() - started, 1)
    stem = f"host_optimizer-{machine_tag(device)}" + ("-quick" if args.quick else "")
    write_results(args.out, stem, result, render(result))


if __name__ == "__main__":
    main()
