"""What bench.plan_validation measures inside each torchrun worker: a real m6 Trainer's step time
and peak live tensor bytes, and the gloo link (latency, bandwidth) the planner's prediction uses.

Run by bench.plan_validation under torchrun (gloo, CPU); not meant to be started by hand.

Peak tensor bytes of one step (per rank): the high-water mark over ``train_step`` of the live
tensor storages, counted by m6.memory.live_bytes.LiveBytes from every storage alive at the step's
start (``gc`` walk, each storage once: weights, AdamW moments, offload masters and gradient
buffers, model buffers, pipeline receive buffers) and those the step allocates (activations,
gradients, buckets, all-to-all payloads, the update's temporaries, the step's batch), each
uncounted once freed: a storage of the step before that this one frees (the last batch, a pipeline
schedule's buffers it replaces or clears) does not count past its free. Process RSS is not used: it
holds the Python/torch runtime and whatever the allocator kept.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from m6.config import load
from m6.data.batch import Sample
from m6.memory.live_bytes import LiveBytes

BASE_CONFIG = "configs/tiny.yaml"
# No eval, no checkpoints, no console: the step is all a run does. fp32 (auto on CPU is fp32).
# Synchronous saves: the measured steps come before any save, so no checkpoint staging buffer
# exists yet, and the planner's prediction must not count one.
COMMON = ["data.kind=synthetic", "data.sources=[]", "data.num_workers=0", "data.eval_samples=0",
          "train.precision=fp32", "train.eval_every=0", "train.max_steps=100000", "checkpoint.every=0",
          "checkpoint.async_save=false",
          "logging.console=false", "logging.wandb.enabled=false", "train.device=cpu"]
LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", dtype=np.uint8)


class DenseSamples:
    """Full-length samples: an image in every row and a target filling the text (source empty, so
    BOS SEP t_1..t_{L-2}: no padding, labels at L-2 of the L positions, one fewer than the densest
    batch the planner sizes for). Random letters, so the router spreads them over the experts."""

    def __init__(self, num: int, seq_len: int, image_shape: tuple[int, int, int], seed: int = 0) -> None:
        self.num, self.seq_len, self.image_shape, self.seed = num, seq_len, image_shape, seed

    def __len__(self) -> int:
        return self.num

    def __getitem__(self, i: int) -> Sample:
        rng = np.random.default_rng((self.seed, i))
        image = rng.standard_normal(self.image_shape, dtype=np.float32)
        target = rng.choice(LETTERS, size=self.seq_len).tobytes().decode()
        return Sample(image, "", target)


def offload_host_bytes(trainer) -> int:
    """Bytes of the offload's host-side storages, each once: fp32 masters and any .grad on them,
    the gradient buffers (both sets with the delayed update), the optimizer state, the streamed
    blocks' homes and the 16-bit copy-back staging (0 without memory.offload; private attributes:
    bench only). On this CPU the rest of the step's live bytes are what a GPU run keeps on the device."""
    off, opt = trainer.update.offload, trainer.update.optimizer
    if off is None:
        return 0
    masters = list(off.masters.values())
    tensors = masters + [m.grad for m in masters if m.grad is not None] + list(off._grad_buffers.values())
    tensors += list((off._spare_grad_buffers or {}).values())
    tensors += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    tensors += list(off.streamer.homes().values()) if off.streamer is not None else []
    tensors += [b for b in off._half_push._buffers if b is not None] if off._half_push is not None else []
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def live_storages() -> list[torch.UntypedStorage]:
    """Every distinct tensor storage reachable from Python now (after a full gc)."""
    gc.collect()
    seen: dict[int, torch.UntypedStorage] = {}
    with warnings.catch_warnings():  # isinstance touches deprecated module attributes among gc's objects
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        try:
            if obj.is_meta:
                continue
            s = obj.untyped_storage()
            if s.nbytes():
                seen[s.data_ptr()] = s
        except (RuntimeError, ReferenceError):
            # Tensors without a storage of their own: sparse, functional wrappers, FSDP2's DTensor
            # parameters (their local shards are tensors of their own, counted as such).
            continue
    return list(seen.values())


