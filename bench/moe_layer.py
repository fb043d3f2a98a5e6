"""MoE layer benchmark: m6's MoELayer against DeepSpeed-MoE, Hugging Face transformers' grouped_mm
MoE block and a dense FFN doing the same useful work, forward + backward. Two tables:

    python -m bench.moe_layer                  # layer table on this machine (CPU fp32 / CUDA bf16 autocast)
    python -m bench.moe_layer --quick          # tiny shapes, seconds; checks the harness end to end
    python -m bench.moe_layer --device cuda --shapes gpu --stages timing   # layer table, GPU shapes
    python -m bench.moe_layer --kernels --out DIR          # kernels table: GPU, bf16 parameters
    python -m bench.moe_layer --kernels --quick --device cpu --out DIR   # fp32, Triton's interpreter

Layer table: m6 in capacity (1.25) and dropless modes vs ``deepspeed.moe`` (same gate and GELU
expert weights) vs dense (top_k x tokens through one d_model x ffn_dim GELU MLP: the compute an
ideal MoE layer needs, so time(dense)/time(m6) is m6's efficiency). The parent re-launches itself
with pinned threads (OMP_PROC_BIND=close, OMP_PLACES=cores) for the timing, once with
MALLOC_MMAP_MAX_=0 (the numbers reported) and once with default glibc on a subset (what the
setting is worth), implementations interleaved round-robin (bench.harness); plus one short process
per (implementation, shape) for peak memory, so one cannot inflate another's high-water mark.

Kernels table (issue 44's shapes): m6's SwiGLU dropless top-K MoELayer with expert_kernel loop /
grouped_mm / fused, transformers' MixtralSparseMoeBlock with experts_implementation="grouped_mm"
(the same router and expert weights) and a dense SwiGLU FFN over T*K rows, all in one process.
Per shape: first the relative error of fused against grouped_mm (output, input and every parameter
gradient) and of HF's output against m6's; then ms per step (CUDA events, median of 10 after 3
warm-ups), TFLOP/s of the useful work 6*T*K*D*F*3 (three GEMMs of 2*T*K*D*F forward, twice that
backward), and peak device bytes of one step above the resting state per token (parameter
gradients included, recorded apart). On the first shape the top kernels of two fused steps under
the torch profiler; after the table, if time is left, the fused kernels at two other tile sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from bench.harness import (current_rss_bytes, machine_info, machine_tag, peak_rss_bytes, reset_peak_rss,
                           ms_stats, time_ms, time_round_robin)

IMPLS = ("m6_capacity", "m6_dropless", "deepspeed", "dense")
KERNEL_IMPLS = ("m6_loop", "m6_grouped_mm", "m6_fused", "hf_grouped_mm", "dense")
CAPACITY_FACTOR = 1.25
MIN_CAPACITY = 4
# Targets of the layer table's CPU shape (the foundation issue).
TARGETS = {"efficiency_E8": 0.90, "efficiency_E64": 0.80, "speedup_vs_deepspeed_E8": 1.15,
           "speedup_vs_deepspeed_E64": 1.25, "time_E64_over_E8": 1.25}
# Layer table GPU shapes: 16k-64k tokens, d_model 2048-4096 with ffn 4x, and fine-grained experts.
# DeepSpeed's capacity tensors are [tokens, E, capacity] fp32, so its rows are the ones that may
# run out of memory at 64k tokens (recorded, not fatal).
GPU_SHAPES = [
    dict(d_model=2048, ffn_dim=8192, tokens=16384, num_experts=8, top_k=2),
    dict(d_model=4096, ffn_dim=16384, tokens=16384, num_experts=8, top_k=2),
    dict(d_model=2048, ffn_dim=1024, tokens=16384, num_experts=64, top_k=8),
    dict(d_model=2048, ffn_dim=1024, tokens=16384, num_experts=128, top_k=8),
    dict(d_model=2048, ffn_dim=8192, tokens=65536, num_experts=8, top_k=2),
]
# Kernels table (tokens, d_model, ffn_dim, num_experts, top_k): the fine-grained targets first.
KERNEL_SHAPES = [(32768, 2048, 768, 128, 8), (16384, 2048, 1024, 64, 8), (16384, 2048, 768, 128, 8),
                 (16384, 2048, 8192, 8, 2), (8192, 4096, 14336, 8, 2)]
KERNEL_TINY_SHAPES = [(48, 32, 32, 8, 2), (32, 16, 16, 4, 4)]


class DenseFFN(nn.Module):
    """The dense anchor: one FFN D -> F -> D (GELU, or SwiGLU with a fused gate/up weight)."""

    def __init__(self, D: int, F: int, swiglu: bool = False) -> None:
        super().__init__()
        self.swiglu = swiglu
        self.w_in = nn.Linear(D, 2 * F if swiglu else F, bias=False)
        self.w_out = nn.Linear(F, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w_in(x)
        if self.swiglu:
            g, u = h.chunk(2, dim=-1)
            return self.w_out(nn.functional.silu(g) * u)
        return self.w_out(nn.functional.gelu(h))


def _errors_as_text(e: Exception, n: int = 300) -> str:
    return f"{type(e).__name__}: {str(e)[:n]}"


def _versions(*libs: str) -> dict:
    """Each library's version, or why it is missing (the table says which anchor was absent)."""
    out = {}
    for lib in libs:
        try:
            out[f"{lib}_version"] = __import__(lib).__version__
        except Exception as e:  # reported, not fatal
            out[f"{lib}_version"] = f"unavailable: {e}"
    return out


