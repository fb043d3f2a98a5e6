"""Where one training step goes: device time (CUDA kernels) or host time (CPU ops) by category.

    python -m bench.step_breakdown --config configs/m6-gpu-finegrained.yaml --out DIR [overrides...]

The model's modules are labelled from outside (forward hooks open a profiler range per module:
attention, norms, the MoE router, the experts, the dense MLP, embeddings and head), the update's
phases are wrapped the same way (gradient handling: sync and clip; optimizer: the update). Each
kernel (CPU: each leaf op's self time) is charged to the innermost label above the op that
launched it; a backward op is charged to the label of the forward op that made it (autograd's
sequence number links the two). Casts (dtype copies) count as casts wherever they run. On CUDA,
"host gaps" is the step's wall time that no kernel covers.

Categories: attention, expert GEMMs, router and permutation, dense FFN, norms and elementwise,
embeddings/head/loss, casts, gradient handling, optimizer, data, other (and host gaps on CUDA).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
import warnings
from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

PREFIX = "m6::"
CATEGORIES = ("attention", "expert GEMMs", "router and permutation", "dense FFN", "norms and elementwise",
              "embeddings/head/loss", "casts", "gradient handling", "optimizer", "data", "other")
CAST_OPS = {"aten::_to_copy", "aten::to", "aten::copy_", "aten::_copy_from", "aten::_foreach_copy_"}


def module_labels(model: nn.Module) -> dict[nn.Module, str]:
    """The category of each labelled module (the innermost labelled module wins when ranges nest)."""
    from m6.model.block import DenseMLP, TransformerBlock
    from m6.moe import MoELayer

    labels: dict[nn.Module, str] = {model: "embeddings/head/loss"}
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            labels[module] = "norms and elementwise"  # residual adds, dropout
            labels[module.attn] = "attention"
            labels[module.attn_norm] = labels[module.ffn_norm] = "norms and elementwise"
        elif isinstance(module, MoELayer):
            labels[module] = "router and permutation"  # dispatch, combine, losses
            labels[module.experts] = "expert GEMMs"
        elif isinstance(module, DenseMLP):
            labels[module] = "dense FFN"
        elif isinstance(module, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))):
            labels[module] = "norms and elementwise"
    return labels


@contextmanager
def labelled(trainer) -> None:
    """Profiler ranges around every labelled module's forward, the loss, the update's phases and
    the loader's wait."""
    model, update, loader = trainer.model, trainer.update, trainer.loader
    handles, stack, patched = [], [], []
    for module, label in module_labels(model).items():
        def pre(mod, args, label=label):
            rf = record_function(PREFIX + label)
            rf.__enter__()
            stack.append(rf)

        def post(mod, args, output):
            stack.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    for owner, name, label in ((update, "finish", "gradient handling"), (update, "clip", "gradient handling"),
                               (update, "step", "optimizer"), (loader, "next_step", "data"),
                               (trainer, "forward_loss", "embeddings/head/loss")):
        original = getattr(owner, name)

        def wrapped(*args, _original=original, _label=label, **kwargs):
            with record_function(PREFIX + _label):
                return _original(*args, **kwargs)

        setattr(owner, name, wrapped)
        patched.append((owner, name))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for owner, name in patched:
            delattr(owner, name)  # back to the class's method


def _label_above(event) -> str | None:
    while event is not None:
        if event.name.startswith(PREFIX):
            return event.name[len(PREFIX):]
        if event.name.startswith("Optimizer.step"):
            return "optimizer"
        event = event.cpu_parent
    return None


def _in_backward(event) -> tuple[bool, int]:
    """Whether ``event`` runs inside autograd's engine, and the sequence number of its backward node."""
    seq, e = -1, event
    while e is not None:
        if seq < 0 and getattr(e, "sequence_nr", -1) >= 0 and "Backward" in e.name:
            seq = e.sequence_nr
        if e.name.startswith("autograd::engine::evaluate_function"):
            if "AccumulateGrad" in e.name:
                return True, -2
            return True, seq
        e = e.cpu_parent
    return False, -1


