"""Training checkpoints: sharded state on DCP (m6.train.sharded_io), RNG capture, and atomic step
directories.

Layout: ``run_dir/checkpoints/step_00000010/`` holding DCP's files (one data file per rank and the
``.metadata`` index) plus a ``latest`` pointer file naming the newest step directory. Every rank
writes its own part into ``.tmp-step_00000010`` in parallel; once all have written (the metadata
is the coordinator's last write) rank 0 renames it to ``step_00000010``, so a step directory is
complete by construction. A save can run in the background after the state is copied to host
memory (``asynchronous``); the next save, or ``wait``, finishes it first.

A state is a nested dict of string keys whose leaves are tensors or python values; expert shards
(``shards``, flattened keys) are this rank's rows of global tensors.
"""

from __future__ import annotations

import collections
import os
import random
import re
import shutil
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from m6.parallel.peer_check import is_peer_failure
from m6.train import sharded_io
from m6.train.sharded_io import METADATA_FILE, Shards
POINTER_FILE = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Everything the manager writes that is not yet (or no longer) a checkpoint starts with this prefix,
# so discovery ignores it and the next save can sweep it away.
_TMP_PREFIX = ".tmp-"
_MAX_LISTED_DIFFS = 5


class CheckpointError(RuntimeError):
    """A user-facing checkpoint problem; the message names the file or config key and what is wrong."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint named cannot continue this run: not an m6 checkpoint, or saved for another
    model, data or optimizer setup (bad input: train.py exits 2, like a config error)."""


# --------------------------------------------------------------------------- RNG state


def rng_state() -> dict:
    """Capture the python, numpy, torch CPU and (when available) all CUDA generator states."""
    np_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        # numpy's key is a uint32 ndarray, which weights_only loading refuses; a tensor round-trips.
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    """Restore generator states captured by `rng_state` so random draws continue identically."""
    missing = [k for k in ("python", "numpy", "torch", "cuda") if k not in state]
    if missing:
        raise ValueError(f"rng state is missing {missing}; expected the dict returned by rng_state()")
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": np_state["bit_generator"],
            "state": {"key": np_state["key"].cpu().numpy().astype(np.uint32), "pos": np_state["pos"]},
            "has_gauss": np_state["has_gauss"],
            "gauss": np_state["gauss"],
        }
    )
    # .cpu(): a checkpoint loaded with map_location="cuda" moves these too, but generators want CPU bytes.
    torch.set_rng_state(state["torch"].cpu())
    _set_cuda_rng_state(state["cuda"])


def _set_cuda_rng_state(saved: list[torch.Tensor] | None) -> None:
    """Restore CUDA generators for the devices present both now and at save time."""
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if saved is None:
        if available:
            warnings.warn("checkpoint has no CUDA rng state (saved without CUDA); CUDA draws will differ")
        return
    # Resuming on a machine with a different GPU count is legitimate, so warn rather than refuse.
    if len(saved) != available:
        warnings.warn(
            f"checkpoint has CUDA rng state for {len(saved)} device(s) but {available} are visible; "
            f"restoring the first {min(len(saved), available)}"
        )
    for device, device_state in enumerate(saved[:available]):
        torch.cuda.set_rng_state(device_state.cpu(), device)


# --------------------------------------------------------------------------- state file I/O

# Exactly the types torch.load(weights_only=True) rebuilds; checked at save time so a bad value fails
# the save that wrote it (naming its key) instead of the resume hours later.
_LEAF_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.Size, torch.dtype, torch.device)
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_CONTAINER_TYPES = (dict, collections.OrderedDict, list, tuple, set)


def _find_unloadable(obj: Any, path: str) -> str | None:
    """Return the key path and type of the first value weights_only loading would refuse, else None."""
    if type(obj) in _LEAF_TYPES or type(obj) in _TENSOR_TYPES:
        return None
    if type(obj) not in _CONTAINER_TYPES:
        return f"{path}: {type(obj).__module__}.{type(obj).__qualname__}"
    if isinstance(obj, dict):
        items = ((f"{path}[{k!r}]", v) for k, v in obj.items())
        keys = ((f"{path} key {k!r}", k) for k in obj)
        for sub_path, value in (*keys, *items):
            found = _find_unloadable(value, sub_path)
            if found:
                return found
        return None
    for i, value in enumerate(obj):
        found = _find_unloadable(value, f"{path}[{i}]")
        if found:
            return found
    return None


