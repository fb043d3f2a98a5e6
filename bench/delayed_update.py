"""The delayed parameter update (optim.delayed_update) against the synchronous offloaded update: the
loss curves of 2 seeds each, with the seed-to-seed noise to judge the difference by.

    python -m bench.delayed_update                  # 300 steps of a tiny model (MODEL below), 4 runs
    python -m bench.delayed_update --steps 40       # a harness check, not a measurement

Four trainers of a tiny MoE model on the built-in synthetic task (MODEL), memory.offload=optimizer,
torch's AdamW on the host, fp32: synchronous and delayed (optim.delayed_update_after at its
default unless --after), seeds 0 and 1 (other initialisation and data order). They step
round-robin in one process (one step each per round, so a slow stretch of the shared machine hits
all alike; a delayed trainer's background update runs on while the others step, which changes
nothing in its numbers). Reported per run: the loss of every step, the mean loss over all steps,
the final loss (mean of the last 10 steps, and the last step's), the mean over windows of 10 steps;
the delayed-vs-synchronous difference of the same seed against the synchronous seed-to-seed
difference (the noise). Results: bench/results/delayed_update-<machine>.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.grad_sync_memory import code_version
from bench.harness import machine_info, machine_tag
from m6.config import OptimConfig, load
from m6.train.loop import Trainer

MODEL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.moe.every=2",
         "model.moe.num_experts=4", "model.image_size=16", "data.kind=synthetic", "data.num_samples=4096",
         "data.seq_len=48", "model.max_text_len=48", "optim.warmup_steps=30"]
LR = 3e-3  # the peak learning rate (configs/tiny.yaml's); optim.min_lr is a tenth of it
WINDOW = 10
FINAL = 10  # the final loss: the mean of the last FINAL steps (one step's loss is mostly its batch)


def settings(after: int) -> dict[str, list[str]]:
    delayed = ["optim.delayed_update=true", f"optim.delayed_update_after={after}"]
    return {"sync-seed0": ["run.seed=0"], "sync-seed1": ["run.seed=1"],
            "delayed-seed0": ["run.seed=0", *delayed], "delayed-seed1": ["run.seed=1", *delayed]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="a YAML config under MODEL's overrides (default: none)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--after", type=int, default=OptimConfig.delayed_update_after, help="optim.delayed_update_after")
    ap.add_argument("--lr", type=float, default=LR, help="optim.lr (optim.min_lr: a tenth); other than the default, "
                    "the results' names end in -lr<value>")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    common = ["train.device=cpu", "train.precision=fp32", "data.num_workers=0", "checkpoint.every=0",
              "checkpoint.enabled=false", "checkpoint.resume=none", "train.eval_every=0", "logging.console=false",
              f"train.max_steps={args.steps}", f"train.global_batch_size={args.batch}", "memory.offload=optimizer",
              "memory.host_optimizer=torch", *MODEL, f"optim.lr={args.lr}", f"optim.min_lr={args.lr / 10}"]
    runs = settings(args.after)
    args.commit = code_version()  # the code this process runs (HEAD may move while it does)
    trainers, rows = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in runs.items():
            with contextlib.redirect_stdout(io.StringIO()):
                trainers[name] = Trainer(load(args.config, [*common, *extra, f"run.dir={tmp}/{name}"]))
            rows[name] = []
        for step in range(args.steps):
            for name, tr in trainers.items():
                wall, cpu = time.perf_counter(), time.process_time()
                m = tr.train_step()
                rows[name].append({"step": step + 1, "loss": m["loss"], "grad_norm": m["grad_norm"], "lr": m["lr"],
                                   "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu})
            print(f"step {step + 1}: " + ", ".join(f"{n} {rows[n][-1]['loss']:.4f}" for n in rows), flush=True)
            if (step + 1) % 50 == 0 or step + 1 == args.steps:
                write(rows, args, common, runs)  # a stopped run leaves its steps so far
        for tr in trainers.values():
            tr.update.wait()


def lr_tag(lr: float) -> str:
    """1e-3 -> '1e-3' (no dot in a file name)."""
    mantissa, exponent = f"{lr:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def summary(losses: list[float]) -> dict:
    return {"mean": statistics.fmean(losses), "final": statistics.fmean(losses[-FINAL:]), "last": losses[-1],
            "windowed": [statistics.fmean(losses[i:i + WINDOW]) for i in range(0, len(losses), WINDOW)]}


def write(rows: dict[str, list[dict]], args: argparse.Namespace, common: list[str], runs: dict) -> None:
    done = len(rows["sync-seed0"])
    s = {n: summary([r["loss"] for r in rs]) for n, rs in rows.items()}
    noise = {k: abs(s["sync-seed0"][k] - s["sync-seed1"][k]) for k in ("mean", "final")}
    noise_delayed = {k: abs(s["delayed-seed0"][k] - s["delayed-seed1"][k]) for k in ("mean", "final")}
    diff = {seed: {k: s[f"delayed-{seed}"][k] - s[f"sync-{seed}"][k] for k in ("mean", "final")}
            for seed in ("seed0", "seed1")}
    within = {k: all(abs(diff[seed][k]) <= noise[k] for seed in diff) for k in ("mean", "final")}
    window_diff = {seed: statistics.fmean(abs(a - b) for a, b in zip(s[f"delayed-{seed}"]["windowed"],
                                                                      s[f"sync-{seed}"]["windowed"]))
                   for seed in ("seed0", "seed1")}
    window_noise = statistics.fmean(abs(a - b) for a, b in zip(s["sync-seed0"]["windowed"], s["sync-seed1"]["windowed"]))
    command = (f"python -m bench.delayed_update{f' --config {args.config}' if args.config else ''} --steps {args.steps} "
               f"--batch {args.batch} --after {args.after}" + (f" --lr {args.lr:g}" if args.lr != LR else ""))
    device = torch.device("cpu")
    machine = machine_info(device)
    result = {"command": command, "commit": args.commit, "steps_done": done, "overrides": common, "runs": runs,
              "machine": machine, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "summary": s, "noise_sync": noise, "noise_delayed": noise_delayed, "delayed_minus_sync": diff,
              "within_noise": within, "mean_abs_windowed_diff": window_diff, "windowed_noise_sync": window_noise,
              "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (f"delayed_update-{machine_tag(device)}" + (f"-lr{lr_tag(args.lr)}" if args.lr != LR else ""))
    stem.with_name(stem.name + ".json").write_text(json.dumps(result, indent=1))
    lines = [
        "# Delayed parameter update vs synchronous offloaded update, loss curves on CPU", "",
        f"Command: `{command}` at commit {result['commit']} ({done} of {args.steps} steps done; model overrides "
        f"{' '.join(MODEL)}; peak lr {args.lr:g}; batch {args.batch}, fp32, memory.offload=optimizer, torch's AdamW on the host, "
        f"delayed from step {args.after + 1}) on CPU (torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"OMP_PROC_BIND={os.environ.get('OMP_PROC_BIND')}); machine: {machine['cpu_model']}, {os.cpu_count()} cores, "
        "shared with other jobs.", "",
        f"| run | mean loss (steps 1-{done}) | final loss (mean of the last {FINAL}) | last step's loss | "
        "median step wall / CPU s |", "|---|---|---|---|---|"]
    for n, rs in rows.items():
        lines.append(f"| {n} | {s[n]['mean']:.4f} | {s[n]['final']:.4f} | {s[n]['last']:.4f} | "
                     f"{statistics.median(r['wall_s'] for r in rs):.3f} / {statistics.median(r['cpu_s'] for r in rs):.3f} |")
    lines += ["", "| | mean loss | final loss |", "|---|---|---|",
              f"| delayed - sync, seed 0 | {diff['seed0']['mean']:+.4f} | {diff['seed0']['final']:+.4f} |",
              f"| delayed - sync, seed 1 | {diff['seed1']['mean']:+.4f} | {diff['seed1']['final']:+.4f} |",
              f"| seed noise: abs(sync seed 0 - sync seed 1) | {noise['mean']:.4f} | {noise['final']:.4f} |",
              f"| abs(delayed seed 0 - delayed seed 1) | {noise_delayed['mean']:.4f} | {noise_delayed['final']:.4f} |",
              "", f"Within the seed noise (both seeds' |delayed - sync| <= |sync seed 0 - sync seed 1|): mean loss "
              f"{'yes' if within['mean'] else 'NO'}, final loss {'yes' if within['final'] else 'NO'}. Windowed curves "
              f"({WINDOW} steps), mean |delayed - sync|: seed 0 {window_diff['seed0']:.4f}, seed 1 "
              f"{window_diff['seed1']:.4f}; sync seed 0 vs seed 1: {window_noise:.4f}.", "",
              f"Mean loss over windows of {WINDOW} steps:", "",
              "| steps | " + " | ".join(rows) + " |", "|---|" + "---|" * len(rows)]
    for i in range(len(s["sync-seed0"]["windowed"])):
        lines.append(f"| {i * WINDOW + 1}-{min((i + 1) * WINDOW, done)} | "
                     + " | ".join(f"{s[n]['windowed'][i]:.4f}" for n in rows) + " |")
    lines += ["", "Step times: the four trainers share the same 2 cores, and a delayed trainer's host update runs "
              "on in the background while the next trainer steps, so these wall times say nothing about the "
              "overlap a GPU run gets; they are here to show the runs' cost on this machine."]
    stem.with_name(stem.name + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
