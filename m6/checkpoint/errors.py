"""The checkpoint errors a user sees: each names the file or config key and what is wrong."""

from __future__ import annotations

import os
import socket

from m6.parallel.peer_check import is_peer_failure


class CheckpointError(RuntimeError):
    """A user-facing checkpoint problem; the message names the file or config key and what is wrong."""


class CheckpointMismatch(CheckpointError):
    """Bad input (train.py and ``python -m m6.checkpoint`` exit 2, like a config error): the checkpoint
    named cannot continue this run (not an m6 checkpoint, saved for another model, data or optimizer
    setup), its files are damaged (CheckpointDamaged), or run.dir cannot hold one (RunDirNotShared)."""


class CheckpointDamaged(CheckpointMismatch):
    """A checkpoint's files are damaged or incomplete: its metadata corrupt, truncated or not DCP's
    (code planted in it is refused, never run), a data file missing or short, a value that is not
    plain data, or a ``latest`` pointer holding garbage. The message names the file and what is
    wrong; checkpoint.resume=auto skips such a checkpoint for the newest readable one."""


class RunDirNotShared(CheckpointMismatch):
    """A save found a rank's data file missing from the checkpoint directory as rank 0 sees it:
    run.dir is not on a filesystem every node shares."""


def as_checkpoint_error(e: BaseException, doing: str) -> BaseException:
    """Keep user-facing errors as they are, and a peer's death (train.py names the dead rank); say
    what was being done for the rest."""
    if isinstance(e, (CheckpointError, TypeError, KeyboardInterrupt)) or is_peer_failure(e):
        return e
    reason = (str(e).strip().splitlines() or [""])[0][:300]
    return CheckpointError(f"{doing} failed on rank {rank_label()}: {type(e).__name__}: {reason}")


def rank_label() -> str:
    return f"{os.environ.get('RANK', '0')} (host {socket.gethostname()})"


def dcp_cause(e: BaseException) -> BaseException:
    """The first failing rank's own exception inside DCP's CheckpointException (whose message names
    only the ranks, e.g. "CheckpointException ranks:dict_keys([0])"); ``e`` itself otherwise."""
    failures = getattr(e, "failures", None)
    if not failures:
        return e
    first = failures[min(failures)]
    return dcp_cause(first[0] if isinstance(first, tuple) else first)


def first_line(e: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message`` (a one-line error keeps one line)."""
    text = (str(e).strip().splitlines() or [""])[0][:limit]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
