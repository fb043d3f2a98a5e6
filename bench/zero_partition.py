"""memory.offload=zero unsplit vs partitioned (parallel.shard=optimizer) at world 2, CPU (gloo), bf16.

    python -m bench.zero_partition    # ~1-2 min on 2 CPU cores -> bench/results/zero_partition-<machine>.md

Per rank: host bytes by kind (masters, gradient buffers, AdamW state, staging: exact tensor-storage
counts, as bench.memory --offload-layouts counts them), the bytes that cross the host link in one
step (gradients landing in host buffers, weights written back to the device: counted at the copy
calls), and the step time (round-robin, every round kept: both ranks must run the same steps). Two
layouts of the experts: EP 1 (every parameter split over both ranks) and EP 2 (dense split, each
expert whole on its one rank). On this CPU-only machine the device is the host: the bytes say where
a GPU run keeps them and what it copies; nothing overlaps and the step times are CPU work only.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch

from bench.harness import free_port, machine_info, machine_tag, time_round_robin, write_results
from bench.memory import COMMON, LAYOUT_MODEL, ModelStateBytes
from m6.config import load
from m6.train.loop import Trainer

RUNS = {
    "zero, EP 1": ["parallel.expert_parallel_size=1"],
    "zero partitioned, EP 1": ["parallel.expert_parallel_size=1", "parallel.shard=optimizer"],
    "zero, EP 2": ["parallel.expert_parallel_size=2"],
    "zero partitioned, EP 2": ["parallel.expert_parallel_size=2", "parallel.shard=optimizer"],
}
ZERO = ["memory.offload=zero", "memory.offload_blocks=[]"]
ROUNDS = 5


class LinkBytes:
    """Counts the bytes one step moves over the host link, at offload's copy calls."""

    def __init__(self, trainer: Trainer) -> None:
        self.off = trainer.update.offload
        self.grads_out = self.weights_back = 0
        stream, copy_back = self.off._stream_grad, self.off._copy_back  # private: bench only

        def counted_stream(p, grad=None):
            buf = self.off._grad_buffers[id(p)]
            self.grads_out += buf.numel() * buf.element_size()
            return stream(p, grad)

        def counted_copy_back(masters):
            ids = {id(m) for m in masters}
            self.weights_back += sum(m.numel() * p.element_size() for p, m in self.off.resident if id(m) in ids)
            return copy_back(masters)

        self.off._stream_grad, self.off._copy_back = counted_stream, counted_copy_back


def rank_rows(root: str) -> dict:
    trainers = {name: Trainer(load("configs/tiny.yaml", [*COMMON, *LAYOUT_MODEL, *ZERO, "train.device=cpu",
                                                         f"run.dir={root}/{i}", *extra]))
                for i, (name, extra) in enumerate(RUNS.items())}
    timings = time_round_robin({n: tr.train_step for n, tr in trainers.items()}, torch.device("cpu"),
                               min_rounds=ROUNDS, max_rounds=ROUNDS, warmup=1, min_cpu_util=0.0)
    rows = {}
    for name, tr in trainers.items():
        n = sum(p.numel() for p in tr.model.parameters() if p.requires_grad)
        link = LinkBytes(tr)
        metrics = tr.train_step()
        host = ModelStateBytes(tr).host_breakdown()
        lo, hi = timings.spread(name)
        rows[name] = {"overrides": RUNS[name], "params": n, "host_bytes": host, "host_total": sum(host.values()),
                      "grads_out_bytes": link.grads_out, "weights_back_bytes": link.weights_back,
                      "device_grads_at_backward_end_bytes": metrics["grad_mb"] * 2**20,
                      "median_s": timings.median(name), "min_s": lo, "max_s": hi, "loss": metrics["loss"]}
    return rows


