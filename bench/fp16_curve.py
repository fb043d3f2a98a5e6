"""fp16 with dynamic loss scaling against bf16 (and fp32) on one config: the loss curves side by
side, with the run-to-run noise to judge them by.

    python -m bench.fp16_curve                       # configs/tiny.yaml, 80 steps at global batch 8, ~10 CPU-min
    python -m bench.fp16_curve --steps 300 --batch 32  # the tiny config's own run length and batch
    python -m bench.fp16_curve --device cuda --steps 300 --batch 32 --warmup 30     # on a GPU
    python -m bench.fp16_curve --device cuda --config configs/m6-base-moe.yaml --settings fp16,bf16,bf16-seed1 \
        --steps 150 --batch 32 --micro-batch 16 --warmup 20

The trainers step round-robin in one process (each one step per round, so a slow stretch of the
shared machine hits all alike): fp16, bf16, fp32 (seed 0) and bf16 with seed 1, whose distance to
bf16 seed 0 is the noise (other initialisation and data order); ``--settings`` picks a subset
(bf16 always). Reported: the loss of every step, the mean loss over windows of 10 steps, the mean
absolute difference of those windowed curves to bf16 (seed 0), fp16's loss scale and overflow
skips, and per-step wall and CPU time. Results: bench/results/fp16_curve-<machine>[-<config>].*
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import machine_info, machine_tag, write_results
from m6.config import load
from m6.train.loop import Trainer

SETTINGS = {
    "fp16": ["train.precision=fp16"],
    "bf16": ["train.precision=bf16"],
    "fp32": ["train.precision=fp32"],
    "bf16-seed1": ["train.precision=bf16", "run.seed=1"],
}
WINDOW = 10


def windowed(losses: list[float]) -> list[float]:
    """Means over consecutive windows of WINDOW steps (the last one may be shorter)."""
    return [statistics.fmean(losses[i:i + WINDOW]) for i in range(0, len(losses), WINDOW)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated subset of {','.join(SETTINGS)}")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=None, help="train.micro_batch_size (default: the config's)")
    ap.add_argument("--warmup", type=int, default=10, help="optim.warmup_steps")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="more config overrides (repeatable), after the bench's own")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown or "bf16" not in names:
        ap.error(f"--settings: choose from {list(SETTINGS)}, bf16 included (got {names})")
    common = [f"train.device={args.device}", "data.num_workers=0", "checkpoint.every=0", "checkpoint.resume=none",
              "train.eval_every=0", "logging.console=false", f"train.max_steps={args.steps}",
              f"train.global_batch_size={args.batch}", f"optim.warmup_steps={args.warmup}"]
    if args.micro_batch is not None:
        common.append(f"train.micro_batch_size={args.micro_batch}")
    common += args.override
    trainers, rows = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            with contextlib.redirect_stdout(io.StringIO()):
                trainers[name] = Trainer(load(args.config, [*common, *SETTINGS[name], f"run.dir={tmp}/{name}"]))
            rows[name] = []
        device = trainers["bf16"].device
        for step in range(args.steps):
            for name, tr in trainers.items():
                wall, cpu = time.perf_counter(), time.process_time()
                m = tr.train_step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                rows[name].append({"step": step + 1, "loss": m["loss"], "lm_loss": m["lm_loss"],
                                   "grad_norm": m["grad_norm"], "loss_scale": m.get("loss_scale"),
                                   "overflow_steps": m.get("overflow_steps"), "skipped_steps": m["skipped_steps"],
                                   "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu})
            print(f"step {step + 1}: " + ", ".join(f"{n} {rows[n][-1]['loss']:.4f}" for n in rows), flush=True)
            if (step + 1) % WINDOW == 0 or step + 1 == args.steps:
                write(rows, args, common, device)  # after every window: a stopped run leaves its steps so far
        for tr in trainers.values():  # train_step never stops the data workers (fit does): exit would wait on them
            tr.loader.close()


def write(rows: dict[str, list[dict]], args: argparse.Namespace, common: list[str], device: torch.device) -> None:
    """bench/results/fp16_curve-<machine>[-<config>].json and .md for the steps run so far."""
    done = len(rows["bf16"])
    curves = {n: windowed([r["loss"] for r in rs]) for n, rs in rows.items()}
    diff = {n: statistics.fmean(abs(a - b) for a, b in zip(curves[n], curves["bf16"])) for n in curves if n != "bf16"}
    command = (f"python -m bench.fp16_curve --config {args.config} --device {args.device} --settings {args.settings} "
               f"--steps {args.steps} --batch {args.batch} --warmup {args.warmup}"
               + (f" --micro-batch {args.micro_batch}" if args.micro_batch is not None else "")
               + "".join(f" --override {o}" for o in args.override))
    machine = machine_info(device)
    if device.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(device)
        machine["cuda"] = torch.version.cuda
    result = {
        "command": command, "steps_done": done, "config": args.config, "overrides": common,
        "settings": {n: SETTINGS[n] for n in rows}, "machine": machine,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "window": WINDOW,
        "windowed_loss": curves, "mean_abs_windowed_diff_to_bf16": diff, "rows": rows,
    }
    config = Path(args.config).stem
    stem = f"fp16_curve-{machine_tag(device)}" + ("" if config == "tiny" else f"-{config}")
    where = (f"{machine['gpu']} (torch {torch.__version__}, CUDA {torch.version.cuda})" if device.type == "cuda" else
             f"CPU (torch {torch.__version__}, {torch.get_num_threads()} threads, OMP_PROC_BIND="
             f"{os.environ.get('OMP_PROC_BIND')}); machine: {machine['cpu_model']}, {os.cpu_count()} cores, shared with "
             "other jobs")
    lines = [f"# fp16 vs bf16 loss curve, {args.config} on {'CUDA' if device.type == 'cuda' else 'CPU'}", "",
             f"Command: `{command}` ({done} of {args.steps} steps done) on {where}.", "",
             f"Mean loss over windows of {WINDOW} steps:", "",
             "| steps | " + " | ".join(curves) + " |", "|---|" + "---|" * len(curves)]
    for i in range(len(curves["bf16"])):
        lines.append(f"| {i * WINDOW + 1}-{min((i + 1) * WINDOW, done)} | " + " | ".join(f"{curves[n][i]:.4f}" for n in curves) + " |")
    lines += ["", "Mean absolute difference of the windowed curves to bf16 (seed 0): "
              + ", ".join(f"{n} {d:.4f}" for n, d in diff.items())
              + (" (bf16-seed1: the run-to-run noise of another seed)." if "bf16-seed1" in diff else "."), ""]
    if "fp16" in rows:
        lines.append(f"fp16: loss scale {rows['fp16'][-1]['loss_scale']:g} after step {done}, overflow steps "
                     f"{rows['fp16'][-1]['overflow_steps']}.")
    lines.append("Median step wall/CPU s: " + ", ".join(
        f"{n} {statistics.median(r['wall_s'] for r in rs):.3f}/{statistics.median(r['cpu_s'] for r in rs):.3f}"
        for n, rs in rows.items()))
    write_results(args.out, stem, result, "\n".join(lines), command)


if __name__ == "__main__":
    main()
