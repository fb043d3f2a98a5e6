"""Loader throughput, and how long training waits for data, on the embedded sample corpus.

    python -m bench.data_loader [--rounds 5] [--batches 40] [--train-steps 40]

1. Samples/s of m6's loader (index -> read -> decode -> task -> collate, rank/worker-sharded) with
   0, 1 and 2 DataLoader workers, against the anchor: one process streaming the same tar shards
   sequentially with the standard-library reader (what a plain WebDataset-style pipeline does),
   through the same decode, task and collate. Interleaved rounds; median and [min-max].
2. data_wait_s / step_time_s of tiny-config training (configs/tiny.yaml) with 2 and 0 workers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.harness import machine_info, machine_tag, write_results
from m6.config import load
from m6.data.batch import collate
from m6.data.pipeline import build_training_data
from m6.data.sources import SkipCounter, decode_record, expand_shards, iter_tar_samples
from m6.data.tasks import TaskMix
from m6.train.loop import Trainer

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")


def time_m6_loader(num_workers: int, batches: int, micro_batch: int) -> float:
    """Samples/s of m6's TrainLoader at steady state (workers started and warmed up first)."""
    cfg = load(TINY, [f"data.num_workers={num_workers}", f"train.global_batch_size={micro_batch}"])
    loader = build_training_data(cfg, 0, 1).loader
    for _ in range(3):
        loader.next_step()
    t0 = time.perf_counter()
    for _ in range(batches):
        loader.next_step()
    dt = time.perf_counter() - t0
    loader.close()
    return batches * micro_batch / dt


def time_streaming_anchor(batches: int, micro_batch: int) -> float:
    """Samples/s of sequential tar streaming + the same decode/task/collate, in one process."""
    cfg = load(TINY)
    from m6.data.pipeline import build_tokenizer

    tokenizer = build_tokenizer(cfg)
    tasks = TaskMix(cfg.data.tasks, seed=0)
    shards = expand_shards(cfg.data.sources[0].path)
    image_shape = (3, cfg.model.image_size, cfg.model.image_size)
    skips = SkipCounter()

    def stream():
        while True:
            for shard in shards:
                yield from iter_tar_samples(shard, skips)

    records = stream()
    done = 0
    t0 = None
    for b in range(batches + 3):
        if b == 3:
            t0 = time.perf_counter()
        samples = []
        while len(samples) < micro_batch:
            rec = next(records)
            rng = np.random.default_rng([0, done])
            done += 1
            base = decode_record(rec, cfg.model.image_size, True, rng, skips)
            if base is not None:
                samples.append(tasks.build(base.image, base.target, rng))
        collate(samples, tokenizer, cfg.data.seq_len, image_shape)
    return batches * micro_batch / (time.perf_counter() - t0)


def training_wait(num_workers: int, steps: int, run_dir: Path) -> dict:
    cfg = load(TINY, [f"data.num_workers={num_workers}", f"train.max_steps={steps}", f"run.dir={run_dir}",
                      "train.eval_every=0", "checkpoint.every=0", "logging.console=false", "data.eval_samples=0"])
    history = Trainer(cfg).fit()[3:]  # the first steps include worker start-up and warm-up
    frac = [h["data_wait_s"] / h["step_time_s"] for h in history]
    return {"num_workers": num_workers, "steps": len(history),
            "data_wait_fraction_median": statistics.median(frac), "data_wait_fraction_max": max(frac),
            "data_wait_s_median": statistics.median(h["data_wait_s"] for h in history),
            "step_time_s_median": statistics.median(h["step_time_s"] for h in history)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--train-steps", type=int, default=40)
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = p.parse_args(argv)
    names = ["anchor_stream_1proc", "m6_workers0", "m6_workers1", "m6_workers2"]
    runs = {
        "anchor_stream_1proc": lambda: time_streaming_anchor(args.batches, args.micro_batch),
        "m6_workers0": lambda: time_m6_loader(0, args.batches, args.micro_batch),
        "m6_workers1": lambda: time_m6_loader(1, args.batches, args.micro_batch),
        "m6_workers2": lambda: time_m6_loader(2, args.batches, args.micro_batch),
    }
    rates: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            rates[name].append(runs[name]())
        print(f"round {r + 1}: " + ", ".join(f"{n} {rates[n][-1]:.0f}/s" for n in names), flush=True)
    anchor = rates["anchor_stream_1proc"]
    loader = {n: {"samples_per_s_median": statistics.median(v), "min": min(v), "max": max(v),
                  "ratio_vs_anchor_median": statistics.median(a / b for a, b in zip(v, anchor))}
              for n, v in rates.items()}
    run_root = Path("/tmp/m6-bench-data-loader")
    wait = [training_wait(w, args.train_steps, run_root / f"w{w}") for w in (2, 0)]
    device = torch.device("cpu")
    result = {"benchmark": "data_loader", "machine": machine_info(device), "args": vars(args),
              "loader": loader, "training_wait": wait}
    tag = machine_tag(device)
    lines = [f"# Data loader on {result['machine'].get('cpu_model')} ({tag})", "",
             f"Embedded sample (configs/tiny.yaml data), micro-batch {args.micro_batch}, {args.batches} batches per "
             f"measurement after 3 warm-up batches, {args.rounds} interleaved rounds.", "",
             "| loader | samples/s median [min-max] | vs anchor (paired median) |", "|---|---|---|"]
    for n, v in loader.items():
        lines.append(f"| {n} | {v['samples_per_s_median']:.0f} [{v['min']:.0f}-{v['max']:.0f}] | "
                     f"{v['ratio_vs_anchor_median']:.2f}x |")
    lines += ["", f"Training (tiny config, {args.train_steps} steps, first 3 dropped): time waiting for data", "",
              "| workers | data_wait / step_time median (max) | data_wait_s median | step_time_s median |",
              "|---|---|---|---|"]
    for w in wait:
        lines.append(f"| {w['num_workers']} | {100 * w['data_wait_fraction_median']:.2f}% "
                     f"({100 * w['data_wait_fraction_max']:.2f}%) | {w['data_wait_s_median']:.4f} | "
                     f"{w['step_time_s_median']:.3f} |")
    write_results(args.out, f"data_loader-{tag}", result, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
