"""Spawn real gloo process groups for tests: one spawn runs many asserts (spawning costs seconds).
Also the plain gradient-sync reference the sync tests compare against."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world_size: int, port: int, timeout_s: float | None, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # N processes share 2 cores
    kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", rank=rank, world_size=world_size, **kwargs)
    try:
        fn(rank, world_size, *args)
    finally:
        if dist.is_initialized():  # fn may have torn it down itself (train.py's main does)
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout_s: float | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; re-raises a rank's failure.

    ``timeout_s``: every collective of the default group fails after that long (a mismatched or
    missing collective raises instead of hanging), and the whole run after four times that, its
    processes then terminated: a test of something that may hang fails within a bound.
    """
    context = mp.start_processes(_entry, args=(fn, world_size, free_port(), timeout_s, args), nprocs=world_size,
                                 join=False, start_method="spawn")
    deadline = None if timeout_s is None else time.monotonic() + 4 * timeout_s
    while not context.join(timeout=None if deadline is None else max(0.0, deadline - time.monotonic())):
        if deadline is not None and time.monotonic() >= deadline:
            for p in context.processes:
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"{world_size} ranks still running after {4 * timeout_s:.0f} s (hung collective?)")


def flat_bucket_sums(sync) -> dict[int, torch.Tensor]:
    """id(param) -> its gradient summed by the plain algorithm, with no overlap: each of the
    GradientSync's buckets, local gradients (zeros for a parameter without one) in one flat
    tensor, all-reduced over its group after backward."""
    out = {}
    for bucket in sync.buckets:
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket.params])
        dist.all_reduce(flat, group=bucket.group)
        for p, part in zip(bucket.params, flat.split([p.numel() for p in bucket.params])):
            out[id(p)] = part.view_as(p)
    return out