def _rank(rank: int, world: int, port: int, root: str) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    rows = rank_rows(root)
    with open(f"{root}/rank{rank}.json", "w") as f:
        json.dump(rows, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def render(result: dict) -> str:
    m = result["machine"]
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    lines = [
        "# ZeRO-Offload unsplit vs partitioned (memory.offload=zero, parallel.shard=optimizer), world 2, CPU", "",
        f"Command: `{result['command']}`  ",
        f"Machine: {m['cpu_model']}, {m['cpu_count']} CPUs, torch {m['torch']}; total wall {result['wall_s']} s.  ",
        f"Model: configs/tiny.yaml with `{' '.join(LAYOUT_MODEL)}`, `{' '.join(ZERO)}`, synthetic data, torch's "
        "AdamW on the host, fp32 host gradient buffers. Two gloo processes, one thread each; the four trainers "
        f"run round-robin in each ({ROUNDS} rounds after 1 warm-up, every round kept; the machine is shared).  ",
        "Bytes per rank: host states are exact tensor-storage counts (masters, gradient buffers, AdamW state "
        "with its step counters, the 16-bit staging of the copy back); link bytes are counted at offload's copy "
        "calls in one step (gradients landing in host buffers, 16-bit weights written to the device). On this "
        "CPU-only machine nothing overlaps; step times are the CPU doing both sides.", "",
        "| rank | run | params (whole model on the rank) | host MiB: masters | grads | optimizer state | staging | "
        "host total | vs unsplit | link MiB/step: grads out | weights back | device grads at backward end MiB | "
        "median s/step [min-max] |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rank, rows in enumerate(result["ranks"]):
        for name, r in rows.items():
            h = r["host_bytes"]
            base = rows[name.replace("zero partitioned", "zero")]["host_total"]
            lines.append(
                f"| {rank} | {name} | {r['params'] / 1e6:.2f} M | {mib(h['masters'])} | {mib(h['grads'])} | "
                f"{mib(h['optimizer_state'])} | {mib(h['staging'])} | {mib(r['host_total'])} | "
                f"{r['host_total'] / base:.3f} | {mib(r['grads_out_bytes'])} | {mib(r['weights_back_bytes'])} | "
                f"{mib(r['device_grads_at_backward_end_bytes'])} | "
                f"{r['median_s']:.3f} [{r['min_s']:.3f}-{r['max_s']:.3f}] |")
    lines += ["", "At EP 1 every parameter is split over the 2 ranks, so masters, gradients, optimizer state and "
              "both link directions are halved (a split parameter's odd row goes to rank 0), and so is the 16-bit "
              "staging: the copy back pushes one forward segment's chunks at a time, two buffers of the largest. "
              "At EP 2 each rank's experts stay whole (their expert-data-parallel group is the rank alone) and "
              "only the dense parameters halve. *Device grads at backward end*: the gradient bytes the model's "
              "parameters held when the step's backward returned (`grad_mb`): unsplit, the bf16 gradients of "
              "buckets whose all-reduce had not been drained yet; partitioned, a bucket's gradients are dropped "
              "as it launches its reduce-scatter. The gradients and weights of the network (reduce-scatter + "
              "all-gather) replace the unsplit run's all-reduce."]
    return "\n".join(lines) + "\n"


def main() -> None:
    import torch.multiprocessing as mp

    started = time.time()
    root = tempfile.mkdtemp(prefix="m6-bench-zero-partition-")
    for key in ("OMP_PROC_BIND", "OMP_PLACES"):  # one thread per rank, unpinned
        os.environ.pop(key, None)
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.start_processes(_rank, args=(2, free_port(), root), nprocs=2, start_method="spawn")
    result = {"benchmark": "zero_partition", "command": "python -m bench.zero_partition", "device": "cpu",
              "machine": machine_info(torch.device("cpu")),
              "ranks": [json.load(open(f"{root}/rank{r}.json")) for r in range(2)]}
    result["wall_s"] = round(time.time() - started, 1)
    print("done", file=sys.stderr)
    write_results("bench/results", f"zero_partition-{machine_tag(torch.device('cpu'))}", result, render(result))


if __name__ == "__main__":
    main()
