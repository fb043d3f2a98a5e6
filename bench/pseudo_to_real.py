"""Pseudo-to-real (M6-10T) against the real model from scratch at the same step budget, on
configs/tiny.yaml with an MoE FFN in every block (so blocks pair up: model.share_layers=2).

    python -m bench.pseudo_to_real --steps 300 --delink 100  # ~6 min on 2 CPU cores
    python -m bench.pseudo_to_real --steps 4 --delink 2      # a harness check, not a measurement

Both runs see the same data in the same order and the same schedule. Reported: LM loss at equal
steps (mean over the last 20% of steps, and at the last step), the wall time (sum of the logged
step times, start-up excluded) to reach the real run's final LM loss (5-step running mean, so one
lucky batch does not decide it), and each run's total wall and CPU seconds. The machine is shared
with other jobs: the times say what this run saw, the losses do not depend on it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from bench.harness import machine_info, write_results
from m6.config import load
from m6.train.loop import train

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
WINDOW = 5


def rows_of(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = {r["step"]: r for r in rows if "lm_loss" in r}  # a resumed step: the last row
    return [last[s] for s in sorted(last)]


def running_mean(values: list[float]) -> list[float]:
    return [statistics.mean(values[max(0, i - WINDOW + 1):i + 1]) for i in range(len(values))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--delink", type=int, default=10)
    parser.add_argument("--work", default="/tmp/m6-pseudo-to-real")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    common = ["model.moe.every=1", f"train.max_steps={args.steps}", f"optim.warmup_steps={max(1, args.steps // 10)}",
              "logging.every=1", "logging.console=false", "train.eval_every=0", "checkpoint.every=0"]
    settings = {"real from scratch": [], "pseudo-to-real": ["model.share_layers=2",
                                                            f"train.delink_at_step={args.delink}"]}
    runs: dict[str, dict] = {}
    for name, extra in settings.items():
        run_dir = Path(args.work) / name.replace(" ", "-")
        t0, c0 = time.perf_counter(), time.process_time()
        train(load(TINY, [*common, *extra, f"run.dir={run_dir}"]))
        rows = rows_of(run_dir)
        runs[name] = {"rows": [{k: r[k] for k in ("step", "lm_loss", "step_time_s")} for r in rows],
                      "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "overrides": extra}
    real, p2r = runs["real from scratch"]["rows"], runs["pseudo-to-real"]["rows"]
    target = running_mean([r["lm_loss"] for r in real])[-1]
    summary = {}
    for name, run in runs.items():
        rows = run["rows"]
        smooth = running_mean([r["lm_loss"] for r in rows])
        reached = next((i for i, v in enumerate(smooth) if v <= target), None)
        tail = rows[-max(1, len(rows) // 5):]
        summary[name] = {"lm_loss_last20": statistics.mean(r["lm_loss"] for r in tail), "lm_loss_final": rows[-1]["lm_loss"],
                         "step_reaching_target": None if reached is None else rows[reached]["step"],
                         "step_seconds_to_target": None if reached is None else sum(r["step_time_s"] for r in rows[:reached + 1]),
                         "step_seconds_total": sum(r["step_time_s"] for r in rows),
                         "wall_s": run["wall_s"], "cpu_s": run["cpu_s"]}
    machine = machine_info(torch.device("cpu"))
    machine["lscpu"] = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()[:10]
    command = f"python -m bench.pseudo_to_real --steps {args.steps} --delink {args.delink}"
    result = {"command": command, "target_lm_loss": target, "summary": summary, "runs": runs, "machine": machine}
    lines = [f"# Pseudo-to-real vs real from scratch, configs/tiny.yaml with model.moe.every=1, {args.steps} steps (CPU)", "",
             f"`{command}` on {machine['cpu_model']} ({machine['cpu_count']} cores, shared with other jobs), torch "
             f"{machine['torch']}. Pseudo-to-real: model.share_layers=2 (4 blocks, 2 weight sets) to step {args.delink}, "
             f"then delinked in the run. Target: the real run's final LM loss as a {WINDOW}-step running mean, "
             f"{target:.4f}.", "",
             "| run | LM loss (last 20%) | LM loss at the last step | first step at the target | step seconds to the target | "
             "step seconds in all | wall s | CPU s |", "|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        reached = "-" if s["step_reaching_target"] is None else str(s["step_reaching_target"])
        seconds = "-" if s["step_seconds_to_target"] is None else f"{s['step_seconds_to_target']:.0f}"
        lines.append(f"| {name} | {s['lm_loss_last20']:.4f} | {s['lm_loss_final']:.4f} | {reached} | {seconds} | "
                     f"{s['step_seconds_total']:.0f} | {s['wall_s']:.0f} | {s['cpu_s']:.0f} |")
    # Every step of a short run; of a long one every tenth, and the steps around the delink.
    shown = [(a, b) for a, b in zip(real, p2r) if len(real) <= 40 or a["step"] % 10 == 0
             or abs(a["step"] - args.delink) <= 3]
    lines += ["", "LM loss per step (real / pseudo-to-real): " + ", ".join(
        f"{a['step']}: {a['lm_loss']:.3f}/{b['lm_loss']:.3f}" for a, b in shown), ""]
    write_results(args.out, "pseudo_to_real-cpu-2core", result, "\n".join(lines))


if __name__ == "__main__":
    main()