# ---------------------------------------------------------------------------------------------
# Layer table: m6 capacity / dropless vs DeepSpeed-MoE vs dense
def _deepspeed_moe(d_model: int, ffn_dim: int, num_experts: int, top_k: int) -> nn.Module:
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    expert = nn.Sequential(nn.Linear(d_model, ffn_dim, bias=False), nn.GELU(), nn.Linear(ffn_dim, d_model, bias=False))
    # use_rts / 2nd-expert sampling off: deterministic routing comparable with m6's.
    return MoE(d_model, expert, num_experts=num_experts, ep_size=1, k=top_k,
               capacity_factor=CAPACITY_FACTOR, eval_capacity_factor=CAPACITY_FACTOR,
               min_capacity=MIN_CAPACITY, use_rts=False, drop_tokens=True, top2_2nd_expert_sampling=False)


def build_step(impl: str, shape: dict, device: torch.device, autocast_dtype: torch.dtype | None, seed: int = 0):
    """A zero-arg callable doing one forward+backward of ``impl``, a dropped-fraction getter, the module."""
    from m6.moe import MoELayer

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
        module = DenseFFN(D, F)
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
        y, aux = out[:2] if isinstance(out, tuple) else (out, 0.0)  # DeepSpeed: (y, aux, counts)
        ((y.float() * dy).sum() + aux).backward()

    def dropped_fraction() -> float | None:
        return float(module.stats.dropped_fraction) if impl.startswith("m6") else None

    return step, dropped_fraction, module


def measure_memory(impl: str, shape: dict, device: torch.device, autocast_dtype) -> dict:
    """Peak memory of one forward+backward above what params and inputs already hold (CPU: the
    resident-set high-water mark in a fresh process; CUDA: the allocator's peak), and the exact
    bytes saved for backward (saved-tensor hooks, parameters excluded)."""
    step, _, module = build_step(impl, shape, device, autocast_dtype)
    param_ptrs = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() not in param_ptrs:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    cuda = device.type == "cuda"
    if cuda:
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
    if cuda:
        torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()) - base
    return {"peak_step_bytes": peak, "saved_activation_bytes": sum(saved.values())}


def shapes_for(args) -> list[dict]:
    if args.shapes == "gpu":
        return [dict(s) for s in GPU_SHAPES]
    if args.quick:
        base, experts, top_ks = dict(d_model=64, ffn_dim=128, tokens=256), (4, 16), (1, 2)
    else:
        base, experts, top_ks = dict(d_model=512, ffn_dim=2048, tokens=4096), (8, 16, 32, 64), (1, 2)
    experts, top_ks = tuple(args.experts or experts), tuple(args.top_k or top_ks)
    return [dict(base, num_experts=E, top_k=K) for K in top_ks for E in experts]


