"""Heterogeneous test bed: train.py on ranks of unequal speed, parallel.balance=auto against even.

Each rank runs pinned to its own core (taskset); a rank below 100% runs inside a cgroup v1 cpu
controller group (one per speed) whose quota (cpu.cfs_quota_us over cpu.cfs_period_us) gives it
that fraction of its core, so a rank at 50% computes at half speed. On a machine busy with other
work, where every process gets less than the quota anyway, give every rank a quota below that
share (``--speeds 12,6``): the quotas then set the speeds. The cgroups are made for this run and
removed at the end, also on SIGTERM / SIGINT / SIGHUP (and one left by a run killed with SIGKILL
is swept at the next start). Where the cgroup cannot be written (not root, no cgroup v1 cpu controller) the
benchmark stops with the reason and exit code 2.

The compared settings run round-robin (even, auto, auto, even, ...) so a period of contention from
other processes on the machine hits both; each run's step time is the median over its steps after
the warm-up, the result the median over rounds. Every run's CPU seconds per rank (os.wait4) and the
machine's load average are recorded: on a shared machine they show which rounds were starved.

    python -m bench.balance --rounds 3 --steps 14                 # an idle machine: 100% and 50%
    python -m bench.balance --speeds 12,6 --rounds 3 --steps 10   # a busy one
    python -m bench.balance --speeds 15,10,5 --share-cores --name balance-cpu-2core-world3   # 3 ranks, 2 cores

More ranks than cores (``--share-cores``): rank r is pinned to core r mod cores, so ranks share a
core; every rank must then run under a quota, and the quotas of the ranks on one core must stay
well below what the machine gives them, so that the quotas (not the sharing) set the speeds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import free_port

REPO = Path(__file__).resolve().parents[1]
CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")
PREFIX = "m6-bench-balance-"
PERIOD_US = 100_000

# A model whose step takes ~1 s on one core: start-up (a few seconds) stays small against the steps.
MODEL = ["model.d_model=128", "model.num_layers=4", "model.num_heads=4", "model.ffn_dim=256", "model.max_text_len=64",
         "model.moe.every=2", "model.moe.num_experts=4", "model.moe.capacity_factor=null", "parallel.expert_parallel_size=1", "data.kind=synthetic",
         "data.sources=[]", "data.num_samples=4096", "data.eval_samples=0", "data.num_workers=0", "data.seq_len=64",
         "train.global_batch_size=24", "train.eval_every=0", "logging.every=1", "logging.console=false",
         "checkpoint.every=0", "checkpoint.resume=none"]


class BenchSkipped(RuntimeError):
    """The test bed cannot be built here; the message says why."""


class SlowGroup:
    """A cgroup v1 cpu group giving its tasks ``percent`` of one core; removed on exit."""

    def __init__(self, percent: int) -> None:
        self.percent = percent
        self.path = CPU_CGROUPS / f"{PREFIX}{os.getpid()}-{percent}"

    def __enter__(self) -> "SlowGroup":
        if not (CPU_CGROUPS / "cpu.cfs_quota_us").exists():
            raise BenchSkipped(f"no cgroup v1 cpu controller at {CPU_CGROUPS} (cpu.cfs_quota_us missing)")
        sweep_stale_groups()
        try:
            self.path.mkdir()
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(PERIOD_US * self.percent // 100))
        except OSError as e:
            remove_group(self.path)
            raise BenchSkipped(f"cannot create and limit the cgroup {self.path} ({e.strerror}; needs root and a "
                               f"writable cgroup v1 cpu controller)") from e
        return self

    def __exit__(self, *exc) -> None:
        remove_group(self.path)

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"


def remove_group(path: Path) -> None:
    """Move any task left in ``path`` back to the root group, then remove it."""
    if not path.exists():
        return
    with contextlib.suppress(OSError):
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (CPU_CGROUPS / "cgroup.procs").write_text(pid)
    for _ in range(50):  # rmdir fails while a task is still leaving
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    print(f"warning: could not remove {path}", file=sys.stderr)


def sweep_stale_groups() -> None:
    """Remove groups of earlier runs whose benchmark process is gone (killed with SIGKILL)."""
    for path in CPU_CGROUPS.glob(f"{PREFIX}*"):
        pid = int(path.name[len(PREFIX):].split("-")[0])
        if not Path(f"/proc/{pid}").exists():
            remove_group(path)


def exit_on_termination() -> None:
    """SIGTERM / SIGHUP unwind the stack like Ctrl-C does, so the ``finally`` blocks and context
    managers kill the ranks and remove the cgroup."""
    def stop(signum, frame):
        raise SystemExit(f"bench.balance: stopped by signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def run_job(run_dir: Path, speeds: list[int], balance: str, steps: int, groups: dict[int, SlowGroup],
            extra: tuple[str, ...] = ()) -> dict:
    """One train.py job of len(speeds) ranks, rank r pinned to core r, slowed when speeds[r] < 100."""
    port, world = free_port(), len(speeds)
    procs = []
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    try:
        for rank, speed in enumerate(speeds):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1")
            cmd = ["taskset", "-c", str(rank % os.cpu_count()), sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs" / "tiny.yaml"), *MODEL,
                   f"train.max_steps={steps}", f"parallel.balance={balance}", f"run.dir={run_dir}", *extra]
            if speed < 100:  # join the slow group before exec: every thread it ever makes is limited
                cmd = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(groups[speed].procs), *cmd]
            procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        outputs, cpu = [], []
        for p in procs:
            outputs.append(p.stdout.read())  # console off: a few lines, the pipe never fills
            _, status, usage = os.wait4(p.pid, 0)  # reaped here, for its own CPU time
            p.returncode = os.waitstatus_to_exitcode(status)
            cpu.append(usage.ru_utime + usage.ru_stime)
        wall = time.perf_counter() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outputs):
        if p.returncode != 0:
            raise RuntimeError(f"train.py (balance={balance}) exited with {p.returncode}:\n{out[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time_s" in r]
    timed = rows[2:]  # the first steps warm up allocators and caches
    line = next((ln for ln in outputs[0].splitlines() if ln.startswith("balance  ")), None)
    result = {"balance": balance, "step_time_s": statistics.median(r["step_time_s"] for r in timed),
              "step_times_s": [round(r["step_time_s"], 4) for r in timed], "wall_s": round(wall, 2),
              "loadavg_1min_before": load0, "loadavg_1min_after": os.getloadavg()[0],
              "compute_s_median": [round(statistics.median(r[f"compute_s/rank{k}"] for r in timed), 4)
                                   for k in range(world)],
              "cpu_s_per_rank": [round(c, 2) for c in cpu], "cpu_per_wall_per_rank": [round(c / wall, 3) for c in cpu],
              "final_loss": rows[-1]["loss"], "banner": line}
    if line and balance != "even":
        parts = line.split("|", 1)[1].split(";")
        if balance == "auto":
            result["measured_samples_per_s"] = [float(re.search(r", ([\d.e+]+) samples/s", p).group(1)) for p in parts]
        result["shares"] = [int(re.search(r": (\d+) samples", p).group(1)) for p in parts]
        if "experts" in line:
            result["experts"] = [re.search(r"experts ([\d-]+)", p).group(1) for p in parts]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--speeds", default="100,50", help="percent of a core per rank, e.g. 100,50")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--name", default="balance-cpu-2core")
    ap.add_argument("--balance", default="auto", help="the setting compared with even: auto or weights, e.g. [2,1]")
    ap.add_argument("--ep", type=int, default=1, help="parallel.expert_parallel_size (at 2, auto and weights also "
                                                      "lay out the experts unevenly)")
    ap.add_argument("--share-cores", action="store_true",
                    help="more ranks than cores: rank r on core r mod cores, every rank under a quota")
    args = ap.parse_args(argv)
    speeds = [int(s) for s in args.speeds.split(",")]
    cores = os.cpu_count() or 1
    if len(speeds) > cores and not args.share_cores:
        print(f"bench.balance: {len(speeds)} ranks need {len(speeds)} cores to pin each to its own, this machine "
              f"has {cores} (--share-cores pins rank r to core r mod {cores}, every rank under a quota)",
              file=sys.stderr)
        return 2
    per_core = [sum(s for r, s in enumerate(speeds) if r % cores == c) for c in range(cores)]
    if len(speeds) > cores and (max(speeds) >= 100 or max(per_core) > 50):
        print(f"bench.balance: ranks sharing a core must all run under quotas that add up to at most 50% of it "
              f"(--speeds {args.speeds} gives {per_core} % per core), or the sharing, not the quotas, sets the "
              f"speeds", file=sys.stderr)
        return 2

    exit_on_termination()
    runs: list[dict] = []
    try:
        with contextlib.ExitStack() as stack:
            groups = {s: stack.enter_context(SlowGroup(s)) for s in sorted(set(speeds)) if s < 100}
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            for r in range(args.rounds):
                order = ("even", args.balance) if r % 2 == 0 else (args.balance, "even")
                for i, balance in enumerate(order):
                    res = run_job(Path(tmp) / f"r{r}-{i}", speeds, balance, args.steps, groups,
                                  (f"parallel.expert_parallel_size={args.ep}",))
                    res["round"] = r
                    runs.append(res)
                    print(json.dumps({k: res[k] for k in ("round", "balance", "step_time_s", "loadavg_1min_before")}),
                          flush=True)
    except BenchSkipped as e:
        print(f"bench.balance skipped: {e}", file=sys.stderr)
        return 2
    return report(args, speeds, runs)


def report(args, speeds: list[int], runs: list[dict]) -> int:
    from bench.harness import machine_info, write_results

    # A round is clean when the quota, not other processes, set the slowest rank's speed: in the even
    # run it never waits for the others, so it used close to its quota of CPU per wall second (a
    # starved machine gives it less, and then the even split is not what is measured).
    slow = [speeds.index(min(speeds))]
    for e in (r for r in runs if r["balance"] == "even"):
        clean = all(e["cpu_per_wall_per_rank"][k] >= 0.8 * speeds[k] / 100 for k in slow)
        for r in runs:
            if r["round"] == e["round"]:
                r["clean"] = clean
    kept = [r for r in runs if r["clean"]] or runs
    clean_rounds = len({r["round"] for r in runs if r["clean"]})
    which = f"the {clean_rounds} clean rounds of {args.rounds}" if clean_rounds else \
        f"all {args.rounds} rounds, NONE of them clean"
    u = args.balance  # the uneven setting compared with even
    med = {b: statistics.median(r["step_time_s"] for r in kept if r["balance"] == b) for b in ("even", u)}
    med_all = {b: statistics.median(r["step_time_s"] for r in runs if r["balance"] == b) for b in ("even", u)}
    paired = [e["step_time_s"] / a["step_time_s"] for e, a in zip([r for r in kept if r["balance"] == "even"],
                                                                   [r for r in kept if r["balance"] == u])]
    key = "auto" if u == "auto" else "weights"
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()[:12]
    command = "python -m bench.balance " + " ".join(sys.argv[1:])
    result = {"command": command, "speeds_percent_of_core": speeds, "rounds": args.rounds, "steps": args.steps,
              "model_overrides": [*MODEL, f"parallel.expert_parallel_size={args.ep}"], "median_step_time_s": med,
              f"speedup_{key}_over_even": med["even"] / med[u],
              "clean_rounds": sorted({r["round"] for r in runs if r["clean"]}), "median_step_time_s_all_rounds": med_all,
              "speedup_all_rounds": med_all["even"] / med_all[u],
              "paired_speedups": paired, "runs": runs, "machine": machine_info(torch.device("cpu")), "lscpu": lscpu}
    lines = [f"# parallel.balance on the slowed-rank test bed ({len(speeds)} ranks at {speeds} % of a core)", "",
             f"Command: `{command}` (repository root, as root: it writes /sys/fs/cgroup/cpu).", "",
             f"Machine: {result['machine']['cpu_model']}, {os.cpu_count()} cores, torch {torch.__version__}; "
             + ("each rank pinned to its own core" if len(speeds) <= (os.cpu_count() or 1) else
                f"rank r pinned to core r mod {os.cpu_count()} (ranks share cores; every rank under its quota)")
             + ", one thread; other processes shared the machine (load average per run below).", "",
             "| setting | median step time (s) |", "|---|---|",
             f"| even | {med['even']:.3f} |", f"| {u} | {med[u]:.3f} |", "",
             f"{u} is {med['even'] / med[u]:.2f}x faster than even (each run's median step, median over {which}; "
             f"per round: {', '.join(f'{p:.2f}x' for p in paired)}; over all {args.rounds} rounds "
             f"{med_all['even'] / med_all[u]:.2f}x). A round is clean when the slowest rank's CPU seconds per wall "
             "second in the even run reached 80% of its quota; in the others, other processes on the machine, not the "
             "quota, set its speed, and the ranks were not of unequal speed as the test bed means them to be.", "",
             "| round | clean | setting | step time (s) | compute s per rank | shares | experts | measured samples/s | CPU s / wall per rank | load avg before |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['round']} | {r['clean']} | {r['balance']} | {r['step_time_s']:.3f} | {r['compute_s_median']} | "
                     f"{r.get('shares', 'even')} | {r.get('experts', '-')} | {r.get('measured_samples_per_s', '-')} | {r['cpu_per_wall_per_rank']} | "
                     f"{r['loadavg_1min_before']:.2f} |")
    write_results(args.out, args.name, result, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
