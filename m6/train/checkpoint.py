"""Single-process training checkpoints: state-dict file I/O, RNG capture, and atomic step directories.

Layout: ``run_dir/checkpoints/step_00000010/state.pt`` plus a ``latest`` pointer file naming the
newest step directory. The file layer (`save_state` / `load_state`) knows nothing of directories, so
a multi-rank version can write one state file per rank into the same atomic step directory.
"""

from __future__ import annotations

import collections
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "state.pt"
POINTER_FILE = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Everything the manager writes that is not yet (or no longer) a checkpoint starts with this prefix,
# so discovery ignores it and the next save can sweep it away.
_TMP_PREFIX = ".tmp-"
_MAX_LISTED_DIFFS = 5


class CheckpointError(RuntimeError):
    """A user-facing checkpoint problem; the message names the file or config key and what is wrong."""


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


def save_state(state: dict, file: str | Path) -> None:
    """Write a state dict to `file` and fsync it; no atomicity, that is the caller's job."""
    bad = _find_unloadable(state, "state")
    if bad:
        raise TypeError(
            f"cannot checkpoint {bad}: only tensors, python primitives, dicts, lists, tuples and sets "
            "are saved (so checkpoints load with torch.load(weights_only=True)); convert it first"
        )
    with open(file, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def load_state(file: str | Path, map_location: Any = "cpu") -> dict:
    """Read a state dict written by `save_state`, turning any read failure into a CheckpointError."""
    file = Path(file)
    if not file.is_file():
        raise CheckpointError(f"checkpoint file {file} does not exist")
    try:
        # weights_only=True: save_state guarantees only tensors and primitives are inside, and the
        # restricted unpickler cannot run code from a checkpoint someone else handed us.
        state = torch.load(file, map_location=map_location, weights_only=True)
    except Exception as e:  # zip, pickle, EOF and OS errors all mean the same thing to the user
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(
            f"cannot read checkpoint file {file}: it is corrupt, truncated or not an m6 checkpoint "
            f"({type(e).__name__}: {reason})"
        ) from e
    if not isinstance(state, dict):
        raise CheckpointError(
            f"checkpoint file {file} holds a {type(state).__name__}, not an m6 checkpoint state dict"
        )
    return state


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


class CheckpointManager:
    """Owns run_dir/checkpoints: atomic saves, the `latest` pointer, retention and discovery."""

    def __init__(self, run_dir: str | Path, keep: int) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"checkpoint.keep must be an integer >= 1, got {keep!r}")
        self.dir = Path(run_dir) / "checkpoints"
        self.keep = keep

    def step_dir(self, step: int) -> Path:
        """Return the directory that holds (or will hold) the checkpoint for `step`."""
        return self.dir / f"step_{step:08d}"

    def save(self, step: int, state: dict) -> Path:
        """Atomically write `state` as the checkpoint for `step`, repoint `latest`, prune; return its dir."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"checkpoint step must be an integer >= 0, got {step!r}")
        self.dir.mkdir(parents=True, exist_ok=True)
        self._sweep_temporaries()
        final = self.step_dir(step)
        tmp = self.dir / f"{_TMP_PREFIX}{final.name}-{os.getpid()}"
        tmp.mkdir()
        try:
            save_state(state, tmp / STATE_FILE)
            _fsync_dir(tmp)
        except BaseException:
            # A failed write (bad state value, full disk) must not leave gigabytes behind until the next save.
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if final.exists():
            # Re-saving a step (e.g. resumed from it): move the old one aside, since a directory
            # cannot be renamed onto a non-empty one; a crash here still leaves earlier steps.
            self._discard(final)
        os.replace(tmp, final)
        _fsync_dir(self.dir)
        self._write_pointer(final.name)
        self._prune(keep_also=final)
        return final

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

    def load(self, path: str | Path | None = None, map_location: Any = "cpu") -> dict:
        """Load a checkpoint given its step dir or its state file; None means the latest one."""
        if path is None:
            path = self.latest()
            if path is None:
                raise CheckpointError(f"no checkpoint to load: {self.dir} holds no complete checkpoint")
        path = Path(path)
        if not path.exists():
            raise CheckpointError(f"checkpoint {path} does not exist")
        if path.is_dir():
            if not (path / STATE_FILE).is_file():
                raise CheckpointError(
                    f"checkpoint directory {path} has no {STATE_FILE} (incomplete, or not a step directory)"
                )
            path = path / STATE_FILE
        return load_state(path, map_location)

    def _is_complete(self, path: Path) -> bool:
        # A step dir only appears by renaming a fully written temp dir, so its name is the marker.
        return path.is_dir() and (path / STATE_FILE).is_file()

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

    def _sweep_temporaries(self) -> None:
        # Single-process: any temp entry is a leftover from an earlier crashed or failed save.
        for path in self.dir.iterdir():
            if not path.name.startswith(_TMP_PREFIX):
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


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
    if path.is_dir() and not (path / STATE_FILE).is_file():
        raise CheckpointError(
            f"checkpoint.resume={resume!r}: {path} is a directory without {STATE_FILE}; point it at a "
            f"step directory (e.g. .../checkpoints/step_00000010) or its {STATE_FILE}, or use 'auto'"
        )
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