def _inverse(r: tuple[float, float, float]) -> dict:
    """time ratio a/b -> speed ratio b/a, as median and [min, max] over paired rounds."""
    med, lo, hi = r
    return {"median": 1 / med, "min": 1 / hi, "max": 1 / lo}


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
                errors[impl] = _errors_as_text(e)
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
            rec = row["impls"][impl] = {
                "median_s": t.median(impl), "min_s": lo, "max_s": hi, "tokens_per_s": shape["tokens"] / t.median(impl),
                "cpu_util_median": statistics.median_low(t.cpu_util[impl]), "dropped_fraction": drops[impl]()}
            if impl != "dense":
                rec["efficiency_vs_dense"] = _inverse(t.paired_ratio(impl, "dense"))
            if impl.startswith("m6"):
                rec["expert_kernel"] = modules[impl].experts.last_kernel
                if "deepspeed" in steps:
                    rec["speedup_vs_deepspeed"] = _inverse(t.paired_ratio(impl, "deepspeed"))
        rows.append(row)
        s = row["shape"]
        print(json.dumps({"E": s["num_experts"], "k": s["top_k"], "kept": t.rounds_kept, "dropped": t.rounds_dropped,
                          **{i: round(v["median_s"], 4) for i, v in row["impls"].items()}}), file=sys.stderr, flush=True)
        del steps, modules, drops  # the drop getters hold their modules too
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows}


def summarize(result: dict) -> dict:
    """Each target with the measured value (median and spread over paired rounds) and pass/fail.

    Efficiency is judged on dropless m6 (a capacity run drops work and would flatter itself);
    the DeepSpeed comparison at capacity 1.25, where both drop the same assignments."""
    rows = result["rows"]
    experts = sorted({r["shape"]["num_experts"] for r in rows})
    top_k = max(r["shape"]["top_k"] for r in rows)
    find = lambda e: next((r for r in rows if r["shape"]["num_experts"] == e and r["shape"]["top_k"] == top_k), None)  # noqa: E731
    lo_e, hi_e = experts[0], experts[-1]
    lo, hi = find(lo_e), find(hi_e)
    out: dict = {"top_k": top_k, "experts_low": lo_e, "experts_high": hi_e, "checks": []}
    if lo is None or hi is None:
        return out

    def check(name: str, value: dict | float, threshold: float, higher_is_better: bool = True) -> None:
        med = value["median"] if isinstance(value, dict) else value
        out["checks"].append({"target": name, "value": value, "threshold": threshold,
                              "direction": ">=" if higher_is_better else "<=",
                              "pass": bool(med >= threshold if higher_is_better else med <= threshold)})

    cf = result["capacity_factor"]
    for e, row, tag in ((lo_e, lo, "E8"), (hi_e, hi, "E64")):
        check(f"efficiency m6 dropless vs dense, E={e}", row["impls"]["m6_dropless"]["efficiency_vs_dense"],
              TARGETS[f"efficiency_{tag}"])
    for e, row, tag in ((lo_e, lo, "E8"), (hi_e, hi, "E64")):
        check(f"speedup m6 vs DeepSpeed, capacity {cf}, E={e}", row["impls"]["m6_capacity"]["speedup_vs_deepspeed"],
              TARGETS[f"speedup_vs_deepspeed_{tag}"])
    for impl in ("m6_dropless", "m6_capacity"):
        raw = hi["impls"][impl]["median_s"] / lo["impls"][impl]["median_s"]
        # The dense FFN does identical work in both shapes; dividing by its time ratio cancels
        # machine drift between the two shapes' measurement windows.
        drift = hi["impls"]["dense"]["median_s"] / lo["impls"]["dense"]["median_s"]
        check(f"time(E={hi_e})/time(E={lo_e}) {impl} (raw {raw:.3f}, dense drift {drift:.3f})",
              raw / drift, TARGETS["time_E64_over_E8"], higher_is_better=False)
    return out


def _ratio(v: dict | None) -> str:
    return f"{v['median']:.2f} [{v['min']:.2f}-{v['max']:.2f}]" if v else "-"


def _mib(v) -> str:
    return "-" if v is None else f"{v / 2**20:.0f}"


