"""The planner's predictions for the published giants (M6-T on 480 V100-32GB, M6-10T on 512
V100-32GB with 1 TB host per node), each planned with the offload layouts this checkout runs and
with every layout the planner models (ZeRO-Offload's, memory.offload=zero, and the delayed
update): the commands run, their whole output, and the best layout's figures. Every figure is a
PREDICTION of `python -m m6.plan`; nothing runs on those GPUs.

    python -m bench.plan_predictions [--stem plan-predictions-zero-offload] [--top 2]
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import time

import torch

from bench.harness import machine_info, write_results

V100 = ["--gpu", "v100", "--gpu-memory", "32GB", "--gpus-per-node", "8", "--host-memory", "1TB"]
JOBS = {  # name -> (config and overrides, --gpus, target MFU of issue #46)
    "M6-T": (["configs/m6-1t.yaml", "train.global_batch_size=960"], 480, 0.30),
    "M6-10T": (["configs/m6-10t.yaml"], 512, 0.18),
}
# Which layouts each plan may take: this checkout's offload settings, or all the planner models;
# M6-T also with sharded data parallel (FSDP2's CPU offload of its expert replicas' shards).
# M6-10T also on 2 TB hosts (not the target's 1 TB): where ZeRO-Offload's host bytes fit, what it would give.
VARIANTS = {"runnable": ["--offload-modes", "runnable"], "all": ["--offload-modes", "all"],
            "all, --shard any": ["--offload-modes", "all", "--shard", "any"],
            "all, 2 TB host per node": ["--offload-modes", "all", "--host-memory", "2TB"]}
ONLY = {"all, --shard any": "M6-T", "all, 2 TB host per node": "M6-10T"}
_STEP = re.compile(r"PREDICTED ([\d,]+) tokens/s, step ([\d.]+) s = (.*?); MFU ([\d.]+)%")
_TERM = re.compile(r"(compute|all-to-all|grad sync|small collectives|offload|update) ([\d.]+)")


def best_of(printed: str) -> dict:
    """The best (#1) layout's settings line and figures, read off the planner's output."""
    block = printed.split("\n#1  ", 1)[1].split("\n#2  ", 1)[0]
    first = block.splitlines()[0]
    m = _STEP.search(block)
    device = re.search(r"per-GPU device memory peak ([\d.,]+) GiB", block).group(1)
    host = re.search(r"per node of \d+ ranks ([\d.,]+) GiB", block).group(1)
    synchronous = re.search(r"update synchronously: step ([\d.]+) s", block)
    return {"layout": first, "tokens_per_s": float(m.group(1).replace(",", "")), "step_s": float(m.group(2)),
            "terms_s": {k: float(v) for k, v in _TERM.findall(m.group(3))}, "mfu": float(m.group(4)) / 100,
            "device_peak_gib": float(device.replace(",", "")), "host_per_node_gib": float(host.replace(",", "")),
            "synchronous_step_s": float(synchronous.group(1)) if synchronous else None,
            "overlaps": [line.strip() for line in block.splitlines() if line.strip().startswith(("overlaps:",
                                                                                                  "delayed update:",
                                                                                                  "host update"))]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stem", default="plan-predictions-zero-offload")
    p.add_argument("--top", type=int, default=2)
    args = p.parse_args(argv)
    runs, md = [], ["# Predicted plans of the giants with ZeRO-Offload's layout and the delayed update", "",
                    "Every figure below is a PREDICTION of `python -m m6.plan`, none measured on those GPUs. The host "
                    "update is a per-core rate timed on the planning host in each command's own process, so it moves "
                    "a little between the commands (the ASSUMED line of each names its rates).", ""]
    for job, (config, gpus, target) in JOBS.items():
        for variant, flags in VARIANTS.items():
            # (M6-10T: EP 512 takes every rank, each expert one replica: nothing over edp to shard.)
            if ONLY.get(variant, job) != job:
                continue
            cmd = ["python", "-m", "m6.plan", *config, "--gpus", str(gpus), *V100, "--top", str(args.top), *flags]
            t0 = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True)
            printed = done.stdout + ("" if done.returncode == 0 else done.stderr)
            run = {"job": job, "variant": variant, "command": shlex.join(cmd), "rc": done.returncode,
                   "seconds": round(time.perf_counter() - t0, 1), "target_mfu": target, "output": printed}
            if done.returncode == 0:
                run["best"] = best_of(printed)
            runs.append(run)
            md += [f"## {job}, {variant}", "", f"`{shlex.join(cmd)}`", "", "```", printed.rstrip("\n"), "```", ""]
            if "best" in run:
                b = run["best"]
                md += [f"Best: step {b['step_s']:.3f} s, MFU {b['mfu']:.1%} (target {target:.0%}).", ""]
            print(f"{job} {variant}: rc {done.returncode}", file=sys.stderr, flush=True)
    md += ["## Summary", "", "| job | layouts | best step (s) | MFU | target |", "|---|---|---|---|---|"]
    for run in runs:
        if "best" in run:
            md.append(f"| {run['job']} | {run['variant']} | {run['best']['step_s']:.3f} | {run['best']['mfu']:.1%} | "
                      f"{run['target_mfu']:.0%} |")
    write_results("bench/results", args.stem, {"machine": machine_info(torch.device("cpu")), "runs": runs},
                  "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
