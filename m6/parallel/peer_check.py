"""Which rank died: after a failed collective, the survivors report in through the job's store
(the launcher's TCP store, which outlives any one worker) and name the ranks that did not.

A collective that fails because a peer died says only that a connection closed (gloo) or that
it timed out (NCCL); which rank, on which host, is what an operator needs. Every rank registers
its host at start-up; after a failure each survivor marks itself alive and waits a few seconds for
the others to do the same.
"""

from __future__ import annotations

import signal
import socket
import threading
import time

import torch.distributed as dist

_HOST_KEY, _ALIVE_KEY = "m6/peer/host/{}", "m6/peer/alive/{}"


# How a backend reports a peer that went away when it raises a plain RuntimeError (gloo does).
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "transport/tcp/pair",
              "NCCL communicator was aborted", "Watchdog caught collective operation timeout")


def is_peer_failure(e: BaseException) -> bool:
    """Whether ``e`` is a collective failing because another rank is gone or stuck (not a bug here)."""
    if isinstance(e, (dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError)):
        return True
    return isinstance(e, RuntimeError) and any(marker in str(e) for marker in _PEER_LOST)


def _store():
    return dist.distributed_c10d._get_default_store()


def register_host(rank: int) -> None:
    """At start-up: this rank's host name, for the failure report."""
    _store().set(_HOST_KEY.format(rank), socket.gethostname())


def silent_ranks(rank: int, world_size: int, wait_s: float) -> dict[int, str]:
    """After a failed collective: mark this rank alive, wait up to ``wait_s`` for the others, and
    return {rank: host} of those that never did (dead or hung). Raises what the store raises when
    the store itself is gone (the node hosting it died)."""
    store = _store()
    store.set(_ALIVE_KEY.format(rank), "1")
    pending = set(range(world_size)) - {rank}
    deadline = time.monotonic() + wait_s
    while pending and time.monotonic() < deadline:
        pending = {r for r in pending if not store.check([_ALIVE_KEY.format(r)])}
        if pending:
            time.sleep(0.2)
    hosts = {}
    for r in sorted(pending):
        hosts[r] = store.get(_HOST_KEY.format(r)).decode() if store.check([_HOST_KEY.format(r)]) else "unknown"
    return hosts


def describe_peer_failure(rank: int, world_size: int, wait_s: float = 10.0) -> str:
    """One line for a survivor of a failed collective: which ranks (and hosts) stopped answering.

    The launcher usually sends the survivors SIGTERM as soon as it sees a worker die (and SIGKILL
    a grace period later): it is held off during the short wait so that the line gets out."""
    held = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if held else None
    try:
        silent = silent_ranks(rank, world_size, wait_s)
    except Exception as e:  # the store is unreachable: its host (the launcher on node 0) is gone
        return (f"a collective failed and the job's store is unreachable too ({type(e).__name__}); the node that "
                f"hosts it (MASTER_ADDR, node 0) probably died")
    finally:
        if held:
            signal.signal(signal.SIGTERM, previous)
    if not silent:
        return "a collective failed, but every rank is still running: a collective timed out (parallel.timeout_s)"
    names = ", ".join(f"rank {r} (host {h})" for r, h in silent.items())
    verb = "has" if len(silent) == 1 else "have"
    return (f"{names} {verb} stopped answering (died or hung) and a collective with it failed; this rank stops. "
            f"See that rank's own log for why")
