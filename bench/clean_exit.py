"""Finished 2-rank runs end normally: N torchrun runs of configs/tiny.yaml (4 steps, a checkpoint
every 2, the loader's worker processes, the process groups torn down, the interpreter exiting as
usual), each checked for exit code 0 on every rank and no "terminate called" from C++ at exit.

    python -m bench.clean_exit            # 30 runs, ~10-20 min on 2 CPU cores
    python -m bench.clean_exit --runs 3   # a harness check

Writes bench/results/clean_exit-<machine>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import machine_info, machine_tag, write_results
from tests.dist.dist_helpers import free_port

REPO = Path(__file__).resolve().parents[1]
OVERRIDES = ["train.max_steps=4", "checkpoint.every=2"]


def one_run(run_dir: Path) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(REPO / "train.py"), "--config", str(REPO / "configs/tiny.yaml"),
               *OVERRIDES, f"run.dir={run_dir}"]
    started = time.monotonic()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    log = proc.stdout + proc.stderr
    return {"exit_code": proc.returncode, "terminate_lines": log.count("terminate called"),
            "finished": "done: step 4/4" in log, "seconds": round(time.monotonic() - started, 1),
            "tail": log[-1500:] if proc.returncode or "terminate called" in log else ""}


def render(result: dict) -> str:
    runs = result["runs"]
    bad = [i for i, r in enumerate(runs) if r["exit_code"] or r["terminate_lines"] or not r["finished"]]
    lines = [f"# Clean exit of finished 2-rank runs ({result['machine']['cpu_model']}, "
             f"{result['machine']['cpu_count']} cores, torch {result['machine']['torch']})", "",
             f"`{result['command']}`: {len(runs)} torchrun runs of configs/tiny.yaml ({' '.join(OVERRIDES)}), "
             f"2 ranks on gloo.", "",
             f"- finished and exited 0 on every rank, no \"terminate called\": {len(runs) - len(bad)} of {len(runs)}",
             f"- aborts or non-zero exits: {len(bad)}" + (f" (runs {bad})" if bad else ""),
             f"- seconds per run: median {sorted(r['seconds'] for r in runs)[len(runs) // 2]:.0f}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="m6-clean-exit-") as tmp:
        for i in range(args.runs):
            runs.append(one_run(Path(tmp) / f"run{i}"))
            print(f"run {i + 1}/{args.runs}: exit {runs[-1]['exit_code']}, {runs[-1]['seconds']} s", file=sys.stderr)
    result = {"benchmark": "clean_exit", "command": f"python -m bench.clean_exit --runs {args.runs}",
              "machine": machine_info(torch.device("cpu")), "runs": runs}
    write_results(args.out, f"clean_exit-{machine_tag(torch.device('cpu'))}", result, render(result))


if __name__ == "__main__":
    main()
