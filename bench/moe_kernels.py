"""Expert kernels at fine-grained MoE shapes: m6 loop / grouped_mm / fused against Hugging Face's
grouped_mm MoE block and a dense SwiGLU FFN doing the same useful work, forward + backward.

    python -m bench.moe_kernels --out DIR            # GPU: the issue-44 shapes, bf16 parameters
    python -m bench.gpu_parts moe_kernels --out DIR  # the same as a part of bench/gpu_suite
    TRITON_INTERPRET=1 python -m bench.moe_kernels --device cpu --tiny --out DIR   # harness check, fp32

Per shape (tokens T, d_model D, expert ffn F, experts E, top-k K), all in one process:
1. correctness: m6's MoELayer with expert_kernel=fused against the same layer with grouped_mm (same
   weights, same input): relative error (||a - b|| / ||b||) of the output, the input gradient and
   every parameter gradient (router, w_in, w_gate, w_out); printed and recorded.
2. time of one forward + backward (CUDA events, median of 10 after 3 warm-up steps) for
   m6_loop, m6_grouped_mm, m6_fused (the whole MoELayer: router, dispatch, experts, combine, the
   loss statistics; SwiGLU, dropless top-K softmax), hf_grouped_mm (transformers'
   MixtralSparseMoeBlock, experts_implementation="grouped_mm", the same router and expert weights)
   and dense (one SwiGLU FFN D x F over T*K rows: the useful work of an ideal MoE layer); on the
   first shape the top kernels of two fused steps under the torch profiler; after every shape,
   if time is left, the first shape's fused kernels at two other tile sizes (``fused_variants``).
3. peak device bytes of one step above the resting state (parameters and input held), per token;
   the parameter gradients are part of that peak and are recorded apart (the same for every MoE).

Useful work, the basis of every TFLOP/s figure: 6 * T * K * D * F * 3 FLOP (three GEMMs of
2*T*K*D*F each in forward, twice that in backward).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

# (tokens, d_model, ffn_dim, num_experts, top_k): the fine-grained targets first (issue 44).
GPU_SHAPES = [(32768, 2048, 768, 128, 8), (16384, 2048, 1024, 64, 8), (16384, 2048, 768, 128, 8),
              (16384, 2048, 8192, 8, 2), (8192, 4096, 14336, 8, 2)]
TINY_SHAPES = [(48, 32, 32, 8, 2), (32, 16, 16, 4, 4)]
IMPLS = ("m6_loop", "m6_grouped_mm", "m6_fused", "hf_grouped_mm", "dense")


def fused_variants() -> dict:
    """Other tile sizes for the fused kernels, timed on the first shape only (tuning data for
    m6.moe.fused_experts.CUDA_BLOCKS): a narrower N tile (the dual-accumulator GEMM holds two fp32
    tiles), and a shorter M tile (less padding in the last tile of each expert)."""
    from m6.moe.fused_experts import Blocks

    return {"m6_fused@m128n64": Blocks(m=128, n=64, k=64, warps=4, stages=4, wg_k=128, wg_n=64, wg_r=64, wg_warps=4),
            "m6_fused@m64n128": Blocks(m=64, n=128, k=64, warps=4, stages=4, wg_k=64, wg_n=128, wg_r=64, wg_warps=4)}


def useful_flops(T: int, D: int, F: int, K: int) -> float:
    """Forward + backward FLOP of a SwiGLU expert FFN over T*K routed rows (3 GEMMs, bwd = 2x fwd)."""
    return 6.0 * T * K * D * F * 3


def m6_layer(shape, device, dtype, seed: int = 0):
    """A SwiGLU, dropless, top-K softmax MoELayer with random weights drawn on the device (built on
    meta first: drawing GPU-sized expert stacks on the host would take longer than the benchmark)."""
    from m6.moe import MoELayer

    T, D, F, E, K = shape
    with torch.device("meta"):
        layer = MoELayer(D, F, E, top_k=K, capacity_factor=None, activation="swiglu", init_seed=seed)
    layer = layer.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    return layer.to(dtype=dtype).train()


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


class DenseSwiGLU(nn.Module):
    """The dense anchor: one SwiGLU FFN D -> F -> D over every routed row."""

    def __init__(self, D: int, F: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(D, 2 * F, bias=False)
        self.down = nn.Linear(F, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(nn.functional.silu(g) * u)


def inputs(rows: int, D: int, device, dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, D, device=device, generator=gen).to(dtype).requires_grad_(True)
    return x, torch.randn(rows, D, device=device, generator=gen).to(dtype)


def build(impl: str, shape, device, dtype, layer):
    """(module, input [rows, D], output grad, forward fn) for one implementation; the m6 kernels
    share ``layer`` (its experts' kernel switched), HF gets a copy of its weights."""
    T, D, F, E, K = shape
    if impl == "dense":
        with torch.device("meta"):
            module = DenseSwiGLU(D, F)
        module = module.to_empty(device=device)
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0.0, 0.02)
        module = module.to(dtype=dtype).train()
        x, dy = inputs(T * K, D, device, dtype)
        return module, x, dy, module
    x, dy = inputs(T, D, device, dtype)
    if impl == "hf_grouped_mm":
        module = hf_block(shape, device, dtype, layer)
        return module, x, dy, lambda x_: module(x_.unsqueeze(0)).squeeze(0)
    layer.experts.expert_kernel = impl.removeprefix("m6_").split("@")[0]
    return layer, x, dy, lambda x_: layer(x_)[0]


