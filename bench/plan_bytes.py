"""The planner's device and host bytes against real CPU runs at world size 1 and 2 (EP 2), for the
memory features of issue #27: offload with gradient streaming and accumulation, Adafactor, fp16,
granular offload (memory.offload_blocks).

    python -m bench.plan_bytes            # ~1-2 min on 2 CPU cores

Per layout and rank, after a first step (optimizer state made), one measured step of a Trainer on
full-length samples (bench.plan_measure.DenseSamples), forced-balanced routing (the planner's
assumption), compared with m6.plan.memory.RankMemory's report for the same config:

- device gradients: the ``grad_mb`` metric (live ``.grad`` bytes of the model's parameters at the
  end of a backward, max over the step's) vs the report's device ``grads``;
- host model states: the offload's masters + gradient buffers + the optimizer's state tensors vs
  the report's host params + grads + optimizer state;
- peak: live tensor bytes (every storage before the step + m6.memory.live_bytes.LiveBytes's peak
  inside it) vs the report's ``peak_shared`` (device and host are one memory on a CPU).

Exact byte counts: the machine's load does not change them. Step time is not compared here
(bench.plan_validation does that for the plain layouts).
"""

from __future__ import annotations

import json

import torch

from bench.grad_sync_memory import code_version
from bench.harness import machine_info, write_results
from bench.local_ranks import run_ranks
from bench.plan_measure import COMMON, DenseSamples, live_storage_bytes
from m6.config import load
from m6.memory.live_bytes import LiveBytes
from m6.plan.memory import RankMemory

SMALL = ["model.d_model=64", "model.num_layers=3", "model.num_heads=2", "model.ffn_dim=128", "model.moe.every=1",
         "model.moe.num_experts=4", "model.moe.capacity_factor=null", "model.max_text_len=64", "model.image_size=16",
         "data.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=2", "model.moe.force_balance=true",
         "memory.host_optimizer=torch"]
LAYOUTS = {
    "offload optimizer": ["memory.offload=optimizer"],
    "offload optimizer+params": ["memory.offload=optimizer+params"],
    "offload optimizer+params, blocks [0,1]": ["memory.offload=optimizer+params", "memory.offload_blocks=[0,1]"],
    "offload optimizer, adafactor": ["memory.offload=optimizer", "optim.name=adafactor"],
    "offload optimizer, fp16": ["memory.offload=optimizer", "train.precision=fp16"],
    "adafactor, no offload": ["optim.name=adafactor"],
}


def measure(world: int, rank: int, extra: list[str], root: str) -> dict:
    from m6.train.loop import Trainer

    ep = ["parallel.expert_parallel_size=2"] if world == 2 else []
    cfg = load("configs/tiny.yaml", [*COMMON, *SMALL, *ep, *extra, f"run.dir={root}"])
    m = cfg.model
    tr = Trainer(cfg, dataset=DenseSamples(64, cfg.data.seq_len, (m.image_channels, m.image_size, m.image_size)))
    tr.train_step()
    start = live_storage_bytes()
    with LiveBytes() as live:
        metrics = tr.train_step()
    report = RankMemory(cfg, world, 2 if world == 2 else 1, "cpu").report(cfg)
    row = {"accumulation": tr.accum, "peak": {"planned": report.peak_shared, "measured": start + live.peak},
           "device grads": {"planned": report.device.get("grads", 0.0), "measured": metrics["grad_mb"] * 2**20}}
    off = tr.update.offload
    if off is not None:
        params = list(tr.model.parameters())
        nbytes = lambda ts: sum(t.untyped_storage().nbytes() for t in ts)  # noqa: E731
        state = [v for st in tr.update.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        row["host states"] = {"planned": sum(report.host[k] for k in ("params", "grads", "optimizer state")),
                              "measured": nbytes(off.masters_of(params)) + nbytes(off._grad_buffers.values())
                              + nbytes(state)}
    return row


def measure_layouts(rank: int, world: int, root: str) -> dict:
    return {name: measure(world, rank, extra, f"{root}/w{world}-{i}") for i, (name, extra) in enumerate(LAYOUTS.items())}


def run_world(world: int) -> list[dict]:
    return run_ranks(measure_layouts, world, "m6-bench-plan-bytes-")


def render(result: dict) -> str:
    m = result["machine"]
    out = [f"# Planner bytes vs measured: streaming, offload_blocks, Adafactor, fp16 ({m['cpu_model']}, torch {m['torch']})",
           "", f"`{result['command']}` on code {result['code']}. Exact byte counts (module docstring of "
           "`bench/plan_bytes.py`); planned / measured, ratio. World 2 runs EP 2 (the experts unshared).", "",
           "| world, rank | layout | accumulation | peak (MiB) | device gradients at the end of a backward (MiB) | "
           "host model states (MiB) |", "|---|---|---|---|---|---|"]
    worst = 0.0
    for world, ranks in result["worlds"].items():
        for rank, rows in enumerate(ranks):
            for name, row in rows.items():
                cells = []
                for key in ("peak", "device grads", "host states"):
                    if key not in row:
                        cells.append("-")
                        continue
                    p, q = row[key]["planned"], row[key]["measured"]
                    ratio = p / q if q else (1.0 if p == 0 else float("inf"))
                    worst = max(worst, abs(ratio - 1))
                    cells.append(f"{p / 2**20:.2f} / {q / 2**20:.2f} ({ratio:.3f})")
                out.append(f"| {world}, {rank} | {name} | {row['accumulation']} | " + " | ".join(cells) + " |")
    out += ["", f"Largest deviation of a planned figure from the measured one: {worst:.1%}.", "",
            "Machine: " + json.dumps(m), ""]
    return "\n".join(out)


def main() -> None:
    result = {"command": "python -m bench.plan_bytes", "code": code_version(), "machine": machine_info(torch.device("cpu")),
              "layouts": LAYOUTS, "small_overrides": SMALL, "common_overrides": COMMON,
              "worlds": {w: run_world(w) for w in (1, 2)}}
    write_results("bench/results", "plan_bytes-cpu-2core", result, render(result))


if __name__ == "__main__":
    main()