def live_storage_bytes() -> int:
    """Bytes of every distinct tensor storage reachable from Python now (after a full gc)."""
    return sum(s.nbytes() for s in live_storages())


# At pipeline parallel the schedule runs every forward and backward, and the update's finish.
PIPELINE_PHASE = "pipeline schedule (forward + backward, bubble, p2p, finish)"


class PhaseClock:
    """Wall seconds spent in a few of the trainer's calls during the timed steps (instance
    attributes shadow the methods; removed after), to tell where a step's time goes. At pipeline
    parallel the trainer's forward_loss and the update's backward are not called: the pipeline's
    step (PIPELINE_PHASE) is timed as well, the update's finish inside it."""

    PHASES = {"forward": ("trainer", "forward_loss"), "backward": ("update", "backward"),
              "finish (grad sync wait, offload)": ("update", "finish"), "clip": ("update", "clip"),
              "update": ("update", "step")}

    def __init__(self, trainer) -> None:
        self.owners = {"trainer": trainer, "update": trainer.update}
        self.phases = dict(self.PHASES)
        if getattr(trainer, "pipeline", None) is not None:
            self.owners["pipeline"] = trainer.pipeline
            self.phases[PIPELINE_PHASE] = ("pipeline", "step")
        self.seconds = {name: 0.0 for name in self.phases}

    def _timed(self, name: str, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
        return run

    def __enter__(self) -> "PhaseClock":
        for name, (owner, attr) in self.phases.items():
            obj = self.owners[owner]
            setattr(obj, attr, self._timed(name, getattr(obj, attr)))
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr in self.phases.values():
            delattr(self.owners[owner], attr)


class AllToAllClock:
    """Wall seconds and calls of every ``torch.distributed.all_to_all_single`` during the timed steps
    (m6's exchange calls it through the module attribute, which this replaces while entered): what
    the run's all-to-alls cost, waiting for the other ranks included, beside the planner's term."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def __enter__(self) -> "AllToAllClock":
        self._original = original = dist.all_to_all_single

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        dist.all_to_all_single = timed
        return self

    def __exit__(self, *exc) -> None:
        dist.all_to_all_single = self._original


def run_plan(overrides: list[str], warmup: int, steps: int, out_dir: Path) -> None:
    """Warm-up + timed steps, then one metered step; this rank's figures to out_dir/rank{r}.json."""
    from m6.train.loop import Trainer  # the worker imports the trainer; the prediction side never does

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load(BASE_CONFIG, [*COMMON, *overrides, f"run.dir={tmp}/run"])
        m = cfg.model
        data = DenseSamples(cfg.train.global_batch_size * (warmup + steps + 2), cfg.data.seq_len,
                            (m.image_channels, m.image_size, m.image_size), cfg.run.seed)
        trainer = Trainer(cfg, dataset=data)
        loads = [os.getloadavg()[0]]
        for _ in range(warmup):
            trainer.train_step()
        times, waits = [], []
        t0, c0 = time.perf_counter(), time.process_time()
        with PhaseClock(trainer) as clock, AllToAllClock() as a2a:
            for _ in range(steps):
                metrics = trainer.train_step()
                times.append(metrics["step_time_s"])
                waits.append(metrics["data_wait_s"])
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        loads.append(os.getloadavg()[0])
        storages = live_storages()
        at_start, host_at_start = sum(s.nbytes() for s in storages), offload_host_bytes(trainer)
        live = LiveBytes()
        live.include(storages)  # freed during the step (the last step's batch, buffers replaced): no longer counted
        del storages
        with live:
            metrics = trainer.train_step()
        rank = trainer.rank
        saved = metrics.get("activation_saved_mb")
        result = {"rank": rank, "step_time_s": times, "data_wait_s": waits, "median_step_s": statistics.median(times),
                  "timed_wall_s": wall, "timed_cpu_s": cpu,
                  "phase_s_per_step": {k: v / steps for k, v in clock.seconds.items()},
                  "all_to_all_s_per_step": a2a.seconds / steps, "all_to_all_calls_per_step": a2a.calls / steps,
                  "load_1min": loads, "threads": torch.get_num_threads(),
                  "live_at_step_start": at_start, "step_alloc_peak": live.peak - at_start, "peak_bytes": live.peak,
                  "host_bytes": host_at_start, "device_peak_bytes": live.peak - host_at_start,
                  "activation_saved_bytes": None if saved is None else saved * 2**20,
                  "recompute_plan": None if trainer.activations.plan is None else
                  sorted(trainer.activations.plan.recompute)}
        if trainer.world_size > 1:
            dist.barrier()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


def probe_collectives(sizes: list[int], reps: int) -> dict:
    """Mean seconds of all_reduce (fp32, ``n`` bytes per rank), all_to_all (``n`` bytes sent by
    each rank, (W-1)/W of them to others), and FSDP2's all_gather_into_tensor and
    reduce_scatter_tensor (``n`` bytes gathered / reduced, a 1/W shard in or out) at each size,
    issued as a step issues them, over the default process group; every rank returns the same
    figures.

    As in a step, each call moves freshly made tensors: the all-to-all through m6's own exchange
    (m6.moe.all_to_all.all_to_all: uneven-split API, a new receive buffer per call), the
    all-reduce on a new flat buffer (the gradient sync all-reduces a bucket's fresh ``torch.cat``).
    A barrier before each call leaves the ranks' arrival out (the planner's CPU profile keeps the
    run's lockstep and holds that). The MEAN per call, the slowest rank's, is what is fitted: a
    step pays the sum of its calls, and on a shared host a call's time has a tail (a thread
    waiting for a core) that the median (kept beside it, under "median") hides; with the median
    of back-to-back calls on reused buffers the planner under-predicted every world-2
    expert-parallel step here by 15-18% (bench/results/plan-notes.md)."""
    from m6.moe.all_to_all import all_to_all  # the worker's side; the prediction imports no process group

    world = dist.get_world_size()
    group = dist.group.WORLD
    ops_timed = ("all_reduce", "all_to_all", "all_gather", "reduce_scatter")
    out = {"world_size": world, "statistic": "mean", **{op: {} for op in ops_timed},
           "median": {op: {} for op in ops_timed}}  # beside the mean, to show the tail
    for nbytes in sizes:
        rows = nbytes // 4 // 64 // world * world  # [rows, 64] fp32, an equal share to each rank
        splits = [rows // world] * world
        whole = rows * 64
        # FSDP2's collectives (parallel.shard), keyed like the others by the whole tensor's bytes:
        # a shard gathered into a new flat buffer, a new flat buffer reduce-scattered into one.
        ops = (("all_reduce", lambda: torch.randn(whole), dist.all_reduce),
               ("all_to_all", lambda: torch.randn(rows, 64), lambda x: all_to_all(x, splits, splits, group)),
               ("all_gather", lambda: torch.randn(whole // world),
                lambda x: dist.all_gather_into_tensor(torch.empty(whole), x)),
               ("reduce_scatter", lambda: torch.randn(whole),
                lambda x: dist.reduce_scatter_tensor(torch.empty(whole // world), x)))
        for name, make, op in ops:
            times = []
            for i in range(reps + 2):
                x = make()  # what the compute hands the collective
                dist.barrier()
                t0 = time.perf_counter()
                op(x)
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            # The slowest rank's time is the collective's.
            t = torch.tensor([statistics.fmean(times), statistics.median(times)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out[name][str(rows * 64 * 4)], out["median"][name][str(rows * 64 * 4)] = t.tolist()
    return out


def probe_link(out_dir: Path, sizes: list[int], reps: int) -> None:
    """``probe_collectives`` under torchrun; rank 0 writes probe.json."""
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = probe_collectives(sizes, reps)
    if dist.get_rank() == 0:
        out["load_1min"] = os.getloadavg()[0]
        (out_dir / "probe.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--probe", action="store_true")
    p.add_argument("--sizes", default="16384,262144,1048576,4194304")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    out = Path(args.out)
    if args.probe:
        probe_link(out, [int(s) for s in args.sizes.split(",")], args.reps)
    else:
        run_plan(args.overrides, args.warmup, args.steps, out)


if __name__ == "__main__":
    main()
