"""py-cpuinfo asked once per process instead of at every DeepSpeed op load and optimizer.

DeepSpeed reads the CPU's vendor and flags through ``cpuinfo.get_cpu_info()`` each time it loads
an op (``OpBuilder.cpu_arch`` / ``simd_width``) and each time it constructs a ``DeepSpeedCPUAdam``.
Each call starts a Python process that times the clock around a one-second sleep: ~1.1 s on a
quiet machine: 2-3 per training process that uses DeepSpeed's CPU Adam, ~9 in a planner search
(it probes the host update once per layout), 55 in tests/unit. The answer is this machine's CPU
and cannot change while the process runs, so the first call asks for real and later calls get a
copy of that answer: DeepSpeed still builds, loads and runs its real op with the real CPU
description; only the repeated question is gone.

m6.memory.host_optimizer installs it before DeepSpeed loads an op; tests/conftest.py installs it
in the pytest process and tests/dist/dist_helpers.py hands each rank the session's answer (a rank
that asked itself would wait that second in every run).
"""

from __future__ import annotations

import copy
import functools
import importlib.util


def install(answer: dict | None = None) -> bool:
    """Make ``cpuinfo.get_cpu_info`` ask at most once in this process (idempotent); ``answer``:
    what an earlier process of this session got, used instead of asking. False without py-cpuinfo
    (it comes with DeepSpeed, an optional extra)."""
    if importlib.util.find_spec("cpuinfo") is None:
        return False
    import cpuinfo
    import cpuinfo.cpuinfo

    if getattr(cpuinfo.get_cpu_info, "asks_once", False):
        return True
    ask = functools.cache(cpuinfo.get_cpu_info if answer is None else lambda: answer)

    @functools.wraps(cpuinfo.get_cpu_info)
    def get_cpu_info() -> dict:
        return copy.deepcopy(ask())  # a caller that edits its dict cannot change the next caller's

    get_cpu_info.asks_once = True
    # DeepSpeed imports the function where it calls it (``from cpuinfo import get_cpu_info``).
    cpuinfo.get_cpu_info = cpuinfo.cpuinfo.get_cpu_info = get_cpu_info
    return True


def answer() -> dict | None:
    """This process's answer (asked now if not yet), for processes it starts; None without py-cpuinfo."""
    if not install():
        return None
    import cpuinfo

    return cpuinfo.get_cpu_info()