def check_loadable(state: dict) -> None:
    """Refuse, naming its key, a value that torch.load(weights_only=True) could not read back."""
    bad = _find_unloadable(state, "state")
    if bad:
        raise TypeError(
            f"cannot checkpoint {bad}: only tensors, python primitives, dicts, lists, tuples and sets "
            "are saved (so checkpoints load with torch.load(weights_only=True)); convert it first"
        )


SEP = "/"  # joins nested keys in the flat DCP key space (module names already use ".")


def flatten(state: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dicts with string keys -> one flat dict; anything else is a leaf."""
    flat = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and all(isinstance(k, str) and SEP not in k for k in value):
            flat.update(flatten(value, name + SEP))
        else:
            flat[name] = value
    return flat


def unflatten(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split(SEP)
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


# --------------------------------------------------------------------------- step directories


def _fsync_dir(path: Path) -> None:
    """Make renames and new entries in `path` durable; directories cannot be fsynced on Windows."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_of(path: Path) -> int | None:
    """Return the step number encoded in a step directory name, or None for anything else."""
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


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
        self.last_wait_s = 0.0  # how long the last save waited for the one before it
        self.on_saved: Optional[Callable[[SavedCheckpoint], None]] = None  # rank 0, each save in place

    def step_dir(self, step: int) -> Path:
        """Return the directory that holds (or will hold) the checkpoint for `step`."""
        return self.dir / f"step_{step:08d}"

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
        tmp = self.dir / f"{_TMP_PREFIX}{final.name}"  # the same on every rank: they write one directory
        nbytes = sum(v.numel() * v.element_size() for v in flat.values() if isinstance(v, torch.Tensor))
        try:
            write = sharded_io.write(tmp, flat, shards or {}, self.group, asynchronous)
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
        error = _as_checkpoint_error(e, f"writing checkpoint {final}")
        if not isinstance(error, CheckpointError) or isinstance(error, CheckpointMismatch):
            return error
        previous = self.latest()
        saved = (f"Saved: {previous} (complete, loadable); not saved: the training after it, up to step {step}."
                 if previous is not None else f"Nothing of this run is saved yet (up to step {step}).")
        if _disk_full(e) or (free is not None and free < nbytes):
            free_text = f"{_gib(free)} free" if free is not None else "free space unknown"
            return CheckpointError(
                f"writing checkpoint {final} failed on rank {_rank_label()}: the disk is full: {self.dir} had "
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
        _fsync_dir(tmp)
        if final.exists():
            # Re-saving a step (e.g. resumed from it): move the old one aside, since a directory
            # cannot be renamed onto a non-empty one; a crash here still leaves earlier steps.
            self._discard(final)
        os.replace(tmp, final)
        _fsync_dir(self.dir)
        self._write_pointer(final.name)
        self._prune(keep_also=final)

    def sweep_temporaries(self) -> None:
        """Rank 0 at start-up, before any save: leftovers of crashed or failed saves go."""
        if self.rank != 0 or not self.dir.is_dir():
            return
        for path in self.dir.iterdir():
            if not path.name.startswith(_TMP_PREFIX):
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()

    def latest(self) -> Path | None:
        """Return the checkpoint the pointer names, else the highest complete step, else None."""
        try:
            name = (self.dir / POINTER_FILE).read_text().strip()
        except OSError:
            name = ""
        # A pointer can be missing (crash before its first write) or stale (its dir deleted by hand).
        if _STEP_DIR.match(name) and self._is_complete(self.dir / name):
            return self.dir / name
        complete = self.list()
        return complete[-1] if complete else None

    def list(self) -> list[Path]:
        """Return the complete checkpoint directories, oldest (lowest step) first."""
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.iterdir() if _step_of(p) is not None and self._is_complete(p)]
        return sorted(found, key=_step_of)

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

    def _is_complete(self, path: Path) -> bool:
        # A step dir only appears by renaming a fully written temp dir, so its name is the marker.
        return path.is_dir() and (path / METADATA_FILE).is_file()

    def _write_pointer(self, name: str) -> None:
        tmp = self.dir / f"{_TMP_PREFIX}{POINTER_FILE}-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / POINTER_FILE)
        _fsync_dir(self.dir)

    def _prune(self, keep_also: Path) -> None:
        # Never prune the checkpoint just written, even when stale higher steps from an abandoned
        # branch of the run (resumed from an earlier step) sort after it.
        older = [p for p in self.list() if p != keep_also]
        for path in older[: max(0, len(older) - (self.keep - 1))]:
            self._discard(path)

    def _discard(self, path: Path) -> None:
        # Rename first so a crash mid-delete never leaves a half-removed dir that looks complete.
        trash = self.dir / f"{_TMP_PREFIX}trash-{path.name}-{os.getpid()}"
        if trash.exists():
            shutil.rmtree(trash)
        os.replace(path, trash)
        shutil.rmtree(trash)


def _as_checkpoint_error(e: BaseException, doing: str) -> BaseException:
    """Keep user-facing errors as they are, and a peer's death (train.py names the dead rank); say
    what was being done for the rest."""
    if isinstance(e, (CheckpointError, TypeError, KeyboardInterrupt)) or is_peer_failure(e):
        return e
    reason = (str(e).strip().splitlines() or [""])[0][:300]
    return CheckpointError(f"{doing} failed on rank {_rank_label()}: {type(e).__name__}: {reason}")


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


def _rank_label() -> str:
    return f"{os.environ.get('RANK', '0')} (host {socket.gethostname()})"


def _not_a_step_directory(path: Path) -> str:
    """What a file given where an m6 checkpoint is expected is, as far as its first bytes tell."""
    with open(path, "rb") as f:
        head = f.read(4)
    kind = ("a torch.save file (e.g. a bare state_dict)" if head[:2] == b"PK" or head[:1] == b"\x80"
            else "a file")
    return (f"{path} is {kind}, not an m6 checkpoint: m6 checkpoints are step directories "
            f"(RUN_DIR/checkpoints/step_NNNNNNNN) written by m6's sharded save. To start from other weights, "
            f"convert them into an m6 checkpoint first, or use checkpoint.resume=none")


def checkpoint_dir(path: str | Path) -> Path:
    """The step directory of a checkpoint given the directory or its metadata file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_file() and path.name == METADATA_FILE:
        path = path.parent
    if path.is_file():
        raise CheckpointMismatch(_not_a_step_directory(path))
    if not (path / METADATA_FILE).is_file():
        raise CheckpointMismatch(
            f"checkpoint {path} has no {METADATA_FILE}: an incomplete save, not a step directory, or not an m6 "
            f"checkpoint")
    return path


def find_checkpoint(path: str | Path) -> Path:
    """The step directory ``path`` names: a step directory or its metadata file, or a run directory
    or its ``checkpoints`` directory (then the latest complete checkpoint there)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_file() or (path / METADATA_FILE).is_file():
        return checkpoint_dir(path)
    run = path.parent if path.name == "checkpoints" else path
    if (run / "checkpoints").is_dir():
        latest = CheckpointManager(run, keep=1).latest()
        if latest is None:
            raise CheckpointError(f"{run / 'checkpoints'} holds no complete checkpoint (no step_* directory with a "
                                  f"{METADATA_FILE})")
        return latest
    return checkpoint_dir(path)  # says what is missing


def load_metadata(path: Path):
    """The DCP metadata of the checkpoint directory ``path``, or a CheckpointError saying it is unreadable."""
    try:
        return sharded_io.read_metadata(path)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: its {METADATA_FILE} is corrupt, truncated or not "
                              f"an m6 checkpoint ({type(e).__name__}: {str(e)[:200]})") from e


