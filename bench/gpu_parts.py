"""The parts of bench/gpu_suite.py, one per process: ``python -m bench.gpu_parts PART --out DIR``.

Each part writes DIR/PART.json: {"part", "device_info", "result", "markdown"}; the suite runs
each in its own process (a CUDA error or a hang in one cannot take the others down) and under its
own time limit. ``--smoke`` shrinks every shape so the whole suite runs on a CPU in seconds (a
harness check, not a measurement).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from bench.harness import free_port, ms_stats, time_ms

# The tests that honour pytest --device (tests/conftest.py), plus the grouped-GEMM and host-sync
# tests, whose CUDA cases run whenever CUDA is there.
# test_fp16 and the staging tests run before the offload tests: on an H100 three offload tests once
# failed only after them in one process (a page-locked registration left behind).
DEVICE_TESTS = ["tests/unit/test_moe_layer.py", "tests/unit/test_expert_kernel.py", "tests/unit/test_fused_experts.py",
                "tests/unit/test_moe_host_syncs.py",
                "tests/unit/test_model.py", "tests/unit/test_cast_on_use.py", "tests/unit/test_fp16.py",
                "tests/unit/test_checkpoint_cuda_paths.py", "tests/unit/test_offload.py", "tests/unit/test_checkpoint.py",
                "tests/unit/test_activation_checkpoint.py", "tests/unit/test_adafactor.py",
                "tests/unit/test_shard_offload.py", "tests/unit/test_host_grad_dtype.py", "tests/unit/test_adamw_copy.py"]


def device_info(device: torch.device) -> dict:
    """Device name, torch, CUDA and driver versions: stamped on every part's result."""
    info = {"device": str(device), "torch": torch.__version__, "python": platform.python_version(),
            "cuda_runtime": torch.version.cuda, "host": platform.node()}
    from m6.moe.expert_gemm import fused_grouped_mm_on, grouped_mm_op

    op = grouped_mm_op()
    info["grouped_mm"] = None if op is None else f"{op.__module__}.{op.__name__}"
    if device.type == "cuda":
        info["grouped_mm_fused"] = fused_grouped_mm_on(device)
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else None
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1))
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            info["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 else f"nvidia-smi rc {out.returncode}"
        except (OSError, subprocess.TimeoutExpired, IndexError) as e:
            info["driver"] = f"unavailable: {e}"
    else:
        info["name"] = platform.processor() or platform.machine()
    return info


# ---------------------------------------------------------------------------------------------
# (a) the device-aware tests on the device
def part_tests(args, device: torch.device, out: Path) -> tuple[dict, list[str]]:
    files = DEVICE_TESTS
    selector: list[str] = []
    if args.smoke:
        files, selector = ["tests/unit/test_expert_kernel.py"], ["-k", "no_rows or idle_first"]
    junit = out / "tests-junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--device", device.type,
           f"--junitxml={junit}", *selector, *files]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (out / "tests.log").write_text(proc.stdout + proc.stderr)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed = []
    if junit.exists():
        root = ET.parse(junit).getroot()
        for suite in ([root] if root.tag == "testsuite" else root.iter("testsuite")):
            for k in counts:
                counts[k] += int(suite.get(k, 0))
            for case in suite.iter("testcase"):
                if case.find("failure") is not None or case.find("error") is not None:
                    failed.append(f"{case.get('classname')}::{case.get('name')}")
    result = {"command": " ".join(cmd[1:]), "returncode": proc.returncode, **counts,
              "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"], "failed": failed}
    md = [f"`{result['command']}`: rc {proc.returncode}; {result['passed']} passed, {counts['failures']} failed, "
          f"{counts['errors']} errors, {counts['skipped']} skipped (log: tests.log)"]
    md += [f"- FAILED {name}" for name in failed[:30]]
    return result, md


