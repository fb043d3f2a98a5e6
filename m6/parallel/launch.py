"""Process-group start-up from the launcher's environment (torchrun, deepspeed, Slurm via torchrun)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from m6.parallel.peer_check import register_host


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str


    @staticmethod
    def single_process() -> "DistEnv":
        """One process without torch.distributed: the trivial job."""
        return DistEnv(0, 1, 0, 1, "none")


def launched_distributed() -> bool:
    """True under torchrun / the deepspeed launcher (they export RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(timeout_s: int) -> DistEnv:
    """Join the job's process group: NCCL when CUDA is present, gloo otherwise.

    ``timeout_s`` bounds how long a collective waits for a peer, so a dead rank makes the others
    fail with an error instead of hanging forever.
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"distributed launch needs {', '.join(missing)} in the environment (use torchrun)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
            kwargs["device_id"] = torch.device("cuda", local_rank)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kwargs)
    register_host(rank)  # so that a survivor of this rank's death can name its host
    return DistEnv(rank, world, local_rank, local_world, backend)


def join_job(timeout_s: int) -> DistEnv:
    """The job this process belongs to: the launcher's process group when launched distributed
    (torchrun, deepspeed, Slurm via torchrun), else a single process."""
    return init_distributed(timeout_s) if launched_distributed() else DistEnv.single_process()
