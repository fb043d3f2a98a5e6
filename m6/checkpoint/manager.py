"""The checkpoint manager: owns run_dir/checkpoints. Sharded saves (optionally in the background),
atomic step directories, the ``latest`` pointer, retention and discovery.

Every rank writes its own part into ``.tmp-step_00000010`` in parallel; once all have written (the
metadata is the coordinator's last write) rank 0 renames it to ``step_00000010``, so a step
directory is complete by construction. A save can run in the background after the state is copied
to host memory (``asynchronous``: into the manager's staging buffer, allocated at the first such
save and reused); the next save, or ``wait``, finishes it first.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

import m6.checkpoint.sharded_io as sharded_io
from m6.checkpoint.errors import CheckpointError, CheckpointMismatch, RunDirNotShared, as_checkpoint_error, rank_label
from m6.checkpoint.reader import checkpoint_dir, read_checkpoint
from m6.checkpoint.sharded_io import Shards
from m6.checkpoint.staging import StagingBuffer
from m6.checkpoint.state_tree import check_loadable, flatten
from m6.checkpoint.step_dirs import (POINTER_FILE, TMP_PREFIX, complete_step_dirs, fsync_dir, latest_step_dir,
                                     step_dir_name)


@dataclass
class PendingSave:
    """A save writing in the background: where it goes once every rank has written."""

    step: int
    tmp: Path
    final: Path
    write: sharded_io.ShardedWrite
    started: float
    nbytes: int  # tensor bytes this rank holds in the state (what its files need, at most)
    asynchronous: bool


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint now in place, as rank 0 reports it."""

    step: int
    path: Path
    nbytes: int  # the files of every rank (one shared directory)
    seconds: float  # from the start of the save to the directory in place
    asynchronous: bool