def make_step(module, x, dy, fwd) -> Callable[[], torch.Tensor]:
    params = list(module.parameters())

    def step() -> torch.Tensor:
        for p in params:
            p.grad = None
        x.grad = None
        y = fwd(x)
        y.backward(dy)
        return y

    return step


def time_ms(fn, device, warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in events]


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


def check_fused(shape, device, dtype, layer) -> dict:
    """Relative errors of fused against grouped_mm (same layer, same input) on this shape, and of
    HF's block against m6 grouped_mm (the anchor computes the same function: output only)."""
    results = {}
    for kernel in ("grouped_mm", "fused"):
        module, x, dy, fwd = build(f"m6_{kernel}", shape, device, dtype, layer)
        y = make_step(module, x, dy, fwd)()
        ran = module.experts.last_kernel
        if ran != kernel:
            raise RuntimeError(f"asked for expert_kernel={kernel}, the layer ran {ran}")
        results[kernel] = {"y": y.detach().float(), "dx": x.grad.float()} | {
            f"d_{n}": p.grad.float() for n, p in module.named_parameters() if p.grad is not None}
        del x, dy, y
    for p in layer.parameters():
        p.grad = None
    ref, ours = results["grouped_mm"], results["fused"]
    errs = {k: float((ours[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)) for k in ref}
    try:
        block, x, dy, fwd = build("hf_grouped_mm", shape, device, dtype, layer)
        with torch.no_grad():
            y_hf = fwd(x).float()
        errs["hf_y_vs_m6"] = float((y_hf - ref["y"]).norm() / ref["y"].norm().clamp_min(1e-30))
        del block, x, dy, y_hf
    except Exception as e:  # the HF row reports its own error in the timing loop
        errs["hf_y_vs_m6"] = f"{type(e).__name__}: {str(e)[:200]}"
    return errs


def run_shape(shape, device, dtype, warmup: int, reps: int, impls, variants: dict | None = None,
              profile: bool = False, check: bool = True) -> dict:
    T, D, F, E, K = shape
    row: dict = {"shape": dict(tokens=T, d_model=D, ffn_dim=F, num_experts=E, top_k=K),
                 "useful_flop": useful_flops(T, D, F, K), "impls": {}, "errors": {}}
    layer = m6_layer(shape, device, dtype)
    if check:
        try:
            row["rel_err_fused_vs_grouped_mm"] = check_fused(shape, device, dtype, layer)
        except Exception as e:  # recorded; the timings still run
            row["errors"]["correctness"] = f"{type(e).__name__}: {str(e)[:400]}"
        print(f"[moe_kernels] {shape} fused vs grouped_mm rel err: "
              f"{row.get('rel_err_fused_vs_grouped_mm', row['errors'].get('correctness'))}", file=sys.stderr, flush=True)
    from m6.moe import fused_experts

    default_blocks = fused_experts.CUDA_BLOCKS
    variants = variants or {}
    for impl in [*impls, *variants]:
        module = x = dy = fwd = step = None
        try:
            # The module constant the launchers read: swapped for a variant's timing only.
            fused_experts.CUDA_BLOCKS = variants.get(impl, default_blocks)
            module, x, dy, fwd = build(impl, shape, device, dtype, layer)
            step = make_step(module, x, dy, fwd)
            ms = time_ms(step, device, warmup, reps)
            rec = {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "reps": len(ms)}
            rec["tflops"] = row["useful_flop"] / (rec["median_ms"] * 1e-3) / 1e12
            rec |= peak_bytes(step, module, device)
            if "peak_step_bytes" in rec:
                rec["peak_bytes_per_token"] = rec["peak_step_bytes"] / T
            if impl.startswith("m6_"):
                rec["expert_kernel_ran"] = module.experts.last_kernel
            if impl == "m6_fused" and profile:  # the first shape: where the time goes
                try:
                    row["fused_profile"] = kernel_profile(step, device)
                except Exception as e:  # a profiler failure must not cost the measurement
                    row["fused_profile"] = f"profiler failed: {type(e).__name__}: {str(e)[:200]}"
            row["impls"][impl] = rec
        except Exception as e:  # one implementation failing (e.g. out of memory) leaves the others
            row["errors"][impl] = f"{type(e).__name__}: {str(e)[:400]}"
        finally:
            fused_experts.CUDA_BLOCKS = default_blocks
            for p in layer.parameters():
                p.grad = None
            del module, x, dy, fwd, step
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"[moe_kernels]   {impl}: {row['impls'].get(impl, row['errors'].get(impl))}", file=sys.stderr, flush=True)
    for impl, rec in row["impls"].items():
        for anchor in ("hf_grouped_mm", "dense"):
            if anchor in row["impls"] and impl != anchor:
                rec[f"speed_vs_{anchor}"] = row["impls"][anchor]["median_ms"] / rec["median_ms"]
    return row


