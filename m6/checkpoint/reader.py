"""Finding and reading a checkpoint on disk: which step directory a path names, its metadata (read
without unpickling code), and its state read whole or into this rank's tensors (expert rows of
``shards``), with a CheckpointError naming the directory when it cannot be read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException

import m6.checkpoint.sharded_io as sharded_io
from m6.checkpoint.errors import CheckpointError, CheckpointMismatch
from m6.checkpoint.sharded_io import METADATA_FILE, Shards
from m6.checkpoint.state_tree import SEP, flatten, unflatten
from m6.checkpoint.step_dirs import latest_step_dir

MAX_LISTED_DIFFS = 5


def not_a_step_directory(path: Path) -> str:
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
        raise CheckpointMismatch(not_a_step_directory(path))
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
        latest = latest_step_dir(run / "checkpoints")
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
            shown = ", ".join(missing[:MAX_LISTED_DIFFS]) + (" ..." if len(missing) > MAX_LISTED_DIFFS else "")
            raise CheckpointError(f"checkpoint {path} lacks {len(missing)} entr{'y' if len(missing) == 1 else 'ies'} "
                                  f"this run needs: {shown}")
    try:
        sharded_io.read(path, flat, shards or {}, group)
    except (Exception, CheckpointException) as e:  # DCP's own error is a BaseException
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"cannot read checkpoint {path}: it is corrupt, truncated or not an m6 checkpoint "
                              f"({type(e).__name__}: {reason})") from e
    return unflatten(flat)