# ---------------------------------------------------------------------------------------------
# (b) the device's bf16 GEMM rate
def part_gemm_rate(args, device: torch.device, out: Path) -> tuple[dict, list[str]]:
    n = 256 if args.smoke else 8192
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    # Three random input sets, rotated, so no repeat reads operands from cache (and never zeros).
    sets = [(torch.randn(n, n, device=device, dtype=dtype, generator=g),
             torch.randn(n, n, device=device, dtype=dtype, generator=g)) for _ in range(3)]
    c = torch.empty(n, n, device=device, dtype=dtype)
    i = [0]

    def step() -> None:
        a, b = sets[i[0] % 3]
        i[0] += 1
        torch.mm(a, b, out=c)

    ms = time_ms(step, device, warmup=3 if args.smoke else 10, reps=5 if args.smoke else 30)
    s = ms_stats(ms)
    tflops = 2 * n**3 / (s["median_ms"] * 1e-3) / 1e12
    result = {"n": n, "dtype": str(dtype), **s, "tflops_median": tflops,
              "tflops_best": 2 * n**3 / (s["min_ms"] * 1e-3) / 1e12}
    return result, [f"{n}x{n}x{n} {dtype} matmul (random data, 3 rotating input sets): median {s['median_ms']:.3f} ms "
                    f"over {s['reps']} -> {tflops:.1f} TFLOP/s (best {result['tflops_best']:.1f})"]


