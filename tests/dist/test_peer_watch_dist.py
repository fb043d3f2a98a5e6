"""PeerWatch (m6.parallel.peer_check): a dead or hung rank is named by the survivors while their
main thread is blocked where no collective error can reach it (as inside a CUDA sync under NCCL,
until the NCCL watchdog aborts the process without a word of m6's), and a rank that finishes
first is no failure. Real processes on gloo; each run ends within seconds, not parallel.timeout_s."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.dist.dist_helpers import REPO, free_port

WORKER = """
import os, signal, sys, threading, time
import torch, torch.distributed as dist
from m6.parallel import init_distributed
from m6.parallel.peer_check import PeerWatch
mode = sys.argv[1]
env = init_distributed(timeout_s=600)
watch = PeerWatch(env.rank, env.world_size, silent_s=3, interval_s=0.5, grace_s=1).start()
dist.barrier()
if env.rank == 1 and mode == "dead":
    time.sleep(1)
    os.kill(os.getpid(), signal.SIGKILL)
if env.rank == 1 and mode == "hung":
    time.sleep(1)
    os.kill(os.getpid(), signal.SIGSTOP)
if env.rank == 0 and mode == "dead":
    threading.Event().wait(60)  # blocked outside any collective, as in a device sync
if env.rank == 0 and mode == "hung":
    dist.all_reduce(torch.ones(1))  # rank 1 never joins: gloo would wait parallel.timeout_s (600 s)
if mode == "exit":
    # A watch nobody stops, beating as fast as it can (so it is inside a store call, torch C++,
    # almost all the time): both ranks leave as a script does, rank 0 (the store's host) first.
    fast = PeerWatch(env.rank, env.world_size, silent_s=60, interval_s=0.0005, grace_s=1).start()
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.2 if env.rank == 0 else 0.4)
    print(f"rank {env.rank} leaving", flush=True)
    sys.exit(0)
if mode == "finish":
    time.sleep(0.5 if env.rank == 0 else 4)  # rank 0 (the store's host here) leaves long before rank 1
    watch.stop(finished=True)
    print(f"rank {env.rank} finished", flush=True)
    os._exit(0)
print(f"rank {env.rank} reached the end of mode {mode}", flush=True)
"""


def _launch(mode: str) -> list[subprocess.Popen]:
    env = dict(os.environ, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    return [subprocess.Popen([sys.executable, "-c", WORKER, mode], cwd=REPO, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]


def _wait(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str, float]:
    started = time.monotonic()
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err, time.monotonic() - started


@pytest.mark.parametrize("mode", ["dead", "hung"])
def test_survivor_names_the_silent_rank_and_stops(mode):
    procs = _launch(mode)
    try:
        code, out, err, waited = _wait(procs[0], timeout=90)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert code == 1, (out, err[-3000:])
    assert "rank 1 (host " in err and "stopped answering for more than 3 s (died or hung)" in err, err[-3000:]
    assert err.count("stopped answering") == 1  # one line, from one reporter
    assert f"reached the end of mode {mode}" not in out  # its main thread was still blocked
    assert waited < 60


def test_a_rank_that_finishes_first_is_no_failure():
    procs = _launch("finish")
    results = [_wait(p, timeout=90) for p in procs]
    for rank, (code, out, err, _) in enumerate(results):
        assert code == 0 and f"rank {rank} finished" in out, (rank, out, err[-3000:])
        assert "stopped answering" not in err and "unreachable" not in err


def test_a_watch_nobody_stopped_lets_the_process_exit_normally():
    """A daemon thread inside a torch C++ call when the interpreter finalises aborts the process
    ("terminate called without an active exception", SIGABRT): the watch ends at exit first.
    Three jobs (a race, tried more than once), started together: each pays its own Python and torch
    start, which the machine's cores then share instead of running one job after another."""
    attempts = [_launch("exit") for _ in range(3)]
    try:
        results = [[_wait(p, timeout=90) for p in procs] for procs in attempts]
    finally:
        for p in (p for procs in attempts for p in procs):
            if p.poll() is None:
                p.kill()
                p.communicate()
    for attempt, ranks in enumerate(results):
        for rank, (code, out, err, _) in enumerate(ranks):
            assert "terminate called" not in err and code == 0, (attempt, rank, code, err[-2000:])
            assert f"rank {rank} leaving" in out
