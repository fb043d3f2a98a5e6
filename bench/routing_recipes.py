"""Routing recipes on configs/tiny.yaml (CPU): load balance and LM loss at equal steps for the
auxiliary loss only, auxiliary-loss-free balancing only (model.moe.expert_bias_update_rate) and
both; and the aux-free run at world size 2 (torchrun, gloo) against world size 1.

    python -m bench.routing_recipes --steps 300    # ~15 min on 2 CPU cores
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


def run_world2(setting: str, steps: int, run_dir: Path) -> float:
    """``setting`` at world size 2 under torchrun (gloo); returns its wall seconds."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
           str(REPO / "train.py"), "--config", TINY, *SETTINGS[setting], *common(steps, run_dir)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"world-2 run failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def finished(run_dir: Path, steps: int) -> bool:
    summary = run_dir / "summary.json"
    return summary.is_file() and json.loads(summary.read_text()).get("steps") == steps


def timed(run_dir: Path, run) -> dict:
    """Run ``run`` (returns its wall seconds, or None to time it here) unless an interrupted
    invocation finished it; its times kept in the run dir, so a reused run reports them too."""
    times = run_dir / "bench_times.json"
    if not times.is_file():
        t0, c0 = time.perf_counter(), time.process_time()
        wall = run()
        times.write_text(json.dumps({"wall_s": wall if wall is not None else time.perf_counter() - t0,
                                     "cpu_s": None if wall is not None else time.process_time() - c0}))
    return json.loads(times.read_text())


def compare_worlds(w1_rows: list[dict], w2_rows: list[dict]) -> dict:
    """Where a world-2 run leaves the world-1 run: the first step whose routing counts (or expert
    biases) differ, and the largest relative LM-loss difference before that step and over all."""
    def first(key: str) -> int | None:
        return next((a["step"] for a, b in zip(w1_rows, w2_rows) if a.get(key) != b.get(key)), None)
    routing = first("expert_tokens")
    rel = [(a["step"], abs(a["lm_loss"] - b["lm_loss"]) / abs(a["lm_loss"])) for a, b in zip(w1_rows, w2_rows)]
    return {"first_step_routing_differs": routing, "first_step_bias_differs": first("expert_bias"),
            "max_rel_lm_loss_diff_before_routing_differs": max((r for s, r in rel if routing is None or s < routing),
                                                               default=0.0),
            "max_rel_lm_loss_diff": max(r for _, r in rel),
            "mean_rel_lm_loss_diff_last20": statistics.mean(r for _, r in rel[-max(1, len(rel) // 5):])}


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
        if finished(run_dir, args.steps) and not (run_dir / "bench_times.json").is_file():
            raise SystemExit(f"{run_dir} holds a finished run without its times: remove it or use another --work")
        times = timed(run_dir, lambda: Trainer(load(TINY, [*overrides, *common(args.steps, run_dir)])).fit())
        results[name] = {**summarise(rows_of(run_dir)), **times, "overrides": overrides}
    # At world size 2 the same runs sum their gradients in another order (two half batches): the
    # weights leave world 1's at the last bit, and once a token's top-k choice flips the routing
    # counts, and with them the bias's sign updates, differ. The aux-loss-only pair (no bias)
    # shows how soon that happens without the bias.
    worlds: dict[str, dict] = {}
    for name in ("aux loss only", "aux-free only"):
        w2_dir = work / (name.replace(" ", "-") + "-world2")
        times = timed(w2_dir, lambda: run_world2(name, args.steps, w2_dir))
        w1_rows, w2_rows = rows_of(work / name.replace(" ", "-")), rows_of(w2_dir)
        worlds[name] = {**times, **compare_worlds(w1_rows, w2_rows), **summarise(w2_rows)}
    world = worlds["aux-free only"]
    world["final_max_abs_bias"] = {k: v for k, v in rows_of(work / "aux-free-only")[-1].items()
                                   if k.endswith("expert_bias_max_abs")}
    machine = machine_info(torch.device("cpu"))
    machine["lscpu"] = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()[:10]
    command = f"python -m bench.routing_recipes --steps {args.steps}"
    result = {"command": command, "config": "configs/tiny.yaml", "steps": args.steps, "rate": RATE,
              "settings": results, "world2": worlds, "machine": machine}
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
    lines += ["", "The same settings at world size 2 (torchrun, 2 gloo processes, 1 thread each) against world size 1:", "",
              "| setting | first step with other routing counts | first step with another expert bias | "
              "largest relative LM-loss difference before it | largest over all steps | mean over the last 20% | "
              "max/mean load (last 20%) |", "|---|---|---|---|---|---|---|"]
    for name, w in worlds.items():
        never = lambda v: "none" if v is None else str(v)  # noqa: E731
        bias = never(w["first_step_bias_differs"]) if name == "aux-free only" else "(no bias)"
        lines.append(f"| {name} | {never(w['first_step_routing_differs'])} | {bias} | "
                     f"{w['max_rel_lm_loss_diff_before_routing_differs']:.1e} | {w['max_rel_lm_loss_diff']:.1e} | "
                     f"{w['mean_rel_lm_loss_diff_last20']:.1e} | {w['max_over_mean_last20']:.3f} |")
    lines.append("")
    write_results(args.out, "routing_recipes-cpu-2core", result, "\n".join(lines))


if __name__ == "__main__":
    main()