def _whole_targets(metadata, prefix: str = "") -> dict[str, Any]:
    """The checkpoint's keys under ``prefix``, read whole: tensors allocated at their global shape,
    python values None."""
    flat: dict[str, Any] = {k: torch.empty(md.size, dtype=md.properties.dtype)
                            for k, md in sharded_io.tensor_keys(metadata).items() if k.startswith(prefix)}
    flat.update({k: None for k in sharded_io.value_keys(metadata) if k.startswith(prefix)})
    return flat


def read_checkpoint(path: Path, targets: dict | None = None, shards: Shards | None = None, group=None) -> dict:
    """Read the checkpoint directory ``path`` (see CheckpointManager.load)."""
    metadata = load_metadata(path)
    if targets is None:
        flat = _whole_targets(metadata)
    else:
        flat = {}
        for key, value in flatten(targets).items():
            # None asks for a whole saved value, which the save may have split into sub-keys.
            nested = _whole_targets(metadata, key + SEP) if value is None else {}
            flat.update(nested or {key: value})
        missing = [k for k in flat if k not in metadata.state_dict_metadata]
        if missing:
            shown = ", ".join(missing[:_MAX_LISTED_DIFFS]) + (" ..." if len(missing) > _MAX_LISTED_DIFFS else "")
            raise CheckpointError(f"checkpoint {path} lacks {len(missing)} entr{'y' if len(missing) == 1 else 'ies'} "
                                  f"this run needs: {shown}")
    try:
        sharded_io.read(path, flat, shards or {}, group)
    except (Exception, CheckpointException) as e:  # DCP's own error is a BaseException
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"cannot read checkpoint {path}: it is corrupt, truncated or not an m6 checkpoint "
                              f"({type(e).__name__}: {reason})") from e
    return unflatten(flat)


