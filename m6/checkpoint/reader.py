"""Finding and reading a checkpoint on disk: which step directory a path names, its metadata (read
without unpickling code, its data files checked present and whole), and its state read whole or
into this rank's tensors (expert rows of ``shards``). A damaged checkpoint is a CheckpointDamaged
naming the file and what is wrong with it, in one line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

import m6.checkpoint.sharded_io as sharded_io
from m6.checkpoint.errors import CheckpointDamaged, CheckpointError, CheckpointMismatch, dcp_cause, first_line
from m6.checkpoint.sharded_io import METADATA_FILE, ForbiddenPickle, Shards
from m6.checkpoint.state_tree import SEP, flatten, unflatten
from m6.checkpoint.step_dirs import POINTER_FILE, complete_step_dirs, latest_step_dir, read_pointer, step_of
from m6.parallel.peer_check import is_peer_failure

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
        _, problem = read_pointer(run / "checkpoints")
        latest = latest_step_dir(run / "checkpoints")
        if problem is not None:
            newest = f"the newest complete checkpoint there is {latest}" if latest else "there is no complete checkpoint"
            raise CheckpointDamaged(f"{problem}; {newest}: name a step directory instead, or delete the pointer")
        if latest is None:
            raise CheckpointError(f"{run / 'checkpoints'} holds no complete checkpoint (no step_* directory with a "
                                  f"{METADATA_FILE})")
        return latest
    return checkpoint_dir(path)  # says what is missing


def load_metadata(path: Path) -> Metadata:
    """The DCP metadata of the checkpoint directory ``path``, with every data file it indexes
    checked present and long enough (a stat each, no data read); else CheckpointDamaged naming
    the file and what is wrong."""
    file = path / METADATA_FILE
    try:
        metadata = sharded_io.read_metadata(path)
    except ForbiddenPickle as e:
        raise CheckpointDamaged(f"{file} holds a pickle that would load {e}, which is not checkpoint metadata: "
                                f"refused, nothing in it was run") from e
    except OSError as e:
        raise CheckpointMismatch(f"{file} cannot be read: {e.strerror or e}") from e
    except Exception as e:
        size = file.stat().st_size
        if isinstance(e, EOFError) or "truncated" in str(e):
            raise CheckpointDamaged(f"{file} is truncated ({size:,} bytes): the save, or a copy of it, was cut "
                                    f"short") from e
        raise CheckpointDamaged(f"{file} is corrupt: not DCP checkpoint metadata ({first_line(e)})") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointDamaged(f"{file} is not DCP checkpoint metadata: it holds a {type(metadata).__name__}")
    check_data_files(path, metadata)
    return metadata


_DATA_FILE_RANK = re.compile(r"^__(\d+)_")  # DCP names each rank's data file __{rank}_{n}.distcp


def check_data_files(path: Path, metadata: Metadata) -> None:
    """Every data file ``metadata`` indexes is in ``path`` and holds the bytes it indexes."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            rank = _DATA_FILE_RANK.match(name)
            whose = f"rank {rank.group(1)}'s data file" if rank else "a data file"
            raise CheckpointDamaged(f"{path / name} is missing: {whose}, which its {METADATA_FILE} indexes (the save "
                                    f"did not finish on every rank, or the file was moved or deleted)") from None
        if size < end:
            raise CheckpointDamaged(f"{path / name} is truncated: {size:,} bytes where its {METADATA_FILE} indexes "
                                    f"data up to byte {end:,}")


def read_failure(path: Path, e: BaseException) -> BaseException:
    """What a failed read of checkpoint ``path`` tells the user: the failing rank's own cause (DCP's
    exception names only the ranks), in one line; a peer's death as it is (train.py names the rank)."""
    cause = dcp_cause(e)
    if is_peer_failure(e) or is_peer_failure(cause):
        return e
    if isinstance(cause, CheckpointError):
        where = path / cause.file if hasattr(cause, "file") else f"checkpoint {path}"
        return type(cause)(f"{where}: {cause}")
    return CheckpointDamaged(f"cannot read checkpoint {path}: {first_line(cause)}: its data is corrupt")


def raise_read_failure(path: Path, e: BaseException) -> NoReturn:
    """Raise ``read_failure(path, e)`` from ``e`` (``e`` itself when it is a peer's death)."""
    error = read_failure(path, e)
    if error is e:
        raise e
    raise error from e


def newest_readable(checkpoints: Path) -> tuple[Path | None, list[str]]:
    """The checkpoint checkpoint.resume=auto continues from, and what it passed over and why: the
    one ``latest`` names, else (pointer missing, stale or corrupt, or that checkpoint damaged) the
    newest complete, readable one up to it. None when there is none at all; CheckpointDamaged
    when there are checkpoints but none can be read (a fresh start would replace them)."""
    notes = []
    name, problem = read_pointer(checkpoints)
    if problem is not None:
        notes.append(f"ignored the pointer: {problem}")
    candidates = complete_step_dirs(checkpoints)
    if name is not None and checkpoints / name in candidates:
        # Higher steps are an abandoned branch of the run (it resumed from an earlier step), as
        # for latest_step_dir: never continue one.
        candidates = [p for p in candidates if step_of(p) <= step_of(checkpoints / name)]
    elif name is not None:
        notes.append(f"ignored the pointer: {checkpoints / POINTER_FILE} names {name}, which is not a complete checkpoint")
    damaged = []
    for candidate in reversed(candidates):
        try:
            load_metadata(candidate)
            return candidate, notes + [f"skipped {p.name}: {why}" for p, why in damaged]
        except CheckpointDamaged as e:
            damaged.append((candidate, str(e)))
    if damaged:
        raise CheckpointDamaged(
            f"checkpoint.resume=auto: no checkpoint in {checkpoints} can be read: "
            + "; ".join(str(why) for _, why in damaged)
            + ". Restore the files, or start fresh with checkpoint.resume=none (its saves then replace these)")
    return None, notes


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
        raise_read_failure(path, e)
    return unflatten(flat)
