"""The step directories of a run: ``run_dir/checkpoints/step_00000010/`` (DCP's files: one data file
per rank and the ``.metadata`` index) and the ``latest`` pointer file naming the newest one.

A step directory only appears by renaming a fully written temporary directory (``.tmp-...``), so
its name and its metadata file mark a complete checkpoint; discovery ignores everything else.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from m6.checkpoint.sharded_io import METADATA_FILE

POINTER_FILE = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Everything the manager writes that is not yet (or no longer) a checkpoint starts with this prefix,
# so discovery ignores it and the next save can sweep it away.
TMP_PREFIX = ".tmp-"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int | None:
    """Return the step number encoded in a step directory name, or None for anything else."""
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def is_complete(path: Path) -> bool:
    # A step dir only appears by renaming a fully written temp dir, so its name is the marker.
    return path.is_dir() and (path / METADATA_FILE).is_file()


def complete_step_dirs(checkpoints: Path) -> list[Path]:
    """The complete checkpoint directories under ``checkpoints``, oldest (lowest step) first."""
    if not checkpoints.is_dir():
        return []
    found = [p for p in checkpoints.iterdir() if step_of(p) is not None and is_complete(p)]
    return sorted(found, key=step_of)


def read_pointer(checkpoints: Path) -> tuple[str | None, str | None]:
    """(the step directory name the ``latest`` pointer holds, None) or, when it holds anything
    else, (None, what is wrong with it); (None, None) when there is no pointer."""
    pointer = checkpoints / POINTER_FILE
    try:
        raw = pointer.read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"{pointer} cannot be read ({e.strerror or e})"
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        text = None
    if text is not None and _STEP_DIR.match(text):
        return text, None
    held = (f"{text[:40]!r}" if text is not None and text.isprintable() else f"{len(raw):,} bytes of binary data") \
        if raw.strip() else "nothing"
    return None, f"{pointer} holds {held}, not a step directory name (step_NNNNNNNN): the pointer is corrupt"


def latest_step_dir(checkpoints: Path) -> Path | None:
    """The checkpoint the pointer names, else the highest complete step, else None."""
    name, _ = read_pointer(checkpoints)
    # A pointer can be missing (crash before its first write), stale (its dir deleted by hand) or
    # corrupt (reader.newest_readable and find_checkpoint say so; here it is only passed over).
    if name is not None and is_complete(checkpoints / name):
        return checkpoints / name
    complete = complete_step_dirs(checkpoints)
    return complete[-1] if complete else None


def fsync_dir(path: Path) -> None:
    """Make renames and new entries in `path` durable; directories cannot be fsynced on Windows."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def written_whole(out_dir: Path) -> Iterator[Path]:
    """A temporary directory beside ``out_dir`` to write into; renamed to ``out_dir`` (which must be
    absent or empty) when the block ends, removed when it raises: the directory appears whole or
    not at all (the tools' outputs: an export, an import)."""
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out_dir.exists():
            out_dir.rmdir()  # empty: a directory with files is refused before anything is written
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