def classify(events, device_type: str, other: dict[str, float] | None = None) -> dict[str, float]:
    """Milliseconds per category: kernel durations on CUDA, leaf ops' self CPU time on the host.
    ``other`` (if given) collects the ops charged to "other", by name, to show what it holds."""
    forward_label: dict[int, str] = {}
    for e in events:
        if getattr(e, "sequence_nr", -1) >= 0 and "Backward" not in e.name and not _in_backward(e)[0]:
            label = _label_above(e)
            if label is not None:
                forward_label.setdefault(e.sequence_nr, label)
    totals: dict[str, float] = defaultdict(float)
    for e in events:
        if e.device_type.name != "CPU" or e.name.startswith(PREFIX):
            continue
        if device_type == "cuda":
            us = sum(k.duration for k in e.kernels)
        else:
            us = e.self_cpu_time_total
        if us <= 0:
            continue
        label = _label_above(e)
        backward, seq = _in_backward(e)
        if e.name in CAST_OPS and label != "optimizer":
            label = "casts"
        elif backward and label is None:
            label = "gradient handling" if seq == -2 else forward_label.get(seq, "other")
        totals[label or "other"] += us / 1e3
        if other is not None and (label or "other") == "other":
            key = f"{e.name} (backward node {seq})" if backward else e.name
            other[key] = other.get(key, 0.0) + us / 1e3
    return dict(totals)