def layer_table(rows: list[dict]) -> list[str]:
    lines = ["| d/ffn/tokens | E | top_k | impl | median s/step [min-max] | tokens/s | vs dense | m6 speedup vs DS | "
             "dropped | peak step MiB | saved act. MiB | rounds kept/dropped |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        s = row["shape"]
        label = f"| {s['d_model']}/{s['ffn_dim']}/{s['tokens']} | {s['num_experts']} | {s['top_k']} | {{}}"
        for impl, v in row["impls"].items():
            drop, kernel = v.get("dropped_fraction"), f" ({v['expert_kernel']})" if v.get("expert_kernel") else ""
            lines.append(label.format(impl + kernel) +
                         f" | {v['median_s']:.3f} [{v['min_s']:.3f}-{v['max_s']:.3f}] | {v['tokens_per_s']:.0f} "
                         f"| {_ratio(v.get('efficiency_vs_dense'))} | {_ratio(v.get('speedup_vs_deepspeed'))} "
                         f"| {'-' if drop is None else f'{drop:.3f}'} | {_mib(v.get('peak_step_bytes'))} "
                         f"| {_mib(v.get('saved_activation_bytes'))} | {row['rounds_kept']}/{row['rounds_dropped']} |")
        lines += [label.format(impl) + f" | failed: {err[:120]} | | | | | | | |" for impl, err in row.get("errors", {}).items()]
    return lines


def render_layer(result: dict) -> str:
    m, s0 = result["machine"], result["rows"][0]["shape"]
    lines = [
        f"# MoE layer benchmark ({result['device']}, {result['precision']})", "",
        f"Command: `{result['command']}`  ",
        f"Machine: {m.get('gpu') or m.get('cpu_model')}, {m['cpu_count']} CPUs, torch {m['torch']}, "
        f"{m['num_threads']} threads; DeepSpeed {result['deepspeed_version']}; total wall {result['wall_s']} s.  ",
        f"Shape: d_model={s0['d_model']}, ffn_dim={s0['ffn_dim']}, tokens={s0['tokens']}, forward+backward, "
        f"capacity factor {result['capacity_factor']} (min {result['min_capacity']}); dense = top_k x tokens through one FFN.  ",
        f"Timing env: `{result['timing_env']}`; implementations interleaved round-robin in one process; "
        "rounds where any step's CPU-time/wall fell below 75% of the thread count were dropped. "
        "Ratios are medians over paired rounds [min-max]. Peak step memory: a fresh process per cell "
        "(CPU: RSS high-water mark above params+inputs, default glibc); saved activations: exact bytes "
        "held for backward (saved-tensor hooks, parameters excluded).", "",
        *layer_table(result["rows"]), "", "## Targets", "",
        "| target | measured (median [min-max]) | threshold | pass |", "|---|---|---|---|"]
    for c in result["summary"]["checks"]:
        val = _ratio(c["value"]) if isinstance(c["value"], dict) else f"{c['value']:.3f}"
        lines.append(f"| {c['target']} | {val} | {c['direction']} {c['threshold']} | {'yes' if c['pass'] else 'NO'} |")
    if result.get("glibc_default_rows"):
        lines += ["", "## Same subset with default glibc (no MALLOC_MMAP_MAX_=0)", "",
                  "Large tensors (> 32 MB, e.g. stacked expert weights and their grads) are page-faulted afresh every step.",
                  "", *layer_table(result["glibc_default_rows"])]
    return "\n".join(lines) + "\n"


def _child(args, mode: str, env_extra: dict, unset: tuple = (), extra_args: tuple = ()) -> dict:
    env = dict(os.environ, OMP_PROC_BIND="close", OMP_PLACES="cores", **env_extra)
    for k in unset:
        env.pop(k, None)
    cmd = [sys.executable, "-m", "bench.moe_layer", "--child", mode, "--device", args.device,
           "--rounds", str(args.rounds), "--max-rounds", str(args.max_rounds), "--shapes", args.shapes, *extra_args]
    cmd += ["--quick"] * args.quick + ["--no-drop"] * args.no_drop
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child {' '.join(cmd)} failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_layer(args, device: torch.device, autocast_dtype) -> None:
    started = time.time()
    stages, out = set(args.stages.split(",")), Path(args.out)
    stem = f"moe_layer-{machine_tag(device)}" + ("-quick" if args.quick else "") + ("-gpu-shapes" if args.shapes == "gpu" else "")
    sub = ["--experts", *map(str, args.experts)] if args.experts else []
    sub += ["--top-k", *map(str, args.top_k)] if args.top_k else []
    threads = {"OMP_NUM_THREADS": str(os.cpu_count())} if device.type == "cpu" else {}
    glibc_default = None
    if "timing" in stages:
        print("timing (MALLOC_MMAP_MAX_=0) ...", file=sys.stderr)
        main_table = _child(args, "timing", dict(threads, MALLOC_MMAP_MAX_="0"), extra_args=tuple(sub))
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
            for impl in row["impls"]:
                row["impls"][impl].update(_child(args, "memory", threads, unset=("MALLOC_MMAP_MAX_",),
                                                 extra_args=("--impl", impl, "--shape", json.dumps(row["shape"]))))
    result = {
        "benchmark": "moe_layer",
        "command": "python -m bench.moe_layer" + (" --quick" if args.quick else "")
                   + (f" --device {args.device} --shapes gpu" if args.shapes == "gpu" else ""),
        "device": device.type, "precision": "bf16 autocast" if autocast_dtype else "fp32",
        "machine": machine_info(device), "deepspeed_version": _versions("deepspeed")["deepspeed_version"],
        "capacity_factor": CAPACITY_FACTOR, "min_capacity": MIN_CAPACITY,
        "timing_env": "OMP_PROC_BIND=close OMP_PLACES=cores MALLOC_MMAP_MAX_=0",
        "rows": main_table["rows"], "glibc_default_rows": glibc_default["rows"] if glibc_default else None,
        "wall_s": round(time.time() - started, 1)}
    # The targets were set for the CPU table's one shape; GPU shapes differ per row.
    result["summary"] = summarize(result) if args.shapes == "default" else {"checks": []}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    (out / f"{stem}.md").write_text(render_layer(result))
    print(render_layer(result))
    print(f"wrote {out / stem}.json and .md", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Kernels table: m6 loop / grouped_mm / fused vs HF's grouped_mm block vs dense SwiGLU
def fused_variants() -> dict:
    """Other tile sizes for the fused kernels, timed on the first shape only (tuning data for
    m6.moe.fused_experts.CUDA_BLOCKS): a narrower N tile (the dual-accumulator GEMM holds two fp32
    tiles), and a shorter M tile (less padding in the last tile of each expert)."""
    from m6.moe.fused_experts import Blocks

    return {"m6_fused@m128n64": Blocks(m=128, n=64, k=64, warps=4, stages=4, wg_k=128, wg_n=64, wg_r=64, wg_warps=4),
            "m6_fused@m64n128": Blocks(m=64, n=128, k=64, warps=4, stages=4, wg_k=64, wg_n=128, wg_r=64, wg_warps=4)}


def _on_device(make, device, dtype, seed: int = 0) -> nn.Module:
    """``make()`` built on meta, materialised on the device with N(0, 0.02) weights drawn there
    (drawing GPU-sized expert stacks on the host would take longer than the benchmark)."""
    with torch.device("meta"):
        module = make()
    module = module.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    return module.to(dtype=dtype).train()


def hf_block(shape, device, dtype, like):
    """transformers' MixtralSparseMoeBlock on torch grouped_mm, with ``like``'s (an m6 layer's)
    router and expert weights: Mixtral's gate_up_proj [E, 2F, D] is (gate; up), down_proj [E, D, F]."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    T, D, F, E, K = shape
    cfg = MixtralConfig(hidden_size=D, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K,
                        hidden_act="silu", router_jitter_noise=0.0, experts_implementation="grouped_mm")
    with torch.device("meta"):
        block = MixtralSparseMoeBlock(cfg)
    impl = getattr(block.experts.config, "_experts_implementation", None)
    if impl != "grouped_mm":
        raise RuntimeError(f"MixtralExperts runs experts_implementation={impl!r}, not grouped_mm")
    block = block.to_empty(device=device).to(dtype=dtype).train()
    with torch.no_grad():
        ex = like.experts
        block.gate.weight.copy_(like.router.weight)
        block.experts.gate_up_proj.copy_(torch.cat([ex.w_gate.transpose(1, 2), ex.w_in.transpose(1, 2)], dim=1))
        block.experts.down_proj.copy_(ex.w_out.transpose(1, 2))
    return block


def _inputs(rows: int, D: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(rows, D, device=device, generator=gen).to(dtype).requires_grad_(True)
    return x, torch.randn(rows, D, device=device, generator=gen).to(dtype)


def build_kernel_step(impl: str, shape, device, dtype, layer):
    """(module, input, one forward+backward step) for one implementation; the m6 kernels share
    ``layer`` (its experts' kernel switched), HF gets a copy of its weights."""
    T, D, F, E, K = shape
    x, dy = _inputs(T * K if impl == "dense" else T, D, device, dtype)
    if impl == "dense":
        module = fwd = _on_device(lambda: DenseFFN(D, F, swiglu=True), device, dtype)
    elif impl == "hf_grouped_mm":
        module = hf_block(shape, device, dtype, layer)
        fwd = lambda x_: module(x_.unsqueeze(0)).squeeze(0)  # noqa: E731
    else:
        module = layer
        layer.experts.expert_kernel = impl.removeprefix("m6_").split("@")[0]
        fwd = lambda x_: layer(x_)[0]  # noqa: E731
    params = list(module.parameters())

    def step() -> torch.Tensor:
        for p in params:
            p.grad = None
        x.grad = None
        y = fwd(x)
        y.backward(dy)
        return y

    return module, x, step


def check_fused(shape, device, dtype, layer) -> dict:
    """Relative errors (||a - b|| / ||b||) of fused against grouped_mm (same layer, same input):
    output, input grad and every parameter grad; and of HF's block output against m6 grouped_mm."""
    results = {}
    for kernel in ("grouped_mm", "fused"):
        module, x, step = build_kernel_step(f"m6_{kernel}", shape, device, dtype, layer)
        y = step()
        if module.experts.last_kernel != kernel:
            raise RuntimeError(f"asked for expert_kernel={kernel}, the layer ran {module.experts.last_kernel}")
        results[kernel] = {"y": y.detach().float(), "dx": x.grad.float()} | {
            f"d_{n}": p.grad.float() for n, p in module.named_parameters() if p.grad is not None}
    for p in layer.parameters():
        p.grad = None
    ref, ours = results["grouped_mm"], results["fused"]
    errs = {k: float((ours[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)) for k in ref}
    try:
        block = hf_block(shape, device, dtype, layer)
        with torch.no_grad():
            y_hf = block(_inputs(shape[0], shape[1], device, dtype)[0].unsqueeze(0)).squeeze(0).float()
        errs["hf_y_vs_m6"] = float((y_hf - ref["y"]).norm() / ref["y"].norm().clamp_min(1e-30))
    except Exception as e:  # the HF row reports its own error in the timing loop
        errs["hf_y_vs_m6"] = _errors_as_text(e, 200)
    return errs


def peak_bytes(step, module, device) -> dict:
    """Peak allocated bytes of one step above what is held before it (params, input, no grads)."""
    if device.type != "cuda":
        return {}
    for p in module.parameters():
        p.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in module.parameters() if p.grad is not None)
    return {"peak_step_bytes": torch.cuda.max_memory_allocated(device) - base, "param_grad_bytes": grads}


def kernel_profile(step, device, rows: int = 14) -> str:
    """The top kernels of two steps by device time (torch profiler): where the fused path spends it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")) as prof:
        step()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    averages = prof.key_averages()
    keys = ("self_device_time_total", "self_cuda_time_total") if device.type == "cuda" else ("self_cpu_time_total",)
    for key in keys:  # torch renamed the CUDA column to "device" (2.4+); older ones know only "cuda"
        try:
            return averages.table(sort_by=key, row_limit=rows, max_name_column_width=60)
        except (AttributeError, KeyError, ValueError):
            continue
    return averages.table(row_limit=rows)


def run_kernel_shape(shape, device, dtype, warmup: int, reps: int, impls, variants: dict | None = None,
                     profile: bool = False, check: bool = True) -> dict:
    from m6.moe import MoELayer, fused_experts

    T, D, F, E, K = shape
    flop = 6.0 * T * K * D * F * 3
    row: dict = {"shape": dict(tokens=T, d_model=D, ffn_dim=F, num_experts=E, top_k=K), "useful_flop": flop,
                 "impls": {}, "errors": {}}
    layer = _on_device(lambda: MoELayer(D, F, E, top_k=K, capacity_factor=None, activation="swiglu", init_seed=0),
                       device, dtype)
    if check:
        try:
            row["rel_err_fused_vs_grouped_mm"] = check_fused(shape, device, dtype, layer)
        except Exception as e:  # recorded; the timings still run
            row["errors"]["correctness"] = _errors_as_text(e, 400)
        print(f"[moe_layer] {shape} fused vs grouped_mm rel err: "
              f"{row.get('rel_err_fused_vs_grouped_mm', row['errors'].get('correctness'))}", file=sys.stderr, flush=True)
    default_blocks, variants = fused_experts.CUDA_BLOCKS, variants or {}
    for impl in [*impls, *variants]:
        module = step = None
        try:
            # The module constant the launchers read: swapped for a variant's timing only.
            fused_experts.CUDA_BLOCKS = variants.get(impl, default_blocks)
            module, _, step = build_kernel_step(impl, shape, device, dtype, layer)
            rec = ms_stats(time_ms(step, device, warmup, reps))
            rec["tflops"] = flop / (rec["median_ms"] * 1e-3) / 1e12
            rec |= peak_bytes(step, module, device)
            if "peak_step_bytes" in rec:
                rec["peak_bytes_per_token"] = rec["peak_step_bytes"] / T
            if impl.startswith("m6_"):
                rec["expert_kernel_ran"] = module.experts.last_kernel
            if impl == "m6_fused" and profile:  # the first shape: where the time goes
                try:
                    row["fused_profile"] = kernel_profile(step, device)
                except Exception as e:  # a profiler failure must not cost the measurement
                    row["fused_profile"] = f"profiler failed: {_errors_as_text(e, 200)}"
            row["impls"][impl] = rec
        except Exception as e:  # one implementation failing (e.g. out of memory) leaves the others
            row["errors"][impl] = _errors_as_text(e, 400)
        finally:
            fused_experts.CUDA_BLOCKS = default_blocks
            for p in layer.parameters():
                p.grad = None
            del module, step
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"[moe_layer]   {impl}: {row['impls'].get(impl, row['errors'].get(impl))}", file=sys.stderr, flush=True)
    _anchor_ratios(row, row)
    return row


def _anchor_ratios(row: dict, anchors: dict) -> None:
    """speed_vs_hf_grouped_mm / speed_vs_dense of every row entry, against ``anchors``' times."""
    for impl, rec in row["impls"].items():
        for anchor in ("hf_grouped_mm", "dense"):
            if anchor in anchors["impls"] and impl != anchor:
                rec[f"speed_vs_{anchor}"] = anchors["impls"][anchor]["median_ms"] / rec["median_ms"]


def render_kernels(result: dict) -> list[str]:
    md = [f"Forward + backward, {result['dtype']} parameters, {result['device_name']}; CUDA events, median of "
          f"{result['reps']} after {result['warmup']} warm-up steps. TFLOP/s = useful work 6*T*K*D*F*3 / time. "
          "Peak = bytes allocated above params + input during one step (parameter gradients included), per token.",
          "", "| T, D, F, E, K | impl | ms | TFLOP/s | x HF grouped_mm | x dense | peak B/token | kernel ran |",
          "|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        label = ", ".join(str(v) for v in row["shape"].values())
        for impl, r in row["impls"].items():
            peak = f"{r['peak_bytes_per_token']:.0f}" if "peak_bytes_per_token" in r else "-"
            md.append(f"| {label} | {impl} | {r['median_ms']:.2f} | {r['tflops']:.0f} | "
                      f"{r.get('speed_vs_hf_grouped_mm', float('nan')):.2f} | {r.get('speed_vs_dense', float('nan')):.2f} | "
                      f"{peak} | {r.get('expert_kernel_ran', '')} |")
        md += [f"| {label} | {impl} | error: {err[:120]} | | | | | |" for impl, err in row["errors"].items()]
    md += ["", "Fused vs grouped_mm, relative error (output, input grad, parameter grads):", ""]
    md += [f"- {tuple(row['shape'].values())}: " + ", ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}"
                                                            for k, v in row["rel_err_fused_vs_grouped_mm"].items())
           for row in result["rows"] if row.get("rel_err_fused_vs_grouped_mm")]
    for row in result["rows"]:
        if row.get("fused_profile"):
            md += ["", f"m6_fused, two steps at {tuple(row['shape'].values())} under the torch profiler:", "", "```",
                   *row["fused_profile"].splitlines(), "```"]
    return md


def run_kernels(device: torch.device, tiny: bool, out: Path | None, warmup: int = 3, reps: int = 10,
                budget_s: float = 300.0, shapes=None, impls=KERNEL_IMPLS) -> tuple[dict, list[str]]:
    """The kernels table; with ``out``, DIR/moe_kernels-table.json and .md rewritten after every
    shape (a run cut short keeps what it measured). Shapes left when ``budget_s`` is spent are skipped."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = shapes or (KERNEL_TINY_SHAPES if tiny else KERNEL_SHAPES)
    result = {"benchmark": "moe_layer --kernels", "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
              else "cpu", "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__, "warmup": warmup,
              "reps": reps, "tiny": tiny, "flop_formula": "6 * tokens * top_k * d_model * ffn_dim * 3",
              **_versions("triton", "transformers"), "rows": [], "skipped_shapes": []}
    started = time.time()

    def save() -> None:
        result["wall_s"] = round(time.time() - started, 1)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "moe_kernels-table.json").write_text(json.dumps(result, indent=2))
            (out / "moe_kernels-table.md").write_text("\n".join(render_kernels(result)) + "\n")

    for shape in shapes:
        if time.time() - started > budget_s:
            result["skipped_shapes"].append(list(shape))
            continue
        first = not result["rows"] and "m6_fused" in impls
        result["rows"].append(run_kernel_shape(shape, device, dtype, warmup, reps, impls, profile=first))
        save()
    if result["rows"] and "m6_fused" in impls and time.time() - started <= budget_s:
        # Tuning data last, so the main table never waits on their compiles: the first shape again,
        # the fused kernels alone at the other tile sizes (rows[0] gets them, anchors as measured there).
        extra = run_kernel_shape(shapes[0], device, dtype, warmup, reps, (), variants=fused_variants(), check=False)
        first = result["rows"][0]
        first["errors"].update(extra["errors"])
        _anchor_ratios(extra, first)
        first["impls"].update(extra["impls"])
        save()
    if result["skipped_shapes"]:
        print(f"[moe_layer] time budget spent; skipped {result['skipped_shapes']}", file=sys.stderr)
    return result, render_kernels(result)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kernels", action="store_true", help="the kernels table (m6 loop/grouped_mm/fused vs HF vs dense)")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a harness check, not a measurement")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--rounds", type=int, default=7, help="layer table: clean rounds to keep per shape")
    p.add_argument("--max-rounds", type=int, default=30)
    p.add_argument("--experts", type=int, nargs="*", help="layer table: override the num_experts list")
    p.add_argument("--top-k", type=int, nargs="*", help="layer table: override the top_k list")
    p.add_argument("--skip-glibc-compare", action="store_true")
    p.add_argument("--shapes", choices=["default", "gpu"], default="default",
                   help="layer table, gpu: GPU_SHAPES (16k-64k tokens, d 2048-4096, fine-grained E 64-128 top-8)")
    p.add_argument("--no-drop", action="store_true",
                   help="keep every round whatever the CPU utilisation (a harness check on a busy CPU)")
    p.add_argument("--stages", default="timing,memory",
                   help="layer table: 'memory' alone re-measures memory into the existing results file")
    p.add_argument("--budget-s", type=float, default=300.0, help="kernels table: no new shape after this many seconds")
    p.add_argument("--impls", default=",".join(KERNEL_IMPLS), help="kernels table: the implementations to time")
    p.add_argument("--child", choices=["timing", "memory"], help=argparse.SUPPRESS)
    p.add_argument("--impl", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.kernels:
        if device.type == "cpu":  # the fused kernels run on CPU only under Triton's interpreter
            os.environ.setdefault("TRITON_INTERPRET", "1")
        _, md = run_kernels(device, args.quick, Path(args.out), budget_s=args.budget_s, impls=tuple(args.impls.split(",")))
        print("\n".join(md))
        return
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    if args.child == "timing":
        print(json.dumps(run_timing(args, device, autocast_dtype)))
    elif args.child == "memory":
        print(json.dumps(measure_memory(args.impl, json.loads(args.shape), device, autocast_dtype)))
    else:
        run_layer(args, device, autocast_dtype)


if __name__ == "__main__":
    main()