# --------------------------------------------------------------------------- resume helpers


def resolve_resume(resume: str | os.PathLike | None, manager: CheckpointManager) -> Path | None:
    """Turn config key checkpoint.resume (None/"none"/"", "auto", or a path) into a checkpoint path."""
    resume = None if resume is None else os.fspath(resume)
    if resume is None or resume.strip().lower() in ("", "none"):
        return None
    if resume.strip().lower() == "auto":
        return manager.latest()  # None means a fresh start, which is what "auto" promises
    path = Path(resume).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint.resume={resume!r}: {path} does not exist")
    if path.is_file() and path.name != METADATA_FILE:
        raise CheckpointMismatch(f"checkpoint.resume={resume!r}: {_not_a_step_directory(path)}")
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


def _describe_differences(model_sd: dict, ckpt_sd: dict) -> list[str]:
    """List shape mismatches, then keys missing from and unexpected in the checkpoint."""
    diffs = []
    for key, value in model_sd.items():
        other = ckpt_sd.get(key)
        if isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor) and value.shape != other.shape:
            diffs.append(f"{key}: checkpoint {list(other.shape)} vs model {list(value.shape)}")
    diffs += [f"missing in checkpoint: {key}" for key in model_sd if key not in ckpt_sd]
    diffs += [f"unexpected in checkpoint: {key}" for key in ckpt_sd if key not in model_sd]
    return diffs


def load_model_state(model: torch.nn.Module, state_dict: dict, source: str) -> None:
    """Load `state_dict` into `model` strictly, refusing up front (nothing loaded) if keys or shapes differ."""
    diffs = _describe_differences(model.state_dict(), state_dict)
    if diffs:
        shown = "\n  ".join(diffs[:_MAX_LISTED_DIFFS])
        more = f"\n  ... and {len(diffs) - _MAX_LISTED_DIFFS} more" if len(diffs) > _MAX_LISTED_DIFFS else ""
        raise CheckpointError(
            f"checkpoint{' ' + source if source else ''} was written for a different model shape "
            f"({len(diffs)} difference(s)); check the model config matches the run that saved it:\n"
            f"  {shown}{more}"
        )
    model.load_state_dict(state_dict, strict=True)
