"""Which checkpoint a run resumes from: config key checkpoint.resume turned into a path, and every
rank agreeing on it before any state is read."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from m6.checkpoint.errors import CheckpointError, CheckpointMismatch
from m6.checkpoint.manager import CheckpointManager
from m6.checkpoint.reader import newest_readable, not_a_step_directory
from m6.checkpoint.sharded_io import METADATA_FILE


def resolve_resume(resume: str | os.PathLike | None, manager: CheckpointManager,
                   log: Callable[[str], None] = print) -> Path | None:
    """Turn config key checkpoint.resume (None/"none"/"", "auto", or a path) into a checkpoint path.
    "auto": the latest readable checkpoint of the run dir (``log`` says what it skipped and why),
    None when there is none (a fresh start, which is what "auto" promises)."""
    resume = None if resume is None else os.fspath(resume)
    if resume is None or resume.strip().lower() in ("", "none"):
        return None
    if resume.strip().lower() == "auto":
        path, notes = newest_readable(manager.dir)
        for note in notes:
            log(f"checkpoint.resume=auto: {note}")
        if notes and path is not None:
            log(f"checkpoint.resume=auto: resuming from {path}, the newest readable checkpoint")
        return path
    path = Path(resume).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint.resume={resume!r}: {path} does not exist")
    if path.is_file() and path.name != METADATA_FILE:
        raise CheckpointMismatch(f"checkpoint.resume={resume!r}: {not_a_step_directory(path)}")
    if path.is_dir() and not (path / METADATA_FILE).is_file():
        raise CheckpointMismatch(
            f"checkpoint.resume={resume!r}: {path} is a directory without {METADATA_FILE}; point it at a "
            f"step directory (e.g. .../checkpoints/step_00000010), or use 'auto'"
        )
    return path


def agree_on_resume(path: Path | None, rank: int, world_size: int, group) -> Path | None:
    """Every rank resumes from the same checkpoint, or none does: checked by one collective (over
    ``group``) before any state is read. A rank that sees another checkpoint, or none, gets an
    error naming it, its host and both paths (typically: run.dir is not on a filesystem every
    node shares)."""
    if world_size == 1:
        return path
    mine = (rank, socket.gethostname(), None if path is None else str(path))
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    _, host0, path0 = everyone[0]
    for r, host, p in everyone[1:]:
        if p != path0:
            mine_text = f"checkpoint {p}" if p is not None else "no checkpoint"
            theirs = f"resumes from {path0}" if path0 is not None else "sees no checkpoint and starts fresh"
            raise CheckpointError(
                f"rank {r} (host {host}) sees {mine_text} but rank 0 (host {host0}) {theirs}: every rank must "
                f"resume from the same checkpoint. Put run.dir on a filesystem every node shares, or pass the "
                f"same checkpoint.resume=PATH to all ranks.")
    return path