def kernel_profile(step, device, rows: int = 14) -> str:
    """The top kernels of two steps by device time (torch profiler): where the fused path spends it."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
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


def render_markdown(result: dict) -> list[str]:
    md = [f"Forward + backward, {result['dtype']} parameters, {result['device_name']}; CUDA events, median of "
          f"{result['reps']} after {result['warmup']} warm-up steps. TFLOP/s = useful work 6*T*K*D*F*3 / time. "
          "Peak = bytes allocated above params + input during one step (parameter gradients included), per token.",
          "", "| T, D, F, E, K | impl | ms | TFLOP/s | x HF grouped_mm | x dense | peak B/token | kernel ran |",
          "|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        s = row["shape"]
        label = f"{s['tokens']}, {s['d_model']}, {s['ffn_dim']}, {s['num_experts']}, {s['top_k']}"
        for impl, r in row["impls"].items():
            peak = f"{r['peak_bytes_per_token']:.0f}" if "peak_bytes_per_token" in r else "-"
            md.append(f"| {label} | {impl} | {r['median_ms']:.2f} | {r['tflops']:.0f} | "
                      f"{r.get('speed_vs_hf_grouped_mm', float('nan')):.2f} | {r.get('speed_vs_dense', float('nan')):.2f} | "
                      f"{peak} | {r.get('expert_kernel_ran', '')} |")
        for impl, err in row["errors"].items():
            md.append(f"| {label} | {impl} | error: {err[:120]} | | | | | |")
    md += ["", "Fused vs grouped_mm, relative error (output, input grad, parameter grads):", ""]
    for row in result["rows"]:
        errs = row.get("rel_err_fused_vs_grouped_mm")
        if errs:
            md.append(f"- {tuple(row['shape'].values())}: "
                      + ", ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in errs.items()))
    for row in result["rows"]:
        if row.get("fused_profile"):
            md += ["", f"m6_fused, two steps at {tuple(row['shape'].values())} under the torch profiler:", "", "```",
                   *row["fused_profile"].splitlines(), "```"]
    return md


def _save(result: dict, out: Path | None, started: float) -> None:
    result["wall_s"] = round(time.time() - started, 1)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "moe_kernels-table.json").write_text(json.dumps(result, indent=2))
        (out / "moe_kernels-table.md").write_text("\n".join(render_markdown(result)) + "\n")


def run(device: torch.device, tiny: bool, out: Path | None, warmup: int = 3, reps: int = 10,
        budget_s: float = 300.0, shapes=None, impls=IMPLS) -> tuple[dict, list[str]]:
    """The whole table; with ``out``, DIR/moe_kernels-table.json and .md rewritten after every shape
    (a run cut short keeps what it measured). Shapes left when ``budget_s`` is spent are skipped."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = shapes or (TINY_SHAPES if tiny else GPU_SHAPES)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {"benchmark": "moe_kernels", "device_name": name, "dtype": str(dtype).removeprefix("torch."),
              "torch": torch.__version__, "warmup": warmup, "reps": reps, "tiny": tiny,
              "flop_formula": "6 * tokens * top_k * d_model * ffn_dim * 3", "rows": [], "skipped_shapes": []}
    for lib in ("triton", "transformers"):
        try:
            result[f"{lib}_version"] = __import__(lib).__version__
        except Exception as e:  # recorded: the table says which anchor was missing
            result[f"{lib}_version"] = f"unavailable: {e}"
    started = time.time()
    for shape in shapes:
        if time.time() - started > budget_s:
            result["skipped_shapes"].append(list(shape))
            continue
        first = not result["rows"] and "m6_fused" in impls
        result["rows"].append(run_shape(shape, device, dtype, warmup, reps, impls, profile=first))
        _save(result, out, started)
    if result["rows"] and "m6_fused" in impls and time.time() - started <= budget_s:
        # Tuning data last, so the main table never waits on their compiles: the first shape again,
        # the fused kernels alone at the other tile sizes (rows[0] gets them, anchors as measured there).
        extra = run_shape(shapes[0], device, dtype, warmup, reps, (), variants=fused_variants(), check=False)
        first = result["rows"][0]
        first["errors"].update(extra["errors"])
        for impl, rec in extra["impls"].items():
            for anchor in ("hf_grouped_mm", "dense"):
                if anchor in first["impls"]:
                    rec[f"speed_vs_{anchor}"] = first["impls"][anchor]["median_ms"] / rec["median_ms"]
            first["impls"][impl] = rec
        _save(result, out, started)
    if result["skipped_shapes"]:
        print(f"[moe_kernels] time budget spent; skipped {result['skipped_shapes']}", file=sys.stderr)
    return result, render_markdown(result)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU harness check, not a measurement)")
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=300.0, help="skip the shapes left after this many seconds")
    p.add_argument("--impls", default=",".join(IMPLS))
    args = p.parse_args(argv)
    _, md = run(torch.device(args.device), args.tiny, Path(args.out), budget_s=args.budget_s,
                impls=tuple(args.impls.split(",")))
    print("\n".join(md))


if __name__ == "__main__":
    main()
