"""Routing recipes on configs/tiny.yaml (CPU): load balance and LM loss at equal steps for the
auxiliary loss only, auxiliary-loss-free balancing only (model.moe.expert_bias_update_rate) and
both; and the aux-free run at world size 2 (torchrun, gloo) against world size 1.

    python -m bench.routing_recipes --steps 40     # ~30 min on 2 CPU cores shared with other jobs
    python -m bench.routing_recipes --steps 4      # a harness check, not a measurement

Balance: per logged step and MoE layer, max/mean of the tokens routed to each expert (before
capacity, the step's global counts: tiny has no accumulation); the figure is the mean over the last
20% of steps and over the layers (1.0 = perfectly even). Loss: the LM loss (no aux terms) averaged
over the last 20% of steps, and at the last step. Runs are sequential in one process (the losses do
not depend on the machine's load; the wall times are shown for what they are: a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.harness import machine_info, write_results
from m6.config import load
from m6.train.loop import Trainer

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
RATE = 1e-3  # DeepSeek-V3's update rate
SETTINGS = {
    "aux loss only": ["model.moe.aux_loss_coef=0.01", "model.moe.expert_bias_update_rate=0"],
    "aux-free only": ["model.moe.aux_loss_coef=0", f"model.moe.expert_bias_update_rate={RATE}"],
    "both": ["model.moe.aux_loss_coef=0.01", f"model.moe.expert_bias_update_rate={RATE}"],
}


def common(steps: int, run_dir: Path) -> list[str]:
    # Warmup a tenth of the run (tiny's 30 steps are for its 300).
    return [f"train.max_steps={steps}", f"optim.warmup_steps={max(1, steps // 10)}", "logging.every=1", "logging.console=false", "train.eval_every=0",
            "checkpoint.every=0", f"run.dir={run_dir}"]


def rows_of(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "lm_loss" in r]


def summarise(rows: list[dict]) -> dict:
    tail = rows[-max(1, len(rows) // 5):]
    ratios = [max(c) / (sum(c) / len(c)) for r in tail for c in r["expert_tokens"].values()]
    per_layer = {layer: statistics.mean(max(r["expert_tokens"][layer]) / (sum(r["expert_tokens"][layer]) /
                                        len(r["expert_tokens"][layer])) for r in tail)
                 for layer in tail[-1]["expert_tokens"]}
    return {"max_over_mean_last20": statistics.mean(ratios), "max_over_mean_last20_by_layer": per_layer,
            "lm_loss_last20": statistics.mean(r["lm_loss"] for r in tail), "lm_loss_final": rows[-1]["lm_loss"],
            "dropped_fraction_last20": statistics.mean(v for r in tail for k, v in r.items()
                                                       if k.endswith("/dropped_fraction")),
            "steps": len(rows), "tail_steps": [tail[0]["step"], tail[-1]["step"]]}


def run_world2(steps: int, run_dir: Path) -> float:
    """The aux-free setting at world size 2 under torchrun (gloo); returns its wall seconds."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
           str(REPO / "train.py"), "--config", TINY, *SETTINGS["aux-free only"], *common(steps, run_dir)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"world-2 run failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--work", default="/tmp/m6-routing-recipes")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    work = Path(args.work)
    results: dict[str, dict] = {}
    for name, overrides in SETTINGS.items():
        run_dir = work / name.replace(" ", "-")
        finished = run_dir / "summary.json"
        if finished.is_file() and json.loads(finished.read_text()).get("steps") == args.steps:
            # A run an interrupted invocation finished (--work kept): its rows are the measurement.
            results[name] = {**summarise(rows_of(run_dir)), "wall_s": None, "cpu_s": None, "overrides": overrides,
                             "reused_run": True}
            continue
        t0, c0 = time.perf_counter(), time.process_time()
        Trainer(load(TINY, [*overrides, *common(args.steps, run_dir)])).fit()
        results[name] = {**summarise(rows_of(run_dir)), "wall_s": time.perf_counter() - t0,
                         "cpu_s": time.process_time() - c0, "overrides": overrides}
    w2_dir = work / "aux-free-world2"
    finished = w2_dir / "summary.json"
    if finished.is_file() and json.loads(finished.read_text()).get("steps") == args.steps:
        w2_wall = None  # run by an earlier, interrupted invocation
    else:
        w2_wall = run_world2(args.steps, w2_dir)
    w1_rows, w2_rows = rows_of(work / "aux-free-only"), rows_of(w2_dir)
    world = {
        "wall_s": w2_wall,
        "bias_equal_every_step": [r["expert_bias"] for r in w1_rows] == [r["expert_bias"] for r in w2_rows],
        "max_rel_lm_loss_diff": max(abs(a["lm_loss"] - b["lm_loss"]) / abs(b["lm_loss"]) for a, b in zip(w2_rows, w1_rows)),
        "final_max_abs_bias": {k: v for k, v in w1_rows[-1].items() if k.endswith("expert_bias_max_abs")},
        **summarise(w2_rows),
    }
    machine = machine_info(torch.device("cpu"))
    machine["lscpu"] = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()[:10]
    command = f"python -m bench.routing_recipes --steps {args.steps}"
    result = {"command": command, "config": "configs/tiny.yaml", "steps": args.steps, "rate": RATE,
              "settings": results, "aux_free_world2": world, "machine": machine}
    lines = [f"# Routing recipes on configs/tiny.yaml, {args.steps} steps (CPU)", "",
             f"`{command}` on {machine['cpu_model']} ({machine['cpu_count']} cores, shared with other jobs), "
             f"torch {machine['torch']}. Warmup {max(1, args.steps // 10)} steps, then cosine to step {args.steps}. "
             f"Expert bias update rate {RATE}; aux loss coefficient 0.01 where on. "
             f"Balance = max/mean tokens per expert (before capacity), mean over the last 20% of steps "
             f"(steps {results['aux loss only']['tail_steps'][0]}-{args.steps}) and both MoE layers; 1.00 is even.", "",
             "| setting | max/mean load (last 20%) | per layer | dropped fraction (last 20%) | LM loss (last 20%) | "
             "LM loss at the last step | wall s |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        layers = ", ".join(f"{k} {v:.2f}" for k, v in r["max_over_mean_last20_by_layer"].items())
        lines.append(f"| {name} | {r['max_over_mean_last20']:.3f} | {layers} | {r['dropped_fraction_last20']:.3f} | "
                     f"{r['lm_loss_last20']:.4f} | {r['lm_loss_final']:.4f} | "
                     f"{'-' if r['wall_s'] is None else format(r['wall_s'], '.0f')} |")
    lines += ["", f"Aux-free only at world size 2 (torchrun, 2 gloo processes, 1 thread each): expert bias "
              f"{'equal to world 1 at every step' if world['bias_equal_every_step'] else 'DIFFERENT from world 1'}; "
              f"largest relative LM-loss difference over the {args.steps} steps {world['max_rel_lm_loss_diff']:.1e}; "
              f"max/mean load (last 20%) {world['max_over_mean_last20']:.3f}.", ""]
    write_results(args.out, "routing_recipes-cpu-2core", result, "\n".join(lines))


if __name__ == "__main__":
    main()
