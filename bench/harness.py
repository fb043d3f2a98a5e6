"""Interleaved, noise-aware timing for comparing implementations in one process.

Why interleaved: on shared VMs a process is sometimes squeezed onto one core for minutes. Running
the compared implementations round-robin makes such drift hit all of them alike, and per-round
CPU-time/wall tells which rounds were degraded so they can be dropped (and counted).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch


@dataclass
class Timings:
    """Per-implementation step times of the kept rounds, plus how many rounds were dropped."""

    seconds: dict[str, list[float]]
    cpu_util: dict[str, list[float]]
    rounds_kept: int
    rounds_dropped: int
    dropped_util: list[float] = field(default_factory=list)

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def spread(self, name: str) -> tuple[float, float]:
        """(min, max) of the kept rounds."""
        return min(self.seconds[name]), max(self.seconds[name])

    def paired_ratio(self, num: str, den: str) -> tuple[float, float, float]:
        """median, min, max over rounds of time[num]/time[den] (pairs measured back to back)."""
        r = [a / b for a, b in zip(self.seconds[num], self.seconds[den])]
        return statistics.median(r), min(r), max(r)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_round_robin(
    steps: dict[str, Callable[[], None]],
    device: torch.device,
    min_rounds: int = 7,
    max_rounds: int = 30,
    warmup: int = 2,
    min_cpu_util: float | dict[str, float] | None = None,
) -> Timings:
    """Run every step once per round, in rotating order, until ``min_rounds`` clean rounds.

    A CPU round is clean when every step's process CPU time / wall time is at least
    ``min_cpu_util`` (default: 75% of the intra-op thread count; a dict gives each step its own,
    for steps that use fewer threads on purpose); on CUDA every round counts.
    """
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    _sync(device)
    if min_cpu_util is None:
        min_cpu_util = 0.75 * torch.get_num_threads()
    floor = min_cpu_util if isinstance(min_cpu_util, dict) else {n: min_cpu_util for n in names}
    seconds = {n: [] for n in names}
    utils = {n: [] for n in names}
    kept = dropped = 0
    dropped_util: list[float] = []
    for r in range(max_rounds):
        if kept >= min_rounds:
            break
        order = names[r % len(names):] + names[:r % len(names)]
        round_s, round_u = {}, {}
        for name in order:
            _sync(device)
            c0, t0 = time.process_time(), time.perf_counter()
            steps[name]()
            _sync(device)
            wall = time.perf_counter() - t0
            round_s[name] = wall
            round_u[name] = (time.process_time() - c0) / wall
        short = [n for n in names if round_u[n] < floor[n]]
        if device.type == "cpu" and short:
            dropped += 1
            dropped_util.append(round(min(round_u[n] for n in short), 2))
            continue
        kept += 1
        for name in names:
            seconds[name].append(round_s[name])
            utils[name].append(round_u[name])
    if kept == 0:
        raise RuntimeError(f"every one of {max_rounds} rounds was degraded (CPU util {dropped_util}); machine too noisy")
    return Timings(seconds, utils, kept, dropped, dropped_util)


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> list[float]:
    """Per-call milliseconds of ``fn`` after ``warmup`` calls: CUDA events (all recorded, then one
    synchronize, so no host gap sits between calls) on a GPU, else a host clock."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in events]


def ms_stats(ms: list[float]) -> dict:
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "reps": len(ms)}


def free_port() -> int:
    """A TCP port free on this host now, for a rendezvous of ranks started here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine_info(device: torch.device) -> dict:
    """What the numbers were measured on, for the results file."""
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "MALLOC_MMAP_MAX_")},
    }
    try:
        with open("/proc/cpuinfo") as f:
            models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu_model"] = models[0] if models else platform.processor()
    except OSError:
        info["cpu_model"] = platform.processor()
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def machine_tag(device: torch.device) -> str:
    """Short name for result files: cpu-2core, cuda-nvidia-h200, ..."""
    if device.type == "cuda":
        return "cuda-" + torch.cuda.get_device_name(device).lower().replace(" ", "-")
    return f"cpu-{os.cpu_count()}core"


def reset_peak_rss() -> None:
    """Restart the resident-set high-water mark (Linux >= 4.0: writing 5 to clear_refs), so a
    measurement is not inflated by whatever the process held before it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    """Resident-set high-water mark since the last reset_peak_rss() (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not found in /proc/self/status")


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def code_version() -> str:
    """The commit the code ran at ("-dirty" when tracked files differ from it)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout
        return head.strip() + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def write_results(out_dir: str | Path, stem: str, result: dict, markdown: str, command: str | None = None) -> None:
    """bench/results/<stem>.json and .md, both naming the command and the commit that made them
    (``command``: else the result's own, else this process's ``python -m`` line); the markdown is printed too."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    command = command or result.get("command") or " ".join(
        ["python -m", spec.name if spec else Path(sys.argv[0]).stem, *map(shlex.quote, sys.argv[1:])])
    commit = code_version()
    result = {**result, "made_by": {"command": command, "commit": commit}}
    markdown = markdown.rstrip("\n") + f"\n\nMade by `{command}` at commit {commit}.\n"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    (out / f"{stem}.md").write_text(markdown)
    print(markdown, flush=True)
    print(f"wrote {out / stem}.json and .md", file=sys.stderr)
