"""Spawn real gloo process groups for tests: one spawn runs many asserts (starting ranks costs
seconds). Also the plain gradient-sync reference the sync tests compare against.

Ranks start from a fork server that has imported torch and m6 once for the whole session: a fresh
interpreter per rank would import them again (3-5 s of CPU each on 2 cores, most of a short dist
test). The server is forked before any test computes, so no OpenMP pool or gloo thread is copied;
each rank still gets a fresh process group, its own RNG seeding and the test's own environment
(ranks set what they need themselves).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from m6.memory import cpu_info_once as cpuinfo_once

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported by the fork server before it forks ranks; the test modules themselves (and anything
# they import on top) are imported by each rank as a spawned rank would.
_PRELOAD = ["torch", "torch.distributed", "numpy", "m6.config", "m6.model", "m6.moe", "m6.parallel",
            "m6.train.loop", "m6.checkpoint.manager", "m6.memory", "m6.data"]
_context = mp.get_context("forkserver")
_context.set_forkserver_preload(_PRELOAD)


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


def _with_cpu_info(rank: int, entry, cpu_info: dict | None, args: tuple) -> None:
    cpuinfo_once.install(cpu_info)
    entry(rank, *args)


def _start(entry, world_size: int, args: tuple, limit_s: float | None) -> None:
    """Run ``entry(rank, *args)`` on ``world_size`` ranks from the fork server; re-raises a rank's
    failure; with ``limit_s``, terminates the ranks and raises after that long. Each rank gets the
    session's py-cpuinfo answer (m6/memory/cpu_info_once.py) instead of waiting a second for its own."""
    context = mp.start_processes(_with_cpu_info, args=(entry, cpuinfo_once.answer(), args), nprocs=world_size,
                                 join=False, start_method="forkserver")
    deadline = None if limit_s is None else time.monotonic() + limit_s
    while not context.join(timeout=None if deadline is None else max(0.0, deadline - time.monotonic())):
        if deadline is not None and time.monotonic() >= deadline:
            for p in context.processes:
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"{world_size} ranks still running after {limit_s:.0f} s (hung collective?)")


def run_distributed(fn, world_size: int, *args, timeout_s: float | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; re-raises a rank's failure.

    ``timeout_s``: every collective of the default group fails after that long (a mismatched or
    missing collective raises instead of hanging), and the whole run after four times that, its
    processes then terminated: a test of something that may hang fails within a bound.
    """
    _start(_entry, world_size, (fn, world_size, free_port(), timeout_s, args), None if timeout_s is None else 4 * timeout_s)


@dataclass
class RankResult:
    """What one rank's ``main`` returned and printed."""

    code: int
    stdout: str
    stderr: str


def _train_entry(rank: int, world_size: int, local_world_size: int, port: int, argv: list[str], out_dir: str) -> None:
    torch.set_num_threads(1)  # N processes share 2 cores
    if world_size > 1:  # what torchrun sets; world 1 runs as a plain `python train.py` does
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % local_world_size),
                          LOCAL_WORLD_SIZE=str(local_world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from m6.train.cli import main

    out, err, code = io.StringIO(), io.StringIO(), -1  # -1: main raised (the exception reaches the test)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
            {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}))


def train_ranks(world_size: int, argv: list[str], limit_s: float = 240,
                local_world_size: int | None = None) -> list[RankResult]:
    """m6's training entry point (train.py's ``main``) on ``world_size`` ranks with the environment
    torchrun gives its workers, without torchrun's agents and fresh interpreters (the launchers
    themselves are tested in tests/dist/test_train_world_sizes.py and tests/smoke).
    ``local_world_size``: ranks per "node" (default all on one), as LOCAL_WORLD_SIZE says.
    Returns each rank's exit code and output; an exception a rank raises is re-raised here."""
    local = local_world_size or world_size
    with tempfile.TemporaryDirectory() as out_dir:
        _start(_train_entry, world_size, (world_size, local, free_port(), list(argv), out_dir), limit_s)
        return [RankResult(**json.loads(Path(out_dir, f"rank{r}.json").read_text())) for r in range(world_size)]


def same_on_all_ranks(values: list[float]) -> bool:
    """Whether every rank of the default group holds exactly ``values`` (a collective: every rank
    calls it with as many values)."""
    t = torch.tensor(values, dtype=torch.float64)
    low, high = t.clone(), t.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return torch.equal(low, high)


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
