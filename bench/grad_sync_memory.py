"""Gradient sync memory at world size 2: per-rank device-side bytes during backward, with and
without CPU offload.

    python -m bench.grad_sync_memory              # ~1.5 min on 2 CPU cores
    python -m bench.grad_sync_memory --quick      # tiny model: a harness check, not a measurement
    python -m bench.grad_sync_memory --label before --code "main 498bff5"   # on older code: *-before files

Two gloo processes (one thread each) build one m6 Trainer per variant in turn: memory.offload
none / optimizer / optimizer+params, each with the default bucket (parallel.bucket_size_mb=25) and
a small one (2), all at parallel.expert_parallel_size=1, so every parameter is all-reduced over
both ranks (the case in question: with EP = world size the experts are never bucketed and
stream one parameter at a time). Same seed and synthetic data everywhere; WARMUP steps, then
MEASURED instrumented steps (maxima reported). Figures per rank, from exact tensor-byte counters, not the process RSS:

- device-side state: the model's parameters and their gradients (where a GPU run keeps them: the
  same split as bench/memory's ModelStateBytes, host-side offload tensors excluded) plus the
  gradient sync's live bucket copies (the flat all-reduce buffers), sampled in every block's
  forward, before and after every gradient's accumulation (after the sync has handled it) and
  right before ``update.finish()``, i.e. at the end of backward;
- its peak during backward and its value at the end of backward, in bytes per parameter;
- the most bucket copies alive at once, and their bytes;
- step allocation peak: m6.memory.live_bytes.LiveBytes over the whole ``train_step``.

When ``<out>/grad_sync_memory-<machine>-before.json`` exists, the markdown compares with it.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.harness import machine_info, machine_tag, write_results
from bench.local_ranks import run_ranks
from bench.memory import COMMON, MODEL, ModelStateBytes
from m6.config import load
from m6.memory.live_bytes import LiveBytes
from m6.train.loop import Trainer

WORLD = 2
WARMUP = 2
MEASURED = 3  # instrumented steps: a completed all-reduce is drained at the next launch, so the
# figures vary with timing; the maxima over these steps are reported
OFFLOAD = ["none", "optimizer", "optimizer+params"]
BUCKET_MB = [25.0, 2.0]


class SyncStateBytes(ModelStateBytes):
    """Device-side params + grads (ModelStateBytes) plus the gradient sync's live bucket copies;
    peaks kept apart for the backward (from its first gradient to ``update.finish()``)."""

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer)
        self.sync = trainer.update.sync
        self.in_backward = False
        self.peak_backward = self.max_copies = self.max_copy_bytes = 0

    def _copies(self) -> list[torch.Tensor]:
        return [b.flat for b in self.sync.buckets if b.flat is not None]

    def _device_side(self) -> list[torch.Tensor]:
        return super()._device_side() + self._copies()

    def sample(self, incoming: torch.Tensor | None = None) -> dict:
        if incoming is not None:
            self.in_backward = True
        out = super().sample(incoming)
        copies = self._copies()
        out["bucket_copies"] = len(copies)
        out["bucket_copy_bytes"] = sum(c.untyped_storage().nbytes() for c in copies)
        if self.in_backward:
            self.peak_backward = max(self.peak_backward, out["device_side"])
            self.max_copies = max(self.max_copies, out["bucket_copies"])
            self.max_copy_bytes = max(self.max_copy_bytes, out["bucket_copy_bytes"])
        return out


def instrumented_step(tr: Trainer) -> dict:
    """One train_step with the counters attached; the trainer is left as it was."""
    states = SyncStateBytes(tr)
    rec: dict = {}
    real_finish = tr.update.finish

    def finish() -> None:
        rec["end_of_backward"] = states.sample()
        states.in_backward = False
        real_finish()
        rec["after_finish"] = states.sample()

    tr.update.finish = finish  # instance attribute: the class's method is back after `del`
    handles = states.watch()
    try:
        with LiveBytes() as live:
            metrics = tr.train_step()
    finally:
        for h in handles:
            h.remove()
        del tr.update.finish
    rec.update(peak_backward_device_side=states.peak_backward, max_bucket_copies=states.max_copies,
               max_bucket_copy_bytes=states.max_copy_bytes, step_alloc_peak_bytes=live.peak, loss=metrics["loss"])
    return rec


def measure(model: list[str], rank: int, world: int, root: str) -> dict:
    rows = {}
    for mb in BUCKET_MB:
        for mode in OFFLOAD:
            name = f"offload={mode} bucket={mb:g}MB"
            cfg = load("configs/tiny.yaml", [*COMMON, *model, "train.device=cpu", f"run.dir={root}/{mode}-{mb:g}",
                                             "parallel.expert_parallel_size=1", f"parallel.bucket_size_mb={mb}",
                                             f"memory.offload={mode}"])
            tr = Trainer(cfg)
            num_params = sum(p.numel() for p in tr.model.parameters() if p.requires_grad)
            losses = [tr.train_step()["loss"] for _ in range(WARMUP)]
            steps = [instrumented_step(tr) for _ in range(MEASURED)]
            rows[name] = {"offload": mode, "bucket_size_mb": mb, "num_params": num_params,
                          "num_buckets": sum(b.group_size > 1 for b in tr.update.sync.buckets),
                          "bucket_bytes": [sum(p.numel() * p.element_size() for p in b.params)
                                           for b in tr.update.sync.buckets if b.group_size > 1],
                          "max_in_flight": getattr(tr.update.sync, "max_in_flight", None),
                          "losses": [*losses, *(r["loss"] for r in steps)],
                          **{k: max(r[k] for r in steps) for k in ("peak_backward_device_side", "max_bucket_copies",
                                                                   "max_bucket_copy_bytes", "step_alloc_peak_bytes")},
                          "end_of_backward_device_side": max(r["end_of_backward"]["device_side"] for r in steps),
                          "after_finish_device_side": max(r["after_finish"]["device_side"] for r in steps),
                          "per_step": steps}
            del tr
            if rank == 0:
                print(f"{name}: measured", file=sys.stderr, flush=True)
    return rows


def code_version() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout
        return head.strip() + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def run(args) -> dict:
    model = MODEL["quick" if args.quick else "full"]
    per_rank = run_ranks(functools.partial(measure, model), WORLD, "m6-bench-grad-sync-")
    return {"model_overrides": model, "common_overrides": COMMON, "world_size": WORLD, "warmup_steps": WARMUP,
            "measured_steps": MEASURED, "ranks": per_rank}


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def _table(result: dict) -> list[str]:
    lines = ["| variant | buckets (max in flight) | peak device-side B/param in backward | at end of backward | "
             "live bucket copies: most at once (MiB) | after finish() | step alloc peak MiB | losses |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in result["ranks"][0].items():
        n = r["num_params"]
        peaks = " / ".join(f"{rk[name]['peak_backward_device_side'] / n:.2f}" for rk in result["ranks"])
        ends = " / ".join(f"{rk[name]['end_of_backward_device_side'] / n:.2f}" for rk in result["ranks"])
        after = " / ".join(f"{rk[name]['after_finish_device_side'] / n:.2f}" for rk in result["ranks"])
        copies = " / ".join(f"{rk[name]['max_bucket_copies']} ({_mib(rk[name]['max_bucket_copy_bytes'])})"
                            for rk in result["ranks"])
        alloc = " / ".join(_mib(rk[name]["step_alloc_peak_bytes"]) for rk in result["ranks"])
        lines.append(f"| {name} | {r['num_buckets']} ({r['max_in_flight'] or 'all'}) | {peaks} | {ends} | {copies} | "
                     f"{after} | {alloc} | {', '.join(f'{x:.6f}' for x in r['losses'])} |")
    return lines


def render(result: dict, before: dict | None) -> str:
    m = result["machine"]
    r0 = next(iter(result["ranks"][0].values()))
    lines = [
        f"# Gradient sync memory at world size {result['world_size']} ({result['device']}, fp32)", "",
        f"Command: `{result['command']}`; code {result['code']}.  ",
        f"Machine: {m['cpu_model']}, {m['cpu_count']} CPUs, torch {m['torch']}, {result['world_size']} gloo "
        f"processes with 1 thread each; total wall {result['wall_s']} s.  ",
        f"Model: configs/tiny.yaml with `{' '.join(result['model_overrides'])}` ({r0['num_params'] / 1e6:.2f} M "
        f"params, every one on each rank: parallel.expert_parallel_size=1, so all of them are all-reduced), "
        f"synthetic data, fp32; {result['warmup_steps']} steps, then {result['measured_steps']} instrumented steps "
        "(the same batches in every variant; maxima over them: a completed all-reduce is drained at the next "
        "launch, so the figures vary with timing).  ",
        "Per rank (rank 0 / rank 1): *device-side* = parameters + their gradients where a GPU run keeps them "
        "(host-side offload masters, gradient buffers and moments excluded) + the gradient sync's live bucket "
        "copies; peak over samples from the first gradient of the backward to `update.finish()` (taken before "
        "and after every gradient's accumulation), and the value right before `finish()`; *step alloc peak* = "
        "LiveBytes over the whole train_step (activations included). On this CPU machine device == host: the "
        "split says where a GPU run would keep the bytes.", "",
        *_table(result),
    ]
    if before is not None:
        lines += ["", f"## Before: code {before['code']} (`{before['command']}`)", "", *_table(before), "",
                  "## Before -> after (the larger rank)", "",
                  "| variant | peak device-side B/param in backward | at end of backward | live bucket copies "
                  "(most at once) | losses bitwise equal |", "|---|---|---|---|---|"]
        for name, r in result["ranks"][0].items():
            if name not in before["ranks"][0]:
                continue
            n = r["num_params"]

            def worst(res: dict, key: str) -> float:
                return max(rk[name][key] for rk in res["ranks"])
            same = all(b[name]["losses"] == a[name]["losses"] for b, a in zip(before["ranks"], result["ranks"]))
            lines.append(
                f"| {name} | {worst(before, 'peak_backward_device_side') / n:.2f} -> "
                f"{worst(result, 'peak_backward_device_side') / n:.2f} | "
                f"{worst(before, 'end_of_backward_device_side') / n:.2f} -> "
                f"{worst(result, 'end_of_backward_device_side') / n:.2f} | {worst(before, 'max_bucket_copies')} -> "
                f"{worst(result, 'max_bucket_copies')} | {same} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model: a harness check, not a measurement")
    p.add_argument("--label", default="", help="suffix of the result files (e.g. 'before')")
    p.add_argument("--code", default=None, help="what code this measures (default: the git commit)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    started = time.time()
    device = torch.device("cpu")
    command = "python -m bench.grad_sync_memory" + (" --quick" if args.quick else "") + \
        (f" --label {args.label}" if args.label else "")
    result = {"benchmark": "grad_sync_memory", "command": command, "code": args.code or code_version(),
              "device": device.type, "machine": machine_info(device), **run(args)}
    result["wall_s"] = round(time.time() - started, 1)
    stem = f"grad_sync_memory-{machine_tag(device)}" + ("-quick" if args.quick else "")
    before_path = Path(args.out) / f"{stem}-before.json"
    before = json.loads(before_path.read_text()) if not args.label and before_path.exists() else None
    write_results(args.out, stem + (f"-{args.label}" if args.label else ""), result, render(result, before))


if __name__ == "__main__":
    main()