def kernel_busy_ms(events) -> float:
    """Union of the device kernels' intervals (overlapping streams counted once)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type.name == "CUDA")
    busy, end = 0.0, -1.0
    for s, t in spans:
        if s > end:
            busy += t - s
            end = t
        elif t > end:
            busy += t - end
            end = t
    return busy / 1e3


def breakdown(trainer, steps: int = 2, trace: Path | None = None) -> dict:
    """Profile ``steps`` train steps of a warmed-up Trainer; ms per step by category."""
    device = trainer.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with labelled(trainer):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                trainer.train_step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wall_ms = (time.perf_counter() - t0) * 1e3
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    events = prof.events()
    other: dict[str, float] = {}
    per_cat = {k: v / steps for k, v in classify(events, device.type, other).items()}
    result = {"device": device.type, "steps": steps, "wall_ms_per_step": wall_ms / steps,
              "ms_per_step": {c: round(per_cat.get(c, 0.0), 3) for c in CATEGORIES},
              "other_top_ops_ms": {k: round(v / steps, 3) for k, v in sorted(other.items(), key=lambda kv: -kv[1])[:10]}}
    if device.type == "cuda":
        busy = kernel_busy_ms(events) / steps
        result["kernel_busy_ms_per_step"] = round(busy, 3)
        result["ms_per_step"]["host gaps"] = round(max(result["wall_ms_per_step"] - busy, 0.0), 3)
    return result


def markdown(name: str, result: dict) -> list[str]:
    total = sum(result["ms_per_step"].values())
    rows = [f"| {name} | category | ms / step | share |", "|---|---|---|---|"]
    for cat, ms in sorted(result["ms_per_step"].items(), key=lambda kv: -kv[1]):
        if ms > 0:
            rows.append(f"| | {cat} | {ms:.2f} | {ms / max(total, 1e-9):.1%} |")
    rows.append(f"| | wall per step | {result['wall_ms_per_step']:.2f} | |")
    return rows


def innermost_m6_site(stack: list[traceback.FrameSummary]) -> str:
    """'m6/file.py:function' of the innermost m6 frame of a stack (the allow-list's key), else the
    innermost frame's own file:function."""
    root = Path(__file__).resolve().parents[1]
    for frame in reversed(stack):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(root / "m6"):
            return f"{path.relative_to(root).as_posix()}:{frame.name}"
    outside = [f for f in stack if Path(f.filename).name != "warnings.py" and f.filename != __file__]
    return f"{outside[-1].filename}:{outside[-1].name}" if outside else "?"


def count_host_syncs(fn: Callable[[], None]) -> Counter:
    """Syncs torch.cuda.set_sync_debug_mode('warn') reports while ``fn`` runs, by innermost m6 site.
    (A sync inside backward is reported when backward returns, at its caller.)"""
    sites: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            sites[innermost_m6_site(traceback.extract_stack()[:-1])] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


def allowed_host_syncs(moe_forwards: int, logging: bool, dropless_grouped: bool = False) -> dict[str, int]:
    """The documented allow-list's budget for one single-GPU, no-offload training step
    (tests/simcuda/host_sync_allow_list.py, docs/simulated-cuda.md). ``dropless_grouped``: the MoE
    layers are dropless (model.moe.capacity_factor null) and run grouped_mm or fused experts, so
    they make no host sync (DROPLESS_SINGLE_GPU_ALLOW_LIST); otherwise one per MoE layer forward."""
    allowed = {"m6/train/loop.py:train_step": 3, "m6/parallel/grad_sync.py:global_grad_norm": 1}
    if not dropless_grouped:
        allowed["m6/moe/dispatch.py:host_ints"] = moe_forwards
    if logging:
        allowed["m6/train/metrics.py:expert_load"] = 1
    return allowed


def host_sync_markdown(syncs: dict | None) -> list[str]:
    if syncs is None:
        return ["- host syncs: counted on CUDA only (torch.cuda.set_sync_debug_mode)"]
    lines = [f"- host syncs per step (torch.cuda.set_sync_debug_mode, {syncs['steps']} steps, "
             f"{syncs['moe_forwards_per_step']} MoE layer forwards per step): "
             f"{syncs['per_step_total']:.1f} measured vs {syncs['allowed_per_step_total']} allowed; "
             + ("within the allow-list" if not syncs["over_allow_list"] else f"OVER at {syncs['over_allow_list']}")]
    lines += [f"  - {site}: {n / syncs['steps']:.1f}/step (allowed {syncs['allowed_per_step'].get(site, 0)})"
              for site, n in sorted(syncs["sites"].items())]
    return lines


def host_syncs(trainer, steps: int = 2) -> dict:
    """Host syncs per step by m6 site (CUDA's sync debug mode), against the documented allow-list."""
    from m6.moe import MoELayer

    sites = count_host_syncs(lambda: [trainer.train_step() for _ in range(steps)])
    cfg = trainer.cfg
    layers = [m for m in trainer.model.modules() if isinstance(m, MoELayer)]
    moe_forwards = len(layers) * (cfg.train.global_batch_size // cfg.train.micro_batch_size)
    dropless_grouped = cfg.model.moe.capacity_factor is None and trainer.world_size == 1 and \
        all(m.experts.last_kernel in ("grouped_mm", "fused") for m in layers)
    allowed = allowed_host_syncs(moe_forwards, logging=cfg.logging.every == 1, dropless_grouped=dropless_grouped)
    over = {site: n / steps for site, n in sites.items() if n / steps > allowed.get(site, 0)}
    return {"steps": steps, "moe_forwards_per_step": moe_forwards, "sites": dict(sites),
            "per_step_total": sum(sites.values()) / steps, "allowed_per_step": allowed,
            "allowed_per_step_total": sum(allowed.values()), "over_allow_list": over}


def throughput(trainer, steps: int) -> dict:
    """Medians of the Trainer's own step metrics over ``steps`` unprofiled steps."""
    history = [trainer.train_step() for _ in range(steps)]
    med = lambda k: statistics.median(h[k] for h in history) if all(h.get(k) is not None for h in history) else None  # noqa: E731
    cfg = trainer.cfg
    return {"timed_steps": steps, "tokens_per_step": cfg.train.global_batch_size * cfg.data.seq_len,
            "tokens_per_s_median": med("tokens_per_s"), "mfu_median": med("mfu"), "tflops_median": med("tflops"),
            "step_time_s_median": med("step_time_s"), "peak_mem_gb_max": max(h["peak_mem_gb"] for h in history),
            "loss_first": history[0]["loss"], "loss_last": history[-1]["loss"]}


def run(config: str, overrides: list[str], out: Path, steps: int = 2, warmup: int = 2,
        count_syncs: bool = False, timed_steps: int = 0) -> dict:
    """Build the run's Trainer, warm up, time ``timed_steps`` steps (if any), then profile ``steps``."""
    from m6.config import load
    from m6.train.loop import Trainer

    cfg = load(config, [*overrides, "train.max_steps=1000", f"run.dir={out / 'breakdown_run'}"])
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    build_s = time.perf_counter() - t0
    try:
        for _ in range(warmup):
            trainer.train_step()
        timed = throughput(trainer, timed_steps) if timed_steps else {}
        result = {**timed, **breakdown(trainer, steps), "trainer_build_s": round(build_s, 1)}
        if count_syncs and trainer.device.type == "cuda":
            result["host_syncs"] = host_syncs(trainer)
    finally:
        # train_step alone never stops the data workers (fit does); they ignore SIGTERM, so the
        # interpreter's exit would wait on them forever.
        trainer.loader.close()
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--host-syncs", action="store_true", help="CUDA: also count host syncs per step by site")
    p.add_argument("--timed-steps", type=int, default=0, help="unprofiled steps timed before the profile")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = run(args.config, args.overrides, out, args.steps, count_syncs=args.host_syncs,
                 timed_steps=args.timed_steps)
    result.update(config=args.config, overrides=args.overrides)
    (out / "step_breakdown.json").write_text(json.dumps(result, indent=2))
    print("\n".join(markdown(Path(args.config).stem, result)))


if __name__ == "__main__":
    main()
