"""Which rank died: after a failed collective, the survivors report in through the job's store
(the launcher's TCP store, which outlives any one worker) and name the ranks that did not.

A collective that fails because a peer died says only that a connection closed (gloo) or that
it timed out (NCCL); which rank, on which host, is what an operator needs. Every rank registers
its host at start-up; after a failure each survivor marks itself alive and waits a few seconds for
the others to do the same.

Under NCCL a survivor does not see a failed collective for a long time: its main thread waits
inside a CUDA synchronisation until NCCL's watchdog aborts the process (parallel.timeout_s),
printing nothing of m6's. ``PeerWatch`` is a thread of every rank that beats through the store and
watches the next rank's beat; a rank silent for ``silent_s`` (died, or hung) is named by every
survivor, which then ends itself (exit 1), whatever its main thread is blocked in.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import threading
import time

import torch.distributed as dist

_HOST_KEY, _ALIVE_KEY = "m6/peer/host/{}", "m6/peer/alive/{}"
_BEAT_KEY, _DONE_KEY, _SILENT_KEY = "m6/peer/beat/{}", "m6/peer/done/{}", "m6/peer/silent"
_reported = threading.Lock()  # one report of a peer failure per process: the main thread's or the watch's


def report_once(line: str) -> bool:
    """Print ``line`` to stderr unless this process has already reported a peer failure."""
    if not _reported.acquire(blocking=False):
        return False
    print(line, file=sys.stderr, flush=True)
    return True


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


class PeerWatch:
    """A daemon thread that beats through the job's store every ``interval_s`` and watches the next
    rank's beat (a ring: one read per rank and beat, whatever the world size). A watched rank that
    has not beaten for ``silent_s`` and has not finished is published as silent; every survivor's
    watch then names the silent ranks and hosts, gives the main thread ``grace_s`` to report the
    failure itself (gloo raises at once), and ends the process with exit code 1.
    """

    def __init__(self, rank: int, world_size: int, silent_s: float, interval_s: float = 2.0,
                 grace_s: float = 3.0) -> None:
        self.rank, self.world_size = rank, world_size
        self.silent_s, self.interval_s, self.grace_s = silent_s, interval_s, grace_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="m6-peer-watch", daemon=True)

    @classmethod
    def for_job(cls, rank: int, world_size: int, timeout_s: float) -> "PeerWatch":
        """The started watch of a job whose collectives time out after ``timeout_s``
        (parallel.timeout_s): silent after min(20 s, timeout_s / 2), before NCCL's watchdog fires
        and within a launcher's kill grace (torchrun: 30 s after it signals the survivors)."""
        return cls(rank, world_size, silent_s=min(20.0, timeout_s / 2)).start()

    def start(self) -> "PeerWatch":
        self._thread.start()
        atexit.register(self._stop_at_exit)
        return self

    def _stop_at_exit(self) -> None:
        # A daemon thread still inside a torch C++ call (a store operation) when the interpreter
        # finalises aborts the whole process ("terminate called without an active exception"), so
        # the watch ends before that, also where nobody called stop (a Trainer used without fit).
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def stop(self, finished: bool) -> None:
        """End the watch; ``finished``: this rank is done, so its silence from now on is no failure."""
        if finished:
            try:
                _store().set(_DONE_KEY.format(self.rank), "1")
            except Exception:  # noqa: BLE001 - the store is gone: nobody is left to watch us
                pass
        self._stop.set()
        atexit.unregister(self._stop_at_exit)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(2 * self.interval_s, 1.0))

    def _run(self) -> None:
        store = _store()
        watched = (self.rank + 1) % self.world_size
        last_beat, last_change = -1, time.monotonic()
        while not self._stop.wait(self.interval_s):
            try:
                store.add(_BEAT_KEY.format(self.rank), 1)
                beat = store.add(_BEAT_KEY.format(watched), 0)
                now = time.monotonic()
                if beat != last_beat:
                    last_beat, last_change = beat, now
                elif now - last_change > self.silent_s and not store.check([_DONE_KEY.format(watched)]):
                    store.append(_SILENT_KEY, f"{watched},")  # every detector adds its own: all are named
                if store.check([_SILENT_KEY]):
                    self._end(store)
                    return
            except Exception as e:  # noqa: BLE001 - the store's host (node 0's launcher, or rank 0) is gone
                if self._stop.is_set():
                    return
                self._end_without_store(e)
                return

    def _end(self, store) -> None:
        if self._stop.wait(self.grace_s):  # the main thread finished or is reporting itself
            return
        ranks = sorted({int(r) for r in store.get(_SILENT_KEY).decode().split(",") if r})
        hosts = {r: store.get(_HOST_KEY.format(r)).decode() if store.check([_HOST_KEY.format(r)]) else "unknown"
                 for r in ranks}
        names = ", ".join(f"rank {r} (host {h})" for r, h in hosts.items())
        verb = "has" if len(ranks) == 1 else "have"
        self._exit(f"rank {self.rank}: error: {names} {verb} stopped answering for more than {self.silent_s:.0f} s "
                   f"(died or hung); this rank stops. See that rank's own log for why")

    def _end_without_store(self, e: Exception) -> None:
        # Also what a rank sees when rank 0 hosts the store (no launcher agent) and has finished
        # and left first: then this rank finishes too within the wait, and nothing is reported.
        if self._stop.wait(max(self.grace_s, 10.0)):
            return
        self._exit(f"rank {self.rank}: error: the job's store is unreachable ({type(e).__name__}); the node that "
                   f"hosts it (MASTER_ADDR, node 0) probably died; this rank stops")

    def _exit(self, line: str) -> None:
        if report_once(line):
            sys.stdout.flush()
            os._exit(1)  # the main thread may be blocked in a collective or a device sync for minutes
