"""The slowed-rank test bed of bench/balance.py: its cgroup limits a process to its quota and is
removed at the end, also when the benchmark is terminated; skipped where cgroups cannot be written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.balance import CPU_CGROUPS, PREFIX, BenchSkipped, SlowGroup

REPO = Path(__file__).resolve().parents[2]


def writable_cgroups() -> str | None:
    """None when the test bed can be built here, else why not."""
    if not (CPU_CGROUPS / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CPU_CGROUPS}"
    if not os.access(CPU_CGROUPS, os.W_OK):
        return f"{CPU_CGROUPS} is not writable (needs root)"
    return None


pytestmark = pytest.mark.skipif(writable_cgroups() is not None, reason=str(writable_cgroups()))

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"


def test_group_limits_to_its_quota_and_is_removed_even_on_sigterm():
    with SlowGroup(25) as group:
        assert (group.path / "cpu.cfs_quota_us").read_text().strip() == "25000"
        t0 = time.perf_counter()
        # 0.6 s of CPU at 25% of a core: at least 2.4 s of wall (0.6 s unthrottled).
        subprocess.run(["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group.procs), sys.executable, "-c", BURN],
                       check=True)
        assert time.perf_counter() - t0 > 1.8
        stat = dict(line.split() for line in (group.path / "cpu.stat").read_text().splitlines())
        assert int(stat["nr_throttled"]) > 0  # the quota itself held it back, not a busy machine
    assert not group.path.exists()
    # A benchmark terminated while its group holds a rank: the group goes with it.
    code = ("import time\nfrom bench.balance import SlowGroup, exit_on_termination\nexit_on_termination()\n"
            "with SlowGroup(50) as g:\n    print(g.path, flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    path = Path(proc.stdout.readline().strip())
    assert path.is_dir() and path.name == f"{PREFIX}{proc.pid}-50"
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) != 0
    assert not path.exists()
    # One killed with SIGKILL leaves its group behind; the next benchmark sweeps it.
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    path = Path(proc.stdout.readline().strip())
    proc.kill()
    proc.wait(timeout=30)
    assert path.exists()
    with SlowGroup(50):
        assert not path.exists()


def test_skips_with_the_reason_where_the_controller_is_missing(monkeypatch, tmp_path):
    monkeypatch.setattr("bench.balance.CPU_CGROUPS", tmp_path)
    with pytest.raises(BenchSkipped, match="no cgroup v1 cpu controller"):
        with SlowGroup(50):
            pass
