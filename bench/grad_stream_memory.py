"""Gradient streaming across micro-batches: device gradient bytes at the end of every backward, at
world size 2 with the experts split (EP 2) and accumulation 4, with and without CPU offload.

    python -m bench.grad_stream_memory              # ~2 min on 2 CPU cores
    python -m bench.grad_stream_memory --quick      # tiny model: a harness check, not a measurement
    python -m bench.grad_stream_memory --label before --code "main 96226c3"   # on older code: *-before files

Two gloo processes (one thread each) build one m6 Trainer per variant in turn (memory.offload
none / optimizer / optimizer+params) on bench.memory's 25M-parameter model, EP 2 (each rank holds
half the experts, which no other rank shares), micro-batches of 1 row, so 4 per step. After every
``update.backward`` (each micro-batch's) the bytes of the live ``.grad`` tensors of the model's
parameters are counted (each storage once: where a GPU run keeps gradients; offload's host sums
hang off its masters, not counted); the maximum over the step's backwards, and the value after
the first one, are reported with the step's ``grad_mb`` metric where the code has it. WARMUP
steps, then MEASURED ones (maxima reported). Exact tensor counts, not timings: the machine's load
does not change them.

When ``<out>/grad_stream_memory-<machine>-before.json`` exists, the markdown compares with it.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

from bench.grad_sync_memory import code_version
from bench.harness import machine_info, machine_tag, write_results
from bench.local_ranks import run_ranks
from bench.memory import COMMON, MODEL
from m6.config import load
from m6.train.loop import Trainer

WORLD = 2
WARMUP = 1
MEASURED = 2
OFFLOAD = ["none", "optimizer", "optimizer+params"]
LAYOUT = ["parallel.expert_parallel_size=2", "train.micro_batch_size=1"]


def device_grad_bytes(params: list[torch.nn.Parameter]) -> int:
    """Bytes of the parameters' live ``.grad`` storages, each once (m6.memory.live_bytes.grad_bytes,
    written out here so the same count runs on code older than it)."""
    return sum({p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                for p in params if p.grad is not None}.values())


def measured_step(tr: Trainer) -> dict:
    """One train_step with the device gradient bytes counted after each micro-batch's backward."""
    params = [p for p in tr.model.parameters() if p.requires_grad]
    after: list[int] = []
    real_backward = tr.update.backward

    def backward(loss) -> None:
        real_backward(loss)
        after.append(device_grad_bytes(params))
    tr.update.backward = backward  # an instance attribute shadows the method
    try:
        metrics = tr.train_step()
    finally:
        del tr.update.backward
    return {"loss": metrics["loss"], "after_each_backward": after, "grad_mb_metric": metrics.get("grad_mb")}


def measure(model: list[str], rank: int, world: int, root: str) -> dict:
    rows = {}
    for mode in OFFLOAD:
        cfg = load("configs/tiny.yaml", [*COMMON, *model, *LAYOUT, "train.device=cpu", f"run.dir={root}/{mode}",
                                         f"memory.offload={mode}"])
        tr = Trainer(cfg)
        params = [p for p in tr.model.parameters() if p.requires_grad]
        experts = {id(p) for p in tr.sharded.expert_params.values()}
        losses = [tr.train_step()["loss"] for _ in range(WARMUP)]
        steps = [measured_step(tr) for _ in range(MEASURED)]
        rows[mode] = {
            "num_params": sum(p.numel() for p in params), "accumulation": tr.accum,
            "grad_bytes_all": sum(p.numel() * p.element_size() for p in params),
            "grad_bytes_replicated": sum(p.numel() * p.element_size() for p in params if id(p) not in experts),
            "losses": [*losses, *(s["loss"] for s in steps)],
            "max_after_backward": max(max(s["after_each_backward"]) for s in steps),
            "after_first_backward": max(s["after_each_backward"][0] for s in steps),
            "grad_mb_metric": [s["grad_mb_metric"] for s in steps], "per_step": steps}
        del tr
        if rank == 0:
            print(f"offload={mode}: measured", file=sys.stderr, flush=True)
    return rows


def run(quick: bool) -> dict:
    model = MODEL["quick" if quick else "full"]
    ranks = run_ranks(functools.partial(measure, model), WORLD, "m6-bench-grad-stream-")
    return {"model_overrides": model, "layout_overrides": LAYOUT, "common_overrides": COMMON, "world_size": WORLD,
            "warmup_steps": WARMUP, "measured_steps": MEASURED, "ranks": ranks}


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def _table(result: dict) -> list[str]:
    lines = ["| memory.offload | device gradient MiB at the end of a backward: max (rank 0 / 1) | after the first "
             "micro-batch | all gradients of the rank | its replicated ones | losses (rank 0) |",
             "|---|---|---|---|---|---|"]
    for mode, r in result["ranks"][0].items():
        worst = " / ".join(_mib(rk[mode]["max_after_backward"]) for rk in result["ranks"])
        first = " / ".join(_mib(rk[mode]["after_first_backward"]) for rk in result["ranks"])
        lines.append(f"| {mode} | {worst} | {first} | {_mib(r['grad_bytes_all'])} | {_mib(r['grad_bytes_replicated'])} "
                     f"| {', '.join(f'{x:.6f}' for x in r['losses'])} |")
    return lines


def render(result: dict, before: dict | None) -> str:
    m = result["machine"]
    out = [f"# Device gradient bytes with gradient streaming ({m['cpu_model']}, torch {m['torch']})", "",
           f"`{result['command']}` on code {result['code']}; world size 2 (gloo, 1 thread each), EP 2, "
           f"accumulation {result['ranks'][0]['none']['accumulation']}, bench.memory's model "
           f"({result['ranks'][0]['none']['num_params']:,} parameters per rank). Exact counts of the live `.grad` "
           "bytes of the model's parameters after each micro-batch's backward (where a GPU run keeps gradients).", "",
           *_table(result), ""]
    if before is not None:
        out += [f"Before ({before['code']}):", "", *_table(before), ""]
    out += ["Machine: " + json.dumps(m), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--label", default="", help="suffix of the result files (e.g. before)")
    p.add_argument("--code", default=None, help="what code ran (default: git HEAD)")
    args = p.parse_args(argv)
    device = torch.device("cpu")
    result = {"command": "python -m bench.grad_stream_memory" + (" --quick" if args.quick else "")
              + (f" --label {args.label}" if args.label else ""), "code": args.code or code_version(),
              "device": "cpu", "machine": machine_info(device), **run(args.quick)}
    stem = f"grad_stream_memory-{machine_tag(device)}" + ("-quick" if args.quick else "")
    before_path = Path(args.out) / f"{stem}-before.json"
    before = json.loads(before_path.read_text()) if before_path.exists() and not args.label else None
    write_results(args.out, stem + (f"-{args.label}" if args.label else ""), result, render(result, before))



if __name__ == "__main__":
    main()
