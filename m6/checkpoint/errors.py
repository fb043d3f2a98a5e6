"""The checkpoint errors a user sees: each names the file or config key and what is wrong."""

from __future__ import annotations

import os
import socket

from m6.parallel.peer_check import is_peer_failure


class CheckpointError(RuntimeError):
    """A user-facing checkpoint problem; the message names the file or config key and what is wrong."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint named cannot continue this run: not an m6 checkpoint, or saved for another
    model, data or optimizer setup (bad input: train.py exits 2, like a config error)."""



def as_checkpoint_error(e: BaseException, doing: str) -> BaseException:
    """Keep user-facing errors as they are, and a peer's death (train.py names the dead rank); say
    what was being done for the rest."""
    if isinstance(e, (CheckpointError, TypeError, KeyboardInterrupt)) or is_peer_failure(e):
        return e
    reason = (str(e).strip().splitlines() or [""])[0][:300]
    return CheckpointError(f"{doing} failed on rank {rank_label()}: {type(e).__name__}: {reason}")


def rank_label() -> str:
    return f"{os.environ.get('RANK', '0')} (host {socket.gethostname()})"