def directory_bytes(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


class CheckpointManager:
    """Owns run_dir/checkpoints: sharded (optionally background) saves, atomic step directories,
    the ``latest`` pointer, retention and discovery.

    ``rank``: this process's global rank (rank 0 renames, points and prunes); ``group``: the
    process group DCP coordinates the save over (None with one process; a gloo group of its own
    under torch.distributed, so a background save never shares the training collectives' group).
    """

    def __init__(self, run_dir: str | Path, keep: int, rank: int = 0, group=None) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"checkpoint.keep must be an integer >= 1, got {keep!r}")
        self.dir = Path(run_dir) / "checkpoints"
        self.keep, self.rank, self.group = keep, rank, group
        self.pending: Optional[PendingSave] = None
        self.staging = StagingBuffer()  # host copy of this rank's state for asynchronous saves
        self.last_wait_s = 0.0  # how long the last save waited for the one before it
        self.on_saved: Optional[Callable[[SavedCheckpoint], None]] = None  # rank 0, each save in place

    def step_dir(self, step: int) -> Path:
        """Return the directory that holds (or will hold) the checkpoint for `step`."""
        return self.dir / step_dir_name(step)

    def save(self, step: int, state: dict, shards: Shards | None = None, asynchronous: bool = False) -> Path:
        """Write `state` (this rank's part; a collective) as the checkpoint for `step`. Synchronous:
        returns once it is in place (rank 0 repoints `latest` and prunes). Asynchronous: returns once
        the state is copied to host memory; a save still running is finished first."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"checkpoint step must be an integer >= 0, got {step!r}")
        self.last_wait_s = self._wait_timed()
        check_loadable(state)
        flat = flatten(state)
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.step_dir(step)
        tmp = self.dir / f"{TMP_PREFIX}{final.name}"  # the same on every rank: they write one directory
        nbytes = sum(v.numel() * v.element_size() for v in flat.values() if isinstance(v, torch.Tensor))
        try:
            write = sharded_io.write(tmp, flat, shards or {}, self.group, self.staging if asynchronous else None)
        except BaseException as e:
            error = self._write_failed(e, step, tmp, final, nbytes)
            if error is e:
                raise
            raise error from e
        self.pending = PendingSave(step, tmp, final, write, time.perf_counter(), nbytes, asynchronous)
        if not asynchronous:
            self.wait()
        return final

    def poll(self) -> Optional[Path]:
        """Commit a background save once every rank has written its files. A collective while a
        save is pending (one small all-reduce): every rank calls it at the same point, once per step."""
        if self.pending is not None and self.pending.write.all_written():
            return self.wait()
        return None

    def wait(self) -> Optional[Path]:
        """Block until the pending save is written by every rank and in place (a collective);
        returns its directory."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        try:
            pending.write.commit()
        except BaseException as e:
            error = self._write_failed(e, pending.step, pending.tmp, pending.final, pending.nbytes)
            if error is e:
                raise
            raise error from e
        self._finalize(pending.tmp, pending.final)
        if self.rank == 0 and self.on_saved is not None:
            self.on_saved(SavedCheckpoint(pending.step, pending.final, directory_bytes(pending.final),
                                          time.perf_counter() - pending.started, pending.asynchronous))
        return pending.final

    def _write_failed(self, e: BaseException, step: int, tmp: Path, final: Path, nbytes: int) -> BaseException:
        """Clean up after a failed write and say what happened: a full disk by name, with the space
        needed and free (the writer's own error is often cryptic then), and in every case what is
        and is not saved."""
        try:
            free = shutil.disk_usage(self.dir).free
        except OSError:
            free = None
        if self.rank == 0:  # a failed write must not leave gigabytes behind
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, RunDirNotShared):
            shutil.rmtree(tmp, ignore_errors=True)  # every rank: each sees its own partial directory
            return RunDirNotShared(
                f"checkpoint of step {step} not saved: {e}: run.dir ({self.dir.parent}) is not on a filesystem every "
                f"node shares. Set run.dir to a directory every node mounts: every rank writes its own part of each "
                f"checkpoint there")
        error = as_checkpoint_error(e, f"writing checkpoint {final}")
        if not isinstance(error, CheckpointError) or isinstance(error, CheckpointMismatch):
            return error
        previous = self.latest()
        saved = (f"Saved: {previous} (complete, loadable); not saved: the training after it, up to step {step}."
                 if previous is not None else f"Nothing of this run is saved yet (up to step {step}).")
        if _disk_full(e) or (free is not None and free < nbytes):
            free_text = f"{_gib(free)} free" if free is not None else "free space unknown"
            return CheckpointError(
                f"writing checkpoint {final} failed on rank {rank_label()}: the disk is full: {self.dir} had "
                f"{free_text} when the write failed, and this rank's share of the checkpoint needs up to "
                f"{_gib(nbytes)}. The partial checkpoint was removed. {saved} Free space there (or lower "
                f"checkpoint.keep, or move run.dir), then run again to resume.")
        return CheckpointError(f"{error} The partial checkpoint was removed. {saved}")

    def close(self) -> None:
        """Finish a background save, then wait for every rank to be done with the checkpoint group:
        no process may leave (and tear its connections down) while another still writes over it."""
        self.wait()
        if self.group is not None:
            dist.barrier(group=self.group)
        self.staging.release()

    def _wait_timed(self) -> float:
        if self.pending is None:
            return 0.0
        t0 = time.perf_counter()
        self.wait()
        return time.perf_counter() - t0

    def _finalize(self, tmp: Path, final: Path) -> None:
        """Rank 0, once every rank has written: the step directory appears atomically."""
        if self.rank != 0:
            return
        fsync_dir(tmp)
        if final.exists():
            # Re-saving a step (e.g. resumed from it): move the old one aside, since a directory
            # cannot be renamed onto a non-empty one; a crash here still leaves earlier steps.
            self._discard(final)
        os.replace(tmp, final)
        fsync_dir(self.dir)
        self._write_pointer(final.name)
        self._prune(keep_also=final)

    def sweep_temporaries(self) -> None:
        """Rank 0 at start-up, before any save: leftovers of crashed or failed saves go."""
        if self.rank != 0 or not self.dir.is_dir():
            return
        for path in self.dir.iterdir():
            if not path.name.startswith(TMP_PREFIX):
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()

    def latest(self) -> Path | None:
        """Return the checkpoint the pointer names, else the highest complete step, else None."""
        return latest_step_dir(self.dir)

    def list(self) -> list[Path]:
        """Return the complete checkpoint directories, oldest (lowest step) first."""
        return complete_step_dirs(self.dir)

    def resolve(self, path: str | Path | None = None) -> Path:
        """The checkpoint directory ``path`` names (its step dir or its metadata file); None: the latest."""
        if path is None:
            path = self.latest()
            if path is None:
                raise CheckpointError(f"no checkpoint to load: {self.dir} holds no complete checkpoint")
        return checkpoint_dir(path)

    def load(self, path: str | Path | None = None, targets: dict | None = None, shards: Shards | None = None) -> dict:
        """Read a checkpoint (a collective when this manager has a group). ``targets``: the nested
        state to fill (tensors in place, this rank's rows of ``shards``; python values replaced);
        None reads everything whole (for what fits in memory). Returns the nested state read."""
        return read_checkpoint(self.resolve(path), targets, shards, self.group)

    def _write_pointer(self, name: str) -> None:
        tmp = self.dir / f"{TMP_PREFIX}{POINTER_FILE}-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / POINTER_FILE)
        fsync_dir(self.dir)

    def _prune(self, keep_also: Path) -> None:
        # Never prune the checkpoint just written, even when stale higher steps from an abandoned
        # branch of the run (resumed from an earlier step) sort after it.
        older = [p for p in self.list() if p != keep_also]
        for path in older[: max(0, len(older) - (self.keep - 1))]:
            self._discard(path)

    def _discard(self, path: Path) -> None:
        # Rename first so a crash mid-delete never leaves a half-removed dir that looks complete.
        trash = self.dir / f"{TMP_PREFIX}trash-{path.name}-{os.getpid()}"
        if trash.exists():
            shutil.rmtree(trash)
        os.replace(path, trash)
        shutil.rmtree(trash)


def _disk_full(e: BaseException) -> bool:
    """ENOSPC anywhere in the chain of ``e`` (DCP wraps each rank's failure)."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if getattr(x, "errno", None) == 28 or "No space left on device" in str(x):
            return True
        todo += [x.__cause__, x.__context__]
        for failure in getattr(x, "failures", {}).values():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return False


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"
