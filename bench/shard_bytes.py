"""parallel.shard at world 4, EP 2 on gloo: per-rank bytes of parameters, gradients and AdamW
moments MEASURED on the live tensors (their storages, FSDP2's padding included), beside the
memory estimate's figures, and the step time of each setting.

    python -m bench.shard_bytes            # ~3 min on 2 shared CPU cores
    python -m bench.shard_bytes --quick    # tiny model: a harness check, not a measurement

Four gloo processes (one thread each) build one Trainer per setting (none, optimizer, full) from
the same seed and data, then step them round-robin (none, optimizer, full, none, ...), so the
machine's other load falls on all three alike; the step time is the median over rounds of rank
0's wall time, with its CPU time beside it (a round whose CPU/wall is under half of the share of
a core each rank can get, cores / 4, shows starvation and is dropped). Losses are checked equal to none's (rel 1e-5) on every step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.harness import machine_info, machine_tag, write_results
from m6.config import load
from m6.memory.estimate import estimate_memory
from m6.model.param_groups import no_decay_ids
from m6.parallel.fsdp import local_storage_bytes
from m6.plan.memory import rank_model
from m6.train.loop import Trainer

WORLD, EP, WARMUP = 4, 2, 2
MODES = ("none", "optimizer", "full")
MODEL = {
    "full": ["model.d_model=256", "model.num_layers=4", "model.num_heads=4", "model.ffn_dim=1024",
             "model.moe.num_experts=8", "model.moe.every=2", "data.seq_len=64", "model.max_text_len=64",
             "train.global_batch_size=8"],
    "quick": ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64",
              "model.moe.num_experts=4", "model.moe.every=2", "data.seq_len=32", "model.max_text_len=40",
              "train.global_batch_size=4"],
}
COMMON = ["data.kind=synthetic", "data.sources=[]", "data.num_workers=0", "data.eval_samples=8", "data.num_samples=512",
          "train.precision=fp32", "train.eval_every=0", "train.max_steps=10000", "checkpoint.every=0",
          "logging.console=false", "model.moe.capacity_factor=null", f"parallel.expert_parallel_size={EP}"]


def _bytes(tr: Trainer) -> dict[str, int]:
    """Parameter, gradient and moment bytes of this rank after one more synced backward."""
    batch = tr.held_out_batch(list(range(2)))
    tr.update.begin_micro_batch(last=True)
    lm_sum, aux = tr.forward_loss(batch)
    tr.update.backward(lm_sum + aux)
    tr.update.finish()
    params = list(tr.model.parameters())
    out = {"params": local_storage_bytes(params), "grads": local_storage_bytes(p.grad for p in params),
           "optimizer state": local_storage_bytes(t for p in params for t in tr.update.optimizer.state[p].values()
                                             if t.dim() > 0)}
    tr.update.zero_grad()
    return out


def _rank(rank: int, port: int, size: str, rounds: int, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    trainers = {m: Trainer(load(None, [*MODEL[size], *COMMON, f"run.dir={root}/{m}", f"parallel.shard={m}"]))
                for m in MODES}
    times: dict[str, list] = {m: [] for m in MODES}
    for step in range(WARMUP + rounds):
        losses = {}
        for m, tr in trainers.items():
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            metrics = tr.train_step()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            losses[m] = metrics["loss"]
            if step >= WARMUP:
                times[m].append((wall, cpu))
        for m in MODES[1:]:
            assert abs(losses[m] - losses["none"]) <= 1e-5 * abs(losses["none"]), (step, losses)
    result = {"bytes": {m: _bytes(tr) for m, tr in trainers.items()}}
    cfg = trainers["full"].cfg
    model = rank_model(cfg, WORLD, EP, rank)
    for m in MODES:
        mode_cfg = load(None, [*MODEL[size], *COMMON, f"parallel.shard={m}"])
        est = estimate_memory(mode_cfg, model, no_decay_ids(model), WORLD, EP, "cpu")
        result.setdefault("estimate", {})[m] = {k: est.device[k] for k in ("params", "grads", "optimizer state")}
    # Four ranks on this machine's cores get at most cores/4 of one each: below half of that, starved.
    floor = 0.5 * min(1.0, (os.cpu_count() or 1) / WORLD)
    kept = {m: [w for w, c in times[m] if c / w >= floor] for m in MODES}
    result["step_s"] = {m: statistics.median(kept[m]) if kept[m] else None for m in MODES}
    result["rounds_kept"] = {m: len(kept[m]) for m in MODES}
    result["cpu_over_wall"] = {m: [round(c / w, 2) for w, c in times[m]] for m in MODES}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out-dir", default="bench/results")
    args = p.parse_args()
    size = "quick" if args.quick else "full"
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as root:
        out = os.path.join(root, "result.json")
        mp.spawn(_rank, args=(port, size, args.rounds, root, out), nprocs=WORLD)
        with open(out) as f:
            r = json.load(f)
    info = machine_info(torch.device("cpu"))
    command = "OMP_NUM_THREADS=1 python -m bench.shard_bytes" + (" --quick" if args.quick else "")
    result = {"command": command, "machine": info, "world_size": WORLD, "expert_parallel_size": EP,
              "model": MODEL[size], **r}
    lines = [f"# parallel.shard per-rank bytes, world {WORLD}, EP {EP} (gloo, CPU)", "",
             f"Command: `{command}`  ", f"Machine: {json.dumps(info)}", "",
             "Rank 0, bytes measured on the live storages (FSDP2's padding included) after a synced backward; "
             "the estimate is m6.memory.estimate's for the same rank.", "",
             "| setting | params | grads | AdamW moments | est. params | est. grads | est. moments | step s (median) |",
             "|---|---|---|---|---|---|---|---|"]
    for m in MODES:
        b, e = r["bytes"][m], r["estimate"][m]
        step = r["step_s"][m]
        lines.append(f"| {m} | {b['params']:,} | {b['grads']:,} | {b['optimizer state']:,} | {e['params']:,.0f} | "
                     f"{e['grads']:,.0f} | {e['optimizer state']:,.0f} | "
                     f"{'-' if step is None else f'{step:.3f}'} ({r['rounds_kept'][m]} rounds) |")
    lines += ["", f"CPU/wall per round (rank 0): {r['cpu_over_wall']}", "",
              "Losses of optimizer and full equal none's to 1e-5 on every step (checked in the run)."]
    write_results(args.out_dir, f"shard_bytes-{machine_tag(torch.device('cpu'))}" + ("-quick" if args.quick else ""),
                  result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
