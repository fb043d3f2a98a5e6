"""Benchmarks that measure inside training ranks: ``run_ranks(measure, world)`` runs
``measure(rank, world, root)`` on ``world`` local processes with the environment torchrun gives its
workers (the Trainer in them joins one gloo group), and returns every rank's rows in rank order."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, port: int, root: str, measure: Callable, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # one core's worth per rank on the machine's cores
    rows = measure(rank, world, root)
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            queue.put(gathered)
        dist.barrier()
    else:
        queue.put([rows])
    # Leave as train.py's workers do: no process-group teardown or C++ static destructors (where a
    # finished rank sometimes aborted).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(measure: Callable, world: int, prefix: str = "m6-bench-") -> list:
    """``measure(rank, world, root)`` (picklable: a module-level function or a partial of one) on
    ``world`` spawned ranks, ``root`` a fresh temporary directory for their runs; each rank's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    root = tempfile.mkdtemp(prefix=prefix)
    mp.start_processes(_worker, args=(world, port, root, measure, queue), nprocs=world, join=True,
                       start_method="spawn")
    return queue.get()
