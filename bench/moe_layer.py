"""MoE layer benchmark: m6 MoELayer vs DeepSpeed-MoE vs a dense FFN doing the same useful work.

    python -m bench.moe_layer                  # full table on this machine (CPU fp32 / CUDA bf16)
    python -m bench.moe_layer --quick          # tiny shapes, seconds; checks the harness end to end
    python -m bench.moe_layer --device cuda --shapes gpu --stages timing   # GPU shapes, bf16 autocast

The parent process re-launches itself with pinned threads (OMP_PROC_BIND=close, OMP_PLACES=cores)
for the timing table, once with MALLOC_MMAP_MAX_=0 (the numbers reported) and once with default
glibc on a subset (to show what the setting is worth), plus one short process per
(implementation, shape) for peak memory, so one measurement cannot inflate another's high-water mark.
Forward+backward per step; "dense" runs top_k x tokens through one d_model x ffn_dim MLP: the
compute an ideal MoE layer would need, so time(dense)/time(m6) is m6's efficiency.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from bench.harness import (current_rss_bytes, machine_info, machine_tag, peak_rss_bytes, reset_peak_rss,
                           time_round_robin)
from m6.moe import MoELayer

IMPLS = ("m6_capacity", "m6_dropless", "deepspeed", "dense")
CAPACITY_FACTOR = 1.25
MIN_CAPACITY = 4


def _deepspeed_moe(d_model: int, ffn_dim: int, num_experts: int, top_k: int) -> nn.Module:
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group(backend, rank=0, world_size=1)
    expert = nn.Sequential(nn.Linear(d_model, ffn_dim, bias=False), nn.GELU(), nn.Linear(ffn_dim, d_model, bias=False))
    # use_rts / 2nd-expert sampling off: deterministic routing comparable with m6's.
    return MoE(d_model, expert, num_experts=num_experts, ep_size=1, k=top_k,
               capacity_factor=CAPACITY_FACTOR, eval_capacity_factor=CAPACITY_FACTOR,
               min_capacity=MIN_CAPACITY, use_rts=False, drop_tokens=True, top2_2nd_expert_sampling=False)


def build_step(impl: str, shape: dict, device: torch.device, autocast_dtype: torch.dtype | None, seed: int = 0):
    """A zero-arg callable doing one forward+backward of ``impl``, and a stats getter."""
    D, F, E, K, T = shape["d_model"], shape["ffn_dim"], shape["num_experts"], shape["top_k"], shape["tokens"]
    torch.manual_seed(seed)
    reference = MoELayer(D, F, E, top_k=K, capacity_factor=CAPACITY_FACTOR, min_capacity=MIN_CAPACITY)
    if impl in ("m6_capacity", "m6_dropless"):
        module = reference
        if impl == "m6_dropless":
            module.capacity_factor = None
    elif impl == "deepspeed":
        module = _deepspeed_moe(D, F, E, K)
        # Same gate as m6 so both see the same routing (and the same amount of dropping).
        with torch.no_grad():
            module.deepspeed_moe.gate.wg.weight.copy_(reference.router.weight)
            for e, expert in enumerate(module.deepspeed_moe.experts.deepspeed_experts):
                expert[0].weight.copy_(reference.experts.w_in[e].t())
                expert[2].weight.copy_(reference.experts.w_out[e].t())
    elif impl == "dense":
        module = nn.Sequential(nn.Linear(D, F, bias=False), nn.GELU(), nn.Linear(F, D, bias=False))
    else:
        raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS}")
    module.to(device).train()
    rows = T * K if impl == "dense" else T
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(rows, D, generator=gen).to(device).requires_grad_(True)
    dy = torch.randn(rows, D, generator=gen).to(device)
    params = list(module.parameters())
    ctx = (lambda: torch.autocast(device.type, dtype=autocast_dtype)) if autocast_dtype else nullcontext

    def step() -> None:
        for p in params:
            p.grad = None
        x.grad = None
        with ctx():
            out = module(x)
        if isinstance(out, tuple):
            y, aux = out[0], out[1]
            loss = (y.float() * dy).sum() + aux
        else:
            loss = (out.float() * dy).sum()
        loss.backward()

    def dropped_fraction() -> float | None:
        if impl.startswith("m6"):
            return float(module.stats.dropped_fraction)
        return None

    return step, dropped_fraction, module


def measure_memory(impl: str, shape: dict, device: torch.device, autocast_dtype) -> dict:
    """Peak memory of one forward+backward above what params and inputs already hold.

    CPU: resident-set high-water mark in a fresh process; CUDA: the allocator's peak. Also the
    exact bytes saved for backward (saved-tensor hooks, parameters excluded).
    """
    step, _, module = build_step(impl, shape, device, autocast_dtype)
    param_ptrs = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_ptrs:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        import gc

        gc.collect()  # the reference layer build_step made for DeepSpeed's weights is gone
        reset_peak_rss()
        base = current_rss_bytes()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = peak_rss_bytes() - base
    return {"peak_step_bytes": peak, "saved_activation_bytes": sum(saved.values())}


# GPU shapes (bench/gpu_suite): 16k-64k tokens, d_model 2048-4096 with ffn 4x, and fine-grained
# experts (d 2048, ffn 1024, top-8 of 64-128). DeepSpeed's capacity tensors are [tokens, E, capacity]
# fp32, so its rows are the ones that may run out of memory at 64k tokens (recorded, not fatal).
GPU_SHAPES = [
    dict(d_model=2048, ffn_dim=8192, tokens=16384, num_experts=8, top_k=2),
    dict(d_model=4096, ffn_dim=16384, tokens=16384, num_experts=8, top_k=2),
    dict(d_model=2048, ffn_dim=1024, tokens=16384, num_experts=64, top_k=8),
    dict(d_model=2048, ffn_dim=1024, tokens=16384, num_experts=128, top_k=8),
    dict(d_model=2048, ffn_dim=8192, tokens=65536, num_experts=8, top_k=2),
]


def shapes_for(args) -> list[dict]:
    if getattr(args, "shapes", "default") == "gpu":
        return [dict(s) for s in GPU_SHAPES]
    if args.quick:
        base = dict(d_model=64, ffn_dim=128, tokens=256)
        experts, top_ks = (4, 16), (1, 2)
    else:
        base = dict(d_model=512, ffn_dim=2048, tokens=4096)
        experts, top_ks = (8, 16, 32, 64), (1, 2)
    if args.experts:
        experts = tuple(args.experts)
    if args.top_k:
        top_ks = tuple(args.top_k)
    return [dict(base, num_experts=E, top_k=K) for K in top_ks for E in experts]


def run_timing(args, device, autocast_dtype) -> dict:
    """Child: the round-robin timing table for every shape, in this one process."""
    rows = []
    for shape in shapes_for(args):
        steps, drops, modules, errors = {}, {}, {}, {}
        for impl in IMPLS:
            try:
                steps[impl], drops[impl], modules[impl] = build_step(impl, shape, device, autocast_dtype)
                steps[impl]()  # fails here, not mid-table, if it cannot run (e.g. out of memory)
            except Exception as e:  # recorded: the other implementations of this shape still run
                if impl in ("dense", "m6_dropless"):
                    raise
                errors[impl] = f"{type(e).__name__}: {str(e)[:300]}"
                steps.pop(impl, None)
                modules.pop(impl, None)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        t = time_round_robin(steps, device, min_rounds=args.rounds, max_rounds=args.max_rounds,
                             min_cpu_util=0.0 if args.no_drop else None)
        row = {"shape": shape, "rounds_kept": t.rounds_kept, "rounds_dropped": t.rounds_dropped,
               "dropped_round_cpu_util": t.dropped_util, "impls": {}, "errors": errors}
        for impl in steps:
            lo, hi = t.spread(impl)
            row["impls"][impl] = {
                "median_s": t.median(impl), "min_s": lo, "max_s": hi,
                "tokens_per_s": shape["tokens"] / t.median(impl),
                "cpu_util_median": sorted(t.cpu_util[impl])[len(t.cpu_util[impl]) // 2],
                "dropped_fraction": drops[impl](),
            }
            if impl.startswith("m6"):
                row["impls"][impl]["expert_kernel"] = modules[impl].experts.last_kernel
        for impl in ("m6_capacity", "m6_dropless"):
            if impl in steps:
                row["impls"][impl]["efficiency_vs_dense"] = _inverse(t.paired_ratio(impl, "dense"))
                if "deepspeed" in steps:
                    row["impls"][impl]["speedup_vs_deepspeed"] = _inverse(t.paired_ratio(impl, "deepspeed"))
        if "deepspeed" in steps:
            row["impls"]["deepspeed"]["efficiency_vs_dense"] = _inverse(t.paired_ratio("deepspeed", "dense"))
        rows.append(row)
        print(json.dumps(_brief(row)), file=sys.stderr, flush=True)
        del steps, modules, drops  # the drop getters hold their modules too
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows}


def _inverse(r: tuple[float, float, float]) -> dict:
    """time ratio a/b -> speed ratio b/a, as median and [min, max] over paired rounds."""
    med, lo, hi = r
    return {"median": 1 / med, "min": 1 / hi, "max": 1 / lo}


def _brief(row: dict) -> dict:
    s = row["shape"]
    return {"E": s["num_experts"], "k": s["top_k"], **{i: round(v["median_s"], 4) for i, v in row["impls"].items()},
            "kept": row["rounds_kept"], "dropped": row["rounds_dropped"]}


def _child(args, mode: str, env_extra: dict, unset: tuple = (), extra_args: tuple = ()) -> dict:
    env = dict(os.environ, OMP_PROC_BIND="close", OMP_PLACES="cores", **env_extra)
    for k in unset:
        env.pop(k, None)
    cmd = [sys.executable, "-m", "bench.moe_layer", "--child", mode, "--device", args.device,
           "--rounds", str(args.rounds), "--max-rounds", str(args.max_rounds), "--shapes", args.shapes, *extra_args]
    if args.quick:
        cmd.append("--quick")
    if args.no_drop:
        cmd.append("--no-drop")
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child {' '.join(cmd)} failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a harness check, not a measurement")
    p.add_argument("--rounds", type=int, default=7, help="clean rounds to keep per shape")
    p.add_argument("--max-rounds", type=int, default=30)
    p.add_argument("--experts", type=int, nargs="*", help="override the num_experts list")
    p.add_argument("--top-k", type=int, nargs="*", help="override the top_k list")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--skip-glibc-compare", action="store_true")
    p.add_argument("--shapes", choices=["default", "gpu"], default="default",
                   help="gpu: GPU_SHAPES (16k-64k tokens, d 2048-4096, fine-grained E 64-128 top-8)")
    p.add_argument("--no-drop", action="store_true",
                   help="keep every round whatever the CPU utilisation (a harness check on a busy CPU)")
    p.add_argument("--stages", default="timing,memory",
                   help="'memory' alone re-measures memory into the existing results file")
    p.add_argument("--child", choices=["timing", "memory"], help=argparse.SUPPRESS)
    p.add_argument("--impl", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None

    if args.child == "timing":
        print(json.dumps(run_timing(args, device, autocast_dtype)))
        return
    if args.child == "memory":
        print(json.dumps(measure_memory(args.impl, json.loads(args.shape), device, autocast_dtype)))
        return

    started = time.time()
    stages = set(args.stages.split(","))
    out = Path(args.out)
    stem = f"moe_layer-{machine_tag(device)}" + ("-quick" if args.quick else "") + ("-gpu-shapes" if args.shapes == "gpu" else "")
    sub = list(args.experts or []) and ["--experts", *map(str, args.experts)]
    sub += list(args.top_k or []) and ["--top-k", *map(str, args.top_k)]
    threads = {"OMP_NUM_THREADS": str(os.cpu_count())} if device.type == "cpu" else {}
    if "timing" in stages:
        print("timing (MALLOC_MMAP_MAX_=0) ...", file=sys.stderr)
        main_table = _child(args, "timing", dict(threads, MALLOC_MMAP_MAX_="0"), extra_args=tuple(sub))
        glibc_default = None
        if device.type == "cpu" and not args.skip_glibc_compare:
            print("timing (default glibc, subset) ...", file=sys.stderr)
            subset = shapes_for(args)
            es = sorted({s["num_experts"] for s in subset})
            glibc_default = _child(args, "timing", threads, unset=("MALLOC_MMAP_MAX_",),
                                   extra_args=("--experts", str(es[0]), str(es[-1]), "--top-k",
                                               str(max(s["top_k"] for s in subset))))
    else:
        previous = json.loads((out / f"{stem}.json").read_text())
        main_table = {"rows": previous["rows"]}
        glibc_default = {"rows": previous["glibc_default_rows"]} if previous.get("glibc_default_rows") else None
        started -= previous.get("wall_s", 0)
    if "memory" in stages:
        print("memory ...", file=sys.stderr)
        for row in main_table["rows"]:
            for impl in IMPLS:
                mem = _child(args, "memory", threads, unset=("MALLOC_MMAP_MAX_",),
                             extra_args=("--impl", impl, "--shape", json.dumps(row["shape"])))
                row["impls"][impl].update(mem)
    result = {
        "benchmark": "moe_layer",
        "command": "python -m bench.moe_layer" + (" --quick" if args.quick else "")
                   + (f" --device {args.device} --shapes gpu" if args.shapes == "gpu" else ""),
        "device": device.type,
        "precision": "bf16 autocast" if autocast_dtype else "fp32",
        "machine": machine_info(device),
        "deepspeed_version": _deepspeed_version(),
        "capacity_factor": CAPACITY_FACTOR,
        "min_capacity": MIN_CAPACITY,
        "timing_env": "OMP_PROC_BIND=close OMP_PLACES=cores MALLOC_MMAP_MAX_=0",
        "rows": main_table["rows"],
        "glibc_default_rows": glibc_default["rows"] if glibc_default else None,
        "wall_s": round(time.time() - started, 1),
    }
    from bench.moe_layer_report import render_markdown, summarize

    # The targets were set for the CPU table's one shape; GPU shapes differ per row.
    result["summary"] = summarize(result) if args.shapes == "default" else {"checks": []}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    (out / f"{stem}.md").write_text(render_markdown(result))
    print(render_markdown(result))
    print(f"wrote {out / stem}.json and .md", file=sys.stderr)


def _deepspeed_version() -> str:
    try:
        import deepspeed

        return deepspeed.__version__
    except Exception as e:  # reported, not fatal: the table says which anchor was missing
        return f"unavailable: {e}"


if __name__ == "__main__":
    main()