# ---------------------------------------------------------------------------------------------
# (c) the MoE layer against DeepSpeed-MoE and a dense FFN (bench.moe_layer's layer table)
def part_moe_layer(args, device: torch.device, out: Path) -> tuple[dict, list[str]]:
    sub = out / "moe_layer"
    cmd = [sys.executable, "-m", "bench.moe_layer", "--device", device.type, "--stages", "timing",
           "--skip-glibc-compare", "--out", str(sub)]
    cmd += ["--quick", "--rounds", "1", "--max-rounds", "2", "--no-drop", "--experts", "4", "--top-k", "2"] if args.smoke \
        else ["--shapes", "gpu", "--rounds", "10", "--max-rounds", "12"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (out / "moe_layer.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"bench.moe_layer exited {proc.returncode}: {proc.stderr[-2000:]}")
    (file,) = sub.glob("moe_layer-*.json")
    lines = file.with_suffix(".md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| d/ffn/tokens"))
    md = [f"`{' '.join(cmd[1:])}` -> {file.relative_to(out)}", "", *lines[start:]]  # without the long preamble
    return {"command": " ".join(cmd[1:]), "file": str(file.relative_to(out)),
            "rows": json.loads(file.read_text())["rows"]}, md


# ---------------------------------------------------------------------------------------------
# (d) expert kernels at fine-grained shapes (bench.moe_layer's kernels table): m6 loop/grouped_mm/fused
# vs HF grouped_mm vs dense
def part_moe_kernels(args, device: torch.device, out: Path) -> tuple[dict, list[str]]:
    if device.type == "cpu":
        # The fused kernels run on CPU only under Triton's interpreter, chosen before triton is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from bench.moe_layer import KERNEL_TINY_SHAPES, run_kernels

    if args.smoke or device.type == "cpu":
        # Triton's interpreter: a harness check, not a measurement. No warmup (nothing compiles) and
        # two reps (the median and spread still come from several calls): each fused call of the
        # tiny shape is ~0.5 s of interpreted kernels on a quiet core, 4 calls per timed variant before.
        return run_kernels(device, tiny=True, out=out, warmup=0, reps=2, shapes=KERNEL_TINY_SHAPES[:1])
    # No new shape starts after 200 s: the part ends inside a 5-minute call (the first shape pays the
    # Triton compiles, ~1.5 min; the others ~30 s each).
    return run_kernels(device, tiny=False, out=out, budget_s=200.0)


# ---------------------------------------------------------------------------------------------
# (e) end to end: two configs at several tokens per step, their step breakdowns, the HF peer
def _text_corpus(path: Path, lines: int, words_per_line: int, seed: int = 0) -> None:
    """Random lowercase words, one long line per sample: every sample fills data.seq_len."""
    import numpy as np

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    with open(path, "w") as f:
        for _ in range(lines):
            lens = rng.integers(2, 9, size=words_per_line)
            f.write(" ".join("".join(rng.choice(letters, size=int(n))) for n in lens) + "\n")


def train_overrides(args, out: Path) -> list[str]:
    """Config overrides of the end-to-end run: full rows of synthetic text, no eval or checkpoints.

    The denoise task (corrupted text -> text): a line of seq_len/10 random words is ~0.7 seq_len
    tokens, so the source always fits and the target is cut at seq_len: every row is full (the
    continue task at 1024 left 37% of the rows empty, records skipped as too long)."""
    corpus = out / "corpus.txt"
    seq_len = 64 if args.smoke else 1024
    _text_corpus(corpus, lines=64 if args.smoke else 2048, words_per_line=max(4, seq_len // 10))
    extra = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64",
             "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_dim=32", "model.max_text_len=64", "train.global_batch_size=2",
             "train.micro_batch_size=2"] if args.smoke else []
    return ["data.kind=files", f"data.sources=[{{path: {corpus}, format: text, weight: 1.0}}]",
            "data.tasks={denoise: 1.0}", "data.eval_samples=0", "data.num_workers=2", f"data.seq_len={seq_len}",
            f"train.device={'cuda' if args.device == 'cuda' else 'cpu'}", "train.eval_every=0", "checkpoint.enabled=false",
            "logging.every=1", "logging.wandb.enabled=false", *extra]


# The end-to-end runs of issue #45's table: (config, micro-batch, accumulation); each one process
# that times steps and then profiles two (bench.step_breakdown), and the HF peer of the
# fine-grained config at the same tokens per step.
E2E_RUNS = [("configs/m6-gpu-2b.yaml", 8, 1, ""), ("configs/m6-gpu-2b.yaml", 32, 1, ""),
            ("configs/m6-gpu-finegrained.yaml", 8, 1, ""), ("configs/m6-gpu-finegrained.yaml", 16, 4, "")]
E2E_PEER = ("configs/m6-gpu-finegrained.yaml", [(8, 1, ""), (16, 4, "")])
# Variants of a row, tagged "<row>-<variant>": run only when --only names them (a substring of the
# tag: "--only m6-gpu-finegrained-mb16x4" runs that row, its variants and its HF peer side by side).
# per_step: train.weight_copy=per_step (bf16 weights copied once per step from fp32 masters on the
# device, m6.memory.master_weights). v152k: Qwen3's vocabulary of 151,936 (the embedding and LM head
# at that size, the loss over it in row chunks: model.loss_chunk_rows=auto); the generated text is
# still byte-tokenized (ids < 261): the shapes and FLOPs are a real vocabulary's, the token ids not.
E2E_VARIANTS = {"per_step": ["train.weight_copy=per_step"],
                "v152k": ["model.vocab_size=151936", "model.loss_chunk_rows=auto"]}
E2E_EXTRA_RUNS = [("configs/m6-gpu-2b.yaml", 32, 1, "per_step"), ("configs/m6-gpu-finegrained.yaml", 16, 4, "per_step"),
                  ("configs/m6-gpu-2b.yaml", 8, 1, "v152k"), ("configs/m6-gpu-finegrained.yaml", 16, 4, "v152k")]
E2E_EXTRA_PEERS = [(16, 4, "v152k")]
E2E_TIMEOUT_S = 240


def _child(cmd: list[str], log: Path) -> str | None:
    """Run one measuring process; None when it succeeded, else the error to report."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=E2E_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        log.write_text(f"{e.stdout or ''}{e.stderr or ''}")
        return f"timed out after {E2E_TIMEOUT_S} s"
    log.write_text(proc.stdout + proc.stderr)
    return None if proc.returncode == 0 else f"exited {proc.returncode}: {proc.stderr[-1500:]}"


def e2e_tag(config: str, micro: int, accum: int, variant: str = "", peer: bool = False) -> str:
    """A train_e2e row's name: ``[hf-]<config stem>-mb<micro>x<accumulation>[-<variant>]``."""
    return f"{'hf-' if peer else ''}{Path(config).stem}-mb{micro}x{accum}{'-' + variant if variant else ''}"


def e2e_run(args, out: Path, config: str, micro: int, accum: int, variant: str = "") -> dict:
    """Throughput (the Trainer's own metrics, median of the timed steps), then a step breakdown by
    category and the host syncs per step, in one process per run."""
    tag = e2e_tag(config, micro, accum, variant)
    batch = [] if args.smoke else [f"train.micro_batch_size={micro}", f"train.global_batch_size={micro * accum}"]
    cmd = [sys.executable, "-m", "bench.step_breakdown", "--config", config, "--out", str(out / tag),
           "--timed-steps", str(2 if args.smoke else 8), "--host-syncs", *train_overrides(args, out), *batch,
           *E2E_VARIANTS.get(variant, [])]
    error = _child(cmd, out / f"{tag}.log")
    if error:
        return {"run": tag, "error": error}
    return {"run": tag, "command": " ".join(cmd[1:]), **json.loads((out / tag / "step_breakdown.json").read_text())}


def e2e_peer(args, out: Path, config: str, micro: int, accum: int, variant: str = "") -> dict:
    tag = e2e_tag(config, micro, accum, variant, peer=True)
    small = ["model.d_model=32", "model.num_heads=2", "model.num_layers=2", "model.moe.num_experts=4",
             "model.moe.top_k=2", "model.moe.ffn_dim=32", "data.seq_len=64", "model.max_text_len=64"] if args.smoke else []
    cmd = [sys.executable, "-m", "bench.hf_peer", "--config", config, "--micro-batch", str(2 if args.smoke else micro),
           "--accumulation", str(accum), "--device", args.device, "--out", str(out / f"{tag}.json"), *small,
           *[o for o in E2E_VARIANTS.get(variant, []) if o.startswith("model.vocab_size")]]
    error = _child(cmd, out / f"{tag}.log")
    if error:
        return {"run": tag, "error": error}
    return {"run": tag, "command": " ".join(cmd[1:]), **json.loads((out / f"{tag}.json").read_text())}


def part_train_e2e(args, device: torch.device, out: Path) -> tuple[dict, list[str]]:
    """Issue #45's table in one call: m6-gpu-2b and the fine-grained config at several tokens per
    step (each with its step breakdown), and the HF Qwen3-MoE peer of the fine-grained shapes."""
    from bench.step_breakdown import host_sync_markdown, markdown as breakdown_markdown

    asked = [w for w in args.only.split(",") if w]
    wanted = lambda tag: not asked or any(w in tag for w in asked)  # noqa: E731
    # The variants run only when asked for; --smoke without --only runs the first row alone.
    rows = E2E_RUNS[:1] if args.smoke and not asked else E2E_RUNS + (E2E_EXTRA_RUNS if asked else [])
    runs = [e2e_run(args, out, c, m, a, v) for c, m, a, v in rows if wanted(e2e_tag(c, m, a, v))]
    peer_config, peer_shapes = E2E_PEER
    peer_rows = peer_shapes[:1] if args.smoke and not asked else peer_shapes + (E2E_EXTRA_PEERS if asked else [])
    peers = [] if importlib.util.find_spec("transformers") is None else \
        [e2e_peer(args, out, peer_config, m, a, v) for m, a, v in peer_rows
         if wanted(e2e_tag(peer_config, m, a, v, peer=True))]
    md = ["| run | tokens / step | tokens/s | MFU | peak GB | loss first -> last |", "|---|---|---|---|---|---|"]
    for r in runs + peers:
        if "error" in r:
            md.append(f"| {r['run']} | error: {r['error'][-300:]!r} | | | | |")
            continue
        tps = r.get("tokens_per_s_median", r.get("tokens_per_s"))
        mfu, first = r.get("mfu_median"), r.get("loss_first")
        md.append(f"| {r['run']} | {r.get('tokens_per_step')} | {tps:,.0f} | {'-' if mfu is None else f'{mfu:.1%}'} | "
                  f"{r.get('peak_mem_gb_max', r.get('peak_mem_gb', float('nan'))):.1f} | "
                  f"{'' if first is None else f'{first:.3f} -> '}{r['loss_last']:.3f} |")
    for r in runs:
        if "error" not in r:
            md += ["", *breakdown_markdown(r["run"], r)]
            if "host_syncs" in r:
                md += host_sync_markdown(r["host_syncs"])
    return {"runs": runs, "peers": peers}, md


# ---------------------------------------------------------------------------------------------
# (f) memory features on the device: bytes per parameter and time vs plain
MEMORY_VARIANTS = {
    "plain (bf16 autocast)": ["train.precision=bf16-autocast"],
    "cast-on-use (bf16)": ["train.precision=bf16"],
    "offload=optimizer": ["train.precision=bf16", "memory.offload=optimizer"],
    "offload=optimizer+params": ["train.precision=bf16", "memory.offload=optimizer+params"],
}
README_DEVICE_BYTES_PER_PARAM = {"offload=optimizer": 4.50, "offload=optimizer+params": 1.86, "plain (bf16 autocast)": 16.0}


def part_memory(args, device: torch.device, out: Path) -> tuple[dict, list[str]]:
    from bench.memory import COMMON, MODEL, ModelStateBytes
    from m6.config import load
    from m6.train.loop import Trainer

    model = MODEL["quick" if args.smoke else "cuda"]
    steps = 2 if args.smoke else 6
    rows = {}
    for name, extra in MEMORY_VARIANTS.items():
        gc.collect()  # the previous variant's trainer (reference cycles): its tensors must not count here
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            row_base = torch.cuda.memory_allocated(device)
        overrides = [*COMMON, *model, f"train.device={device.type}", f"run.dir={out / 'memory_runs' / name.split()[0]}",
                     *extra]
        trainer = Trainer(load("configs/tiny.yaml", overrides))
        states = ModelStateBytes(trainer)
        num_params = sum(p.numel() for p in states.params)
        trainer.train_step()  # warm-up: optimizer state and offload buffers exist after it
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        times = [trainer.train_step()["step_time_s"] for _ in range(steps)]
        row = {"num_params": num_params, "step_time_s_median": statistics.median(times)}
        if device.type == "cuda":  # the allocator's figures over the timed steps, hooks off
            row["allocated_before_build_bytes"] = row_base  # 0 when nothing of an earlier variant is left
            row["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device) - row_base
            row["memory_allocated_after_step_bytes"] = torch.cuda.memory_allocated(device) - row_base
            row["allocated_after_step_bytes_per_param"] = row["memory_allocated_after_step_bytes"] / num_params
            row["peak_bytes_per_param"] = row["max_memory_allocated_bytes"] / num_params
        # Breakdown (bench.memory's counters): model-state bytes where a GPU run keeps them, sampled
        # inside every block's forward and around every gradient's accumulation in one more step.
        handles = states.watch()
        trainer.train_step()
        for h in handles:
            h.remove()
        sample = states.sample()
        row["model_state_bytes_after_step"] = sample
        row["model_state_device_side_peak_bytes_per_param"] = states.peak_device_side / num_params
        row["model_state_device_side_after_step_bytes_per_param"] = sample["device_side"] / num_params
        rows[name] = row
        del trainer, states
    plain = rows["plain (bf16 autocast)"]["step_time_s_median"]
    md = ["| variant | params | model states on device, peak B/param (counters) | allocator: after step / peak B/param | "
          "docs/memory.md (CPU-derived, device side) | step s | vs plain |", "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        r["time_vs_plain"] = r["step_time_s_median"] / plain
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        md.append(f"| {name} | {r['num_params']:,} | {fmt(r['model_state_device_side_peak_bytes_per_param'])} | "
                  f"{fmt(r.get('allocated_after_step_bytes_per_param'))} / {fmt(r.get('peak_bytes_per_param'))} | "
                  f"{README_DEVICE_BYTES_PER_PARAM.get(name, '-')} | "
                  f"{r['step_time_s_median']:.3f} | {r['time_vs_plain']:.2f} |")
    return {"model": model, "steps": steps, "variants": rows}, md


# ---------------------------------------------------------------------------------------------
# (g) offload layouts: m6's offload (all blocks, half of them) and FSDP2's CPU offload under
# parallel.shard, one rank over NCCL: device peak and host states against the memory estimate
OFFLOAD_LAYOUTS = {
    "cast-on-use (bf16)": [],
    "offload=optimizer+params": ["memory.offload=optimizer+params"],
    "offload=optimizer+params, first half of the blocks": ["memory.offload=optimizer+params", "HALF_THE_BLOCKS"],
    "offload=optimizer+params, 16-bit host gradients": ["memory.offload=optimizer+params",
                                                        "memory.host_grad_dtype=compute"],
    "shard=full": ["parallel.shard=full"],
    "shard=full + offload": ["parallel.shard=full", "memory.offload=optimizer+params"],
    "shard=optimizer + offload": ["parallel.shard=optimizer", "memory.offload=optimizer+params"],
    "shard=full + offload, DeepSpeed CPU Adam": ["parallel.shard=full", "memory.offload=optimizer+params",
                                                 "memory.host_optimizer=deepspeed"],
}


def phase_peaks(trainer, device: torch.device) -> dict:
    """One more step with the allocator's peak read at each phase's end: forward (the model's
    forward hook), backward and clip (the optimizer's step pre-hook, where the optimizer has one),
    update (after the step). Each peak is over its phase alone; bytes, including what the step
    started with (``start``)."""
    marks: dict[str, int] = {}

    def forward_start(module, args):
        if "start" not in marks:
            torch.cuda.synchronize(device)
            marks["start"] = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)

    def forward_end(module, args, output):
        torch.cuda.synchronize(device)
        marks["forward_peak"] = torch.cuda.max_memory_allocated(device)
        marks["after_forward"] = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)

    def update_start(optimizer, args, kwargs):
        torch.cuda.synchronize(device)
        marks["backward_peak"] = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)

    handles = [trainer.model.register_forward_pre_hook(forward_start),
               trainer.model.register_forward_hook(forward_end)]
    optimizer = trainer.update.optimizer
    if hasattr(optimizer, "register_step_pre_hook"):
        handles.append(optimizer.register_step_pre_hook(update_start))
    try:
        trainer.train_step()
    finally:
        for h in handles:
            h.remove()
    torch.cuda.synchronize(device)
    marks["backward_peak" if "backward_peak" not in marks else "update_peak"] = torch.cuda.max_memory_allocated(device)
    return marks


def host_state_bytes(trainer) -> int:
    """Bytes of the model states a step leaves on the host: m6's offload masters and gradient
    buffers, or the FSDP2 shards on the host; plus the optimizer state held there."""
    from m6.parallel.fsdp import local_part

    tensors = []
    off = trainer.update.offload
    if off is not None:
        params = list(trainer.model.parameters())
        tensors += off.masters_of(params) + list(off._grad_buffers.values())
    else:
        tensors += [local_part(p) for p in trainer.model.parameters()]
    tensors += [local_part(t) for st in trainer.update.optimizer.state.values() for t in st.values()
                if torch.is_tensor(t) and t.dim() > 0]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.device.type == "cpu"}
    return sum(storages.values())


def part_offload_layouts(args, device: torch.device, out: Path) -> tuple[dict, list[str]]:
    from bench.memory import COMMON, MODEL
    from m6.config import load
    from m6.plan.memory import RankMemory
    from m6.train.loop import Trainer

    cuda = device.type == "cuda"
    # One rank of a torchrun-style job: parallel.shard needs torch.distributed.
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    model = MODEL["quick" if args.smoke else "cuda"]
    steps = 2 if args.smoke else 4
    # On a CPU (--smoke only) FSDP2's CPU offload is a config error: those layouts are left out.
    # DeepSpeed's layout only where DeepSpeed is installed (the GPU machine: wheels from bench/gpu_wheels.sh).
    layouts = {k: v for k, v in OFFLOAD_LAYOUTS.items() if cuda or not (k.startswith("shard") and "offload" in k)}
    if importlib.util.find_spec("deepspeed") is None:
        layouts = {k: v for k, v in layouts.items() if "DeepSpeed" not in k}
    rows = {}
    for name, extra in layouts.items():
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device) if cuda else 0
        layers = load("configs/tiny.yaml", [*COMMON, *model]).model.num_layers
        extra = [f"memory.offload_blocks={list(range(layers // 2))}" if e == "HALF_THE_BLOCKS" else e for e in extra]
        overrides = [*COMMON, *model, "train.precision=bf16", f"train.device={device.type}",
                     f"run.dir={out / 'offload_runs' / str(len(rows))}", *extra]
        cfg = load("configs/tiny.yaml", overrides)
        trainer = Trainer(cfg)
        trainer.train_step()  # warm-up: optimizer state exists after it
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        times, losses = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            losses.append(trainer.train_step()["loss"])
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        peak, after = (torch.cuda.max_memory_allocated(device) - base, torch.cuda.memory_allocated(device) - base) \
            if cuda else (None, None)
        phases = {k: v - base for k, v in phase_peaks(trainer, device).items()} if cuda else None
        report = RankMemory(cfg, 1, 1, device.type).report(cfg)
        planned_host = sum(report.host.get(k, 0.0) for k in ("params", "optimizer state"))
        if cfg.memory.offload != "none" and cfg.parallel.shard == "none":
            planned_host += report.host.get("grads", 0.0)  # m6's offload keeps its host gradient buffers
        rows[name] = {"overrides": extra, "step_s_median": statistics.median(times), "step_s": times, "losses": losses,
                      "device_peak_bytes": peak, "device_after_step_bytes": after, "phase_bytes": phases,
                      "planned_device_parts": report.device,
                      "planned_peak_device_bytes": report.peak_device, "host_state_bytes": host_state_bytes(trainer),
                      "planned_host_state_bytes": planned_host,
                      "num_params": sum(p.numel() for p in trainer.model.parameters())}
        del trainer
    plain = rows["cast-on-use (bf16)"]["step_s_median"]
    gib = 2.0 ** 30
    fmt = lambda v: "-" if v is None else f"{v / gib:.3f}"  # noqa: E731
    md = [f"bench/memory's {'quick' if args.smoke else 'CUDA'} model "
          f"({next(iter(rows.values()))['num_params'] / 1e9:.3f} B params), bf16, one rank over "
          f"{'NCCL' if cuda else 'gloo'}; {steps} timed steps after one warm-up; planned = m6.plan.memory.RankMemory "
          "(m6.memory.estimate)", "",
          "| layout | device peak GiB: measured / planned (ratio) | device after step GiB | host states GiB: measured / "
          "planned | step s | vs plain |", "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        r["peak_ratio"] = None if r["device_peak_bytes"] is None else r["device_peak_bytes"] / r["planned_peak_device_bytes"]
        ratio = "-" if r["peak_ratio"] is None else f"{r['peak_ratio']:.3f}"
        md.append(f"| {name} | {fmt(r['device_peak_bytes'])} / {fmt(r['planned_peak_device_bytes'])} ({ratio}) | "
                  f"{fmt(r['device_after_step_bytes'])} | {fmt(r['host_state_bytes'])} / "
                  f"{fmt(r['planned_host_state_bytes'])} | {r['step_s_median']:.3f} | {r['step_s_median'] / plain:.2f} |")
    if cuda:
        md += ["", "Device bytes by phase, one more step (GiB; each peak over its phase alone; planned parts from the "
               "estimate's device table):", "",
               "| layout | step start | forward peak | after forward | backward peak | update peak | planned parts |",
               "|---|---|---|---|---|---|---|"]
        for name, r in rows.items():
            ph = r["phase_bytes"]
            parts = ", ".join(f"{k} {v / gib:.3f}" for k, v in r["planned_device_parts"].items() if v)
            md.append(f"| {name} | {fmt(ph.get('start'))} | {fmt(ph.get('forward_peak'))} | {fmt(ph.get('after_forward'))} "
                      f"| {fmt(ph.get('backward_peak'))} | {fmt(ph.get('update_peak'))} | {parts} |")
    ds, ref = rows.get("shard=full + offload, DeepSpeed CPU Adam"), rows.get("shard=full + offload")
    if ds and ref:
        gap = max(abs(a - b) for a, b in zip(ds["losses"], ref["losses"]))
        md += ["", f"DeepSpeed's CPU Adam vs torch's AdamW on FSDP2's host shards: losses over {steps} steps "
               f"{[round(v, 5) for v in ds['losses']]} vs {[round(v, 5) for v in ref['losses']]}, largest gap {gap:.2e}."]
    return {"model": model, "steps": steps, "layouts": rows}, md


# ---------------------------------------------------------------------------------------------
# (h) fp16 with loss scaling vs bf16: bench/fp16_curve on the device, tiny and base configs
FP16_RUNS = {
    "fp16_tiny": ["--config", "configs/tiny.yaml", "--steps", "300", "--batch", "32", "--warmup", "30",
                  "--override", "data.num_workers=2"],
    "fp16_base": ["--config", "configs/m6-base-moe.yaml", "--settings", "fp16,bf16,bf16-seed1", "--steps", "150",
                  "--batch", "32", "--micro-batch", "16", "--warmup", "20", "--override", "data.num_workers=2"],
}
FP16_SMOKE = ["--steps", "2", "--batch", "4", "--micro-batch", "2", "--override", "model.d_model=64",
              "--override", "model.num_heads=2", "--override", "model.ffn_dim=128", "--override", "model.num_layers=2",
              "--override", "data.seq_len=64", "--override", "model.image_size=32", "--override", "model.max_text_len=64"]


def _fp16_curve(part: str, args, device: torch.device, out: Path) -> tuple[dict, list[str]]:
    run = FP16_RUNS[part]
    if args.smoke:
        run = [a for a in run[:2]] + (["--settings", "fp16,bf16"] if part == "fp16_tiny" else run[2:4]) + FP16_SMOKE
    cmd = [sys.executable, "-m", "bench.fp16_curve", "--device", device.type, "--out", str(out / part), *run]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (out / f"{part}.log").write_text(proc.stdout + proc.stderr)
    results = sorted((out / part).glob("fp16_curve-*.json"))
    if not results:
        raise RuntimeError(f"bench.fp16_curve exited {proc.returncode} without a result: {proc.stderr[-2000:]}")
    result = json.loads(results[-1].read_text())
    md = results[-1].with_suffix(".md").read_text().splitlines()
    return {"returncode": proc.returncode, "command": result["command"], "steps_done": result["steps_done"],
            "windowed_loss": result["windowed_loss"], "mean_abs_windowed_diff_to_bf16": result["mean_abs_windowed_diff_to_bf16"],
            "rows": result["rows"]}, md


def part_fp16_tiny(args, device: torch.device, out: Path) -> tuple[dict, list[str]]:
    return _fp16_curve("fp16_tiny", args, device, out)


def part_fp16_base(args, device: torch.device, out: Path) -> tuple[dict, list[str]]:
    return _fp16_curve("fp16_base", args, device, out)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj if isinstance(obj, (int, float, str, bool, type(None))) else str(obj)


PARTS = {"tests": part_tests, "gemm_rate": part_gemm_rate,
         "moe_layer": part_moe_layer, "moe_kernels": part_moe_kernels, "train_e2e": part_train_e2e, "memory": part_memory,
         "offload_layouts": part_offload_layouts, "fp16_tiny": part_fp16_tiny, "fp16_base": part_fp16_base}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=list(PARTS))
    p.add_argument("--out", required=True)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--only", default="", help="train_e2e: only the runs whose tag contains one of these (comma-separated); "
                   "the variant rows (-per_step, -v152k) run only when named")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    result, md = PARTS[args.part](args, device, out)
    record = {"part": args.part, "device_info": device_info(device), "smoke": args.smoke,
              "wall_s": round(time.time() - t0, 1), "result": result, "markdown": md}
    (out / f"{args.part}.json").write_text(json.dumps(_jsonable(record), indent=2))
    print("\n".join(md))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
