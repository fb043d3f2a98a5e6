"""Checkpoint benchmark: m6's sharded checkpoints (DCP, every rank its own share) vs the anchor, the
previous design (gather experts to rank 0, one torch.save file, every rank loads it whole;
bench/checkpoint_anchor.py), on real gloo ranks, the same Trainer objects for both.

    python -m bench.checkpoint            # the full run (~4 min on 2 idle CPU cores, ~8 when shared)
    python -m bench.checkpoint --quick    # tiny model, three layouts: a harness check, not a measurement

1. Memory: each rank's peak RSS increase during save and during load, relative to that rank's own
   share of the state (its model tensors + Adam moments, replicated ones included), at several
   (world, EP) layouts. Peak = VmHWM after the operation, reset before it (echo 5 >
   /proc/self/clear_refs), minus the RSS just before (after gc and malloc_trim, so memory freed
   earlier is not reused unseen). Async saves are measured until the files are complete, plus the
   staging buffer they copy into (allocated at the first async save, the warm-up, and kept: it is
   in the RSS before the measured ones).
2. Time of the same operations, interleaved round-robin (rotating order), every rank pinned to
   one core (rank r -> core r mod cores, one thread, OMP_PROC_BIND=close OMP_PLACES=cores); for
   async saves the stall (time save_checkpoint() takes to return, slowest rank) and the time until
   the files are complete. Each operation starts after a barrier and ends with one, so its time
   is the slowest rank's.
3. Resume at another layout: N steps straight at world 4 / EP 4 vs the same N steps in three
   segments (world 4 / EP 4 -> save -> world 2 / EP 2 -> save -> world 1), fixed global batch,
   dropless, fp32, dropout 0: max |loss difference| per segment.
4. Per-rank checkpoint bytes of the shipped configs at their published GPU counts (counted on
   `meta`, nothing allocated): m6 vs the anchor's rank 0.

glibc's malloc is left at its defaults (MALLOC_MMAP_MAX_ is removed from the environment): the
other benchmarks set MALLOC_MMAP_MAX_=0 for stable timings, but that keeps freed memory in the
heap and changes what RSS shows.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.checkpoint_anchor import anchor_load, anchor_save
from bench.harness import current_rss_bytes, free_port, machine_info, machine_tag, peak_rss_bytes, reset_peak_rss, write_results
from m6 import config as m6config
from m6.config import load
from m6.model import build_meta_model
from m6.model.flops import count_parameters
from m6.parallel.layout import resolve_expert_parallel_size
from m6.checkpoint import sharded_io
from m6.train.loop import Trainer

PIN_ENV = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores", "OMP_NUM_THREADS": "1"}
MODEL = {
    # Experts are 98% of the 34.2 M parameters: 410 MB of fp32 weights + Adam moments in all.
    "full": ["model.d_model=256", "model.num_layers=2", "model.num_heads=4", "model.ffn_dim=512",
             "model.moe.every=1", "model.moe.num_experts=64"],
    "quick": ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64",
              "model.moe.every=1", "model.moe.num_experts=8"],
}
COMMON = ["model.moe.capacity_factor=null", "model.dropout=0.0", "model.max_text_len=32", "model.image_size=16",
          "model.patch_size=8", "data.kind=synthetic", "data.sources=[]", "data.num_workers=0",
          "data.num_samples=256", "data.eval_samples=8", "data.seq_len=32", "train.global_batch_size=8",
          "train.precision=fp32", "train.device=cpu", "train.eval_every=0", "checkpoint.every=0",
          "checkpoint.keep=2", "logging.console=false", "logging.wandb.enabled=false"]
LAYOUTS = {"full": [(1, 1), (2, 2), (2, 1), (4, 4), (4, 2)], "quick": [(1, 1), (2, 2), (4, 2)]}
SAVES = ("m6 sync", "m6 async", "anchor")
LOADS = ("m6", "anchor")
BYTES_PER_PARAM = 12  # fp32 weights + AdamW exp_avg + exp_avg_sq
SHIPPED = [("configs/m6-100b.yaml", 64), ("configs/m6-1t.yaml", 480), ("configs/m6-10t.yaml", 512)]
RATIO_TARGET = 1.25
MiB = 2**20


# --------------------------------------------------------------------------- rank processes


def _entry(rank: int, fn: Callable, world: int, port: int, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.sched_setaffinity(0, {rank % os.cpu_count()})  # threads started later (async writer) inherit it
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world: int, *args) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh gloo processes (a rank's failure re-raises)."""
    mp.spawn(_entry, args=(fn, world, free_port(), args), nprocs=world, join=True)


def build_trainer(model: list[str], run_dir: str, ep: int, *extra: str) -> Trainer:
    return Trainer(load(None, [*model, *COMMON, f"run.dir={run_dir}", f"parallel.expert_parallel_size={ep}",
                               *extra]))


_libc = ctypes.CDLL("libc.so.6")


def _settle() -> None:
    """Free what is garbage and hand glibc's free pages back, so the next peak counts new memory."""
    gc.collect()
    _libc.malloc_trim(0)


def _cpus_allowed() -> str:
    with open("/proc/self/status") as f:
        return next(line.split(":")[1].strip() for line in f if line.startswith("Cpus_allowed_list"))


class VirtualPeak:
    """Peak virtual size and RSS, sampled every ~1 ms from a thread (a diagnostic: the reads cost CPU)."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak_vm = self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        with open("/proc/self/statm") as f:
            size, resident = (int(x) * self.page for x in f.read().split()[:2])
        self.peak_vm, self.peak_rss = max(self.peak_vm, size), max(self.peak_rss, resident)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(0.001)

    def __enter__(self) -> "VirtualPeak":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def measure(op: Callable[[], None], finish: Callable[[], None] | None = None) -> dict:
    """One collective operation on every rank: this rank's peak RSS increase and times.

    ``returned_s``: until ``op`` returned on this rank; ``total_s``: until ``finish`` (an async
    save's wait) returned on every rank; peaks likewise (``peak_returned`` / ``peak``)."""
    _settle()
    dist.barrier()
    rss0 = current_rss_bytes()
    reset_peak_rss()
    t0 = time.perf_counter()
    op()
    returned = time.perf_counter() - t0
    peak_returned = peak_rss_bytes() - rss0
    if finish is not None:
        finish()
    dist.barrier()
    total = time.perf_counter() - t0
    return {"returned_s": returned, "total_s": total, "peak_returned": peak_returned,
            "peak": peak_rss_bytes() - rss0, "rss_before": rss0}


def share_bytes(tr: Trainer) -> dict:
    """This rank's state: model tensors + optimizer moments, split into expert rows and the rest."""
    expert = replicated = largest = 0
    seen = set()
    named = [(k, v) for k, v in tr.state.model.tensors().items()]
    named += [(k, v) for k, s in tr.state.optimizer.tensors().items() for v in s.values()]
    for name, t in named:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        largest = max(largest, storage.nbytes())
        if name in tr.sharded.expert_params:
            expert += storage.nbytes()
        else:
            replicated += storage.nbytes()
    return {"expert": expert, "replicated": replicated, "total": expert + replicated, "largest_tensor": largest}


def fingerprint(tr: Trainer) -> list[float]:
    """Per-tensor float64 sums of this rank's weights and moments: a load that puts wrong rows in changes them."""
    tensors = list(tr.state.model.tensors().values())
    tensors += [v for s in tr.state.optimizer.tensors().values() for v in s.values()]
    return [t.double().sum().item() for t in tensors]


def _layout_rank(rank: int, world: int, ep: int, model: list[str], root: str, rounds: int, out: str) -> None:
    """Part 1 + 2 at one layout: warm-up, then ``rounds`` rounds of every save and load, rotated."""
    tr = build_trainer(model, f"{root}/run", ep)
    tr.train_step()  # Adam moments exist from here on
    anchor_file = Path(root) / "anchor.pt"
    share = share_bytes(tr)
    want = fingerprint(tr)

    def clear(variant: str) -> None:  # the previous copy goes, outside the measured time
        if rank == 0:
            if variant == "anchor":
                anchor_file.unlink(missing_ok=True)
            else:
                shutil.rmtree(tr.checkpoints.dir, ignore_errors=True)
        dist.barrier()

    def save(variant: str) -> dict:
        clear(variant)
        if variant == "anchor":
            return measure(lambda: anchor_save(tr, anchor_file))
        tr.cfg.checkpoint.async_save = variant == "m6 async"  # the config key save_checkpoint() reads
        held = tr.checkpoints.staging.nbytes if variant == "m6 async" else 0  # allocated earlier, kept
        return {**measure(tr.save_checkpoint, tr.checkpoints.wait), "staging_held": held}

    def load_(variant: str) -> dict:
        if variant == "anchor":
            rec = measure(lambda: anchor_load(tr, anchor_file))
        else:
            rec = measure(lambda: tr.state.load(tr.checkpoints, tr.checkpoints.latest()))
        rec["same_state"] = fingerprint(tr) == want
        return rec

    for v in SAVES:  # warm-up: first-call costs (imports, thread pools) stay out of the rounds
        save(v)
    for v in LOADS:
        load_(v)
    records: dict[str, list[dict]] = {f"save {v}": [] for v in SAVES} | {f"load {v}": [] for v in LOADS}
    for r in range(rounds):
        for v in SAVES[r % len(SAVES):] + SAVES[:r % len(SAVES)]:
            records[f"save {v}"].append(save(v))
        for v in LOADS[r % len(LOADS):] + LOADS[:r % len(LOADS)]:
            records[f"load {v}"].append(load_(v))

    # Diagnostic, untimed: one m6 load with a 1 ms sampler of virtual size and RSS.
    _settle()
    dist.barrier()
    with VirtualPeak() as vp:
        vm0, rss0 = vp.peak_vm, vp.peak_rss
        tr.state.load(tr.checkpoints, tr.checkpoints.latest())
    sampled = {"vm_increase": vp.peak_vm - vm0, "rss_increase": vp.peak_rss - rss0}
    step_dir = tr.checkpoints.latest()
    files = {p.name: p.stat().st_size for p in sorted(step_dir.iterdir())} if rank == 0 else None
    result = {"rank": rank, "cpus": _cpus_allowed(), "share": share, "records": records,
              "m6_load_sampled": sampled, "m6_files": files,
              "anchor_file_bytes": anchor_file.stat().st_size if rank == 0 else None}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


def _resume_rank(rank: int, world: int, ep: int, model: list[str], root: str, steps: int, segment: dict,
                 out: str) -> None:
    """Part 3, one process group: optionally the straight run, then one segment of the split run."""
    losses = {}
    if segment.get("straight"):
        tr = build_trainer(model, f"{root}/straight", ep, f"train.max_steps={steps}")
        losses["straight"] = [tr.train_step()["loss"] for _ in range(steps)]
        del tr
    resume = segment.get("resume") or "none"
    tr = build_trainer(model, f"{root}/split", ep, f"train.max_steps={steps}", f"checkpoint.resume={resume}")
    start = tr.step
    losses["segment"] = [tr.train_step()["loss"] for _ in range(segment["until"] - start)]
    path = tr.save_checkpoint(wait=True) if segment["until"] < steps else None
    if rank == 0:
        Path(out).write_text(json.dumps({"start": start, "losses": losses, "saved": str(path) if path else None}))


# --------------------------------------------------------------------------- the parts


def run_layouts(model: list[str], layouts: list[tuple[int, int]], rounds: int, work: Path) -> list[dict]:
    rows = []
    for world, ep in layouts:
        t0, load_before = time.time(), os.getloadavg()[0]
        root, out = work / f"w{world}e{ep}", work / f"w{world}e{ep}-out"
        root.mkdir()
        out.mkdir()
        spawn(_layout_rank, world, ep, model, str(root), rounds, str(out))
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
        shutil.rmtree(root)
        rows.append(summarise_layout(world, ep, ranks, round(time.time() - t0, 1)))
        rows[-1]["loadavg_1min_before_after"] = [load_before, os.getloadavg()[0]]  # other jobs on the cores
        print(f"layout world {world} EP {ep}: {rows[-1]['wall_s']} s", file=sys.stderr, flush=True)
    return rows


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


def summarise_layout(world: int, ep: int, ranks: list[dict], wall_s: float) -> dict:
    ops = list(ranks[0]["records"])
    per_rank = []
    for r in ranks:
        own = r["share"]["total"]
        mem = {}
        for op, recs in r["records"].items():
            # An async save's staging buffer predates it (the warm-up allocated it): counted on top.
            peaks = [x["peak"] + x.get("staging_held", 0) for x in recs]
            mem[op] = {"peak_increase_bytes": max(peaks), "peak_increase_all": peaks, "ratio": max(peaks) / own}
            if op == "save m6 async":
                stall = [x["peak_returned"] + x["staging_held"] for x in recs]
                mem[op]["at_return_bytes"] = max(stall)
                mem[op]["staging_bytes"] = max(x["staging_held"] for x in recs)
        per_rank.append({"rank": r["rank"], "cpus": r["cpus"], "share": r["share"], "memory": mem,
                         "rss_before_bytes": r["records"]["save m6 sync"][0]["rss_before"],
                         "m6_load_sampled": r["m6_load_sampled"]})
    times = {}
    for op in ops:
        # Every operation ends with a barrier: rank 0's total is the slowest rank's.
        times[op] = _stats([x["total_s"] for x in ranks[0]["records"][op]])
    n = len(ranks[0]["records"]["save m6 async"])
    stalls = [max(r["records"]["save m6 async"][i]["returned_s"] for r in ranks) for i in range(n)]
    times["save m6 async: stall"] = _stats(stalls)
    for num, den in (("save anchor", "save m6 sync"), ("load anchor", "load m6")):
        times[f"{num} / {den}"] = _stats([a / b for a, b in zip(times[num]["all"], times[den]["all"])])  # same round
    same = all(x["same_state"] for r in ranks for op in ("load m6", "load anchor") for x in r["records"][op])
    return {"world": world, "ep": ep, "ranks": per_rank, "times": times, "loads_restore_same_state": same,
            "m6_files": ranks[0]["m6_files"], "anchor_file_bytes": ranks[0]["anchor_file_bytes"],
            "wall_s": wall_s}


def run_resume(model: list[str], steps: int, segments: list[tuple[int, int, int]], work: Path) -> dict:
    """``segments``: (world, ep, until step); the first also runs the straight run at its layout."""
    root = work / "resume"
    root.mkdir()
    outs, resume = [], None
    for i, (world, ep, until) in enumerate(segments):
        out = work / f"resume-{i}.json"
        spawn(_resume_rank, world, ep, model, str(root), steps, {"straight": i == 0, "resume": resume, "until": until},
              str(out))
        outs.append(json.loads(out.read_text()))
        resume = outs[-1]["saved"]
    straight = outs[0]["losses"]["straight"]
    rows = []
    for (world, ep, until), o in zip(segments, outs):
        got = o["losses"]["segment"]
        ref = straight[o["start"]:until]
        diffs = [abs(a - b) for a, b in zip(got, ref)]
        rows.append({"world": world, "ep": ep, "steps": [o["start"] + 1, until], "losses": got, "straight": ref,
                     "max_abs_diff": max(diffs), "max_rel_diff": max(d / abs(b) for d, b in zip(diffs, ref))})
    shutil.rmtree(root)
    return {"steps": steps, "straight_layout": list(segments[0][:2]), "straight_losses": straight, "segments": rows}


def reader_copies(work: Path, tensor_mib: int = 32) -> dict:
    """Peak RSS increase of reading one, then two, tensors of ``tensor_mib`` through m6's sharded reader
    (DCP) into existing tensors, and of a plain torch.load of one, in this otherwise idle process."""
    tensors = {"a": torch.randn(tensor_mib * MiB // 4), "b": torch.randn(tensor_mib * MiB // 4)}
    sharded_io.write(work / "reader1", {"a": tensors["a"]}, {}).commit()
    sharded_io.write(work / "reader2", tensors, {}).commit()
    torch.save(tensors["a"], work / "a.pt")
    targets = {k: torch.zeros_like(v) for k, v in tensors.items()}

    def peak(fn: Callable[[], object]) -> int:
        _settle()
        rss0 = current_rss_bytes()
        reset_peak_rss()
        fn()
        return peak_rss_bytes() - rss0

    return {"tensor_bytes": tensors["a"].nbytes,
            "m6_sharded_read_one": peak(lambda: sharded_io.read(work / "reader1", {"a": targets["a"]}, {})),
            "m6_sharded_read_two": peak(lambda: sharded_io.read(work / "reader2", targets, {})),
            "torch_load_one": peak(lambda: torch.load(work / "a.pt", weights_only=True))}


def shipped_config_bytes(config: str, num_gpus: int, bytes_per_param: int = BYTES_PER_PARAM) -> dict:
    """Per-rank checkpoint bytes of ``config`` on ``num_gpus`` ranks (parameters counted on meta).

    EP = the largest divisor of ``num_gpus`` that divides num_experts (parallel.expert_parallel_size
    auto). m6: ``per_rank`` = experts / EP + replicated / world (each rank writes its experts' rows;
    replicated tensors once, spread); ``held_per_rank`` = experts / EP + replicated (what a rank
    holds, stages for an async save and reads at load); ``written_spread`` = all / world (DCP also
    spreads the experts over their EP < world replicas). Anchor: rank 0 gathers and writes all of
    it, and at load every rank reads all of it.
    """
    cfg = m6config.load(config)
    size = count_parameters(build_meta_model(cfg.model))
    ep = resolve_expert_parallel_size("auto", num_gpus, cfg.model.moe.num_experts)
    expert, replicated = size.expert, size.total - size.expert
    return {"config": config, "gpus": num_gpus, "ep": ep, "num_experts": cfg.model.moe.num_experts,
            "total_params": size.total, "expert_params": expert, "replicated_params": replicated,
            "m6_per_rank_bytes": bytes_per_param * (expert / ep + replicated / num_gpus),
            "m6_held_per_rank_bytes": bytes_per_param * (expert / ep + replicated),
            "m6_written_spread_bytes": bytes_per_param * size.total / num_gpus,
            "anchor_rank0_bytes": bytes_per_param * size.total}


# --------------------------------------------------------------------------- verdicts and report


def targets(result: dict) -> list[dict]:
    rows = result["layouts"]
    out = []
    for op, label in (("save m6 sync", "m6 save (sync)"), ("save m6 async", "m6 save (async, until complete)"),
                      ("load m6", "m6 load")):
        worst = max((r["memory"][op]["ratio"], row["world"], row["ep"], r["rank"]) for row in rows for r in row["ranks"])
        out.append({"target": f"{label}: peak RSS increase <= {RATIO_TARGET}x the rank's own share, every rank and layout",
                    "measured": f"max {worst[0]:.2f}x (world {worst[1]} EP {worst[2]} rank {worst[3]})",
                    "status": "met" if worst[0] <= RATIO_TARGET else "missed"})
    # EP = world, the fixed model: the share shrinks as 1/world, so a ratio that stays flat means
    # per-rank memory follows the share; the anchor's grows with world (rank 0 holds everything).
    by_world = {}
    for row in rows:
        if row["ep"] == row["world"]:
            by_world[row["world"]] = {op: (max(r["memory"][op]["ratio"] for r in row["ranks"]),
                                           max(r["memory"][op]["peak_increase_bytes"] for r in row["ranks"]))
                                      for op in ("save m6 sync", "save m6 async", "load m6", "save anchor", "load anchor")}
    worlds = sorted(by_world)
    if len(worlds) > 1:
        def series(op: str) -> str:
            return (" -> ".join(f"{by_world[w][op][0]:.2f}" for w in worlds) + " ("
                    + " -> ".join(f"{by_world[w][op][1] / MiB:.0f}" for w in worlds) + " MiB)")

        m6_ops = {"save m6 sync": "sync save", "save m6 async": "async save", "load m6": "load"}
        grown = [label for op, label in m6_ops.items() if by_world[worlds[-1]][op][0] - by_world[worlds[0]][op][0] > 0.10]
        out.append({"target": f"m6's worst-rank ratio does not grow with world size (EP = world {', '.join(map(str, worlds))}; "
                              "growth <= 0.10)",
                    "measured": "; ".join(f"{label} {series(op)}" for op, label in m6_ops.items()),
                    "status": "met" if not grown else f"missed ({', '.join(grown)})"})
        rank0 = [next(r for r in row["ranks"] if r["rank"] == 0)["memory"]["save anchor"]["ratio"]
                 for w in worlds for row in rows if row["world"] == w and row["ep"] == w]
        out.append({"target": "anchor: rank 0's ratio grows with world size (EP = world)",
                    "measured": f"save (rank 0) {' -> '.join(f'{x:.2f}' for x in rank0)}; load (worst rank) "
                                f"{series('load anchor')}",
                    "status": "as expected" if all(a < b for a, b in zip(rank0, rank0[1:])) else "not seen"})
    res = result["resume"]
    worst = max(s["max_rel_diff"] for s in res["segments"])
    out.append({"target": "resume at another layout: loss within ~1e-6 relative of the straight run",
                "measured": f"max relative {worst:.1e} (segments: "
                            + ", ".join(f"{s['max_rel_diff']:.1e}" for s in res["segments"]) + ")",
                "status": "met" if worst <= 1e-5 else "missed"})
    return out


def _t(s: dict) -> str:
    return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


def render(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"# Checkpoints: m6 (sharded, DCP) vs the anchor (gather to rank 0, one file) ({m['cpu_model']})", "",
        f"Command: `{result['command']}`  ",
        f"Machine: {m['cpu_count']} CPUs, {m['platform']}, python {m['python']}, torch {m['torch']}; "
        f"env {result['env']}; total wall {result['wall_s']} s.  ",
        f"Model: `{' '.join(result['model_overrides'])}` + `{' '.join(COMMON)}`: {result['num_params'] / 1e6:.1f} M "
        f"parameters ({100 * result['expert_params'] / result['num_params']:.1f}% experts), "
        f"{result['state_bytes'] / MiB:.0f} MiB of fp32 weights + Adam moments.  ",
        "Ranks: real gloo processes (torch.multiprocessing spawn), rank r pinned to core r mod "
        f"{m['cpu_count']}, one thread each; checkpoints on the local disk (fsync'd by both designs), "
        "loads read what was just written (page cache).", "",
        "## 1. Peak RSS increase during the operation / the rank's own share", "",
        "Own share = the rank's model tensors + Adam moments (its experts' rows + every replicated tensor). "
        "Peak = VmHWM (reset before the operation via /proc/self/clear_refs) minus the RSS before it, after "
        f"gc + malloc_trim; the largest of {result['rounds']} rounds. Async: until the files are complete "
        "(at save_checkpoint()'s return in brackets). Ratio (MiB).", "",
        "| world | EP | rank | own share MiB | m6 save sync | m6 save async | anchor save | m6 load | anchor load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["layouts"]:
        for r in row["ranks"]:
            mem = r["memory"]
            cell = lambda op: f"{mem[op]['ratio']:.2f} ({mem[op]['peak_increase_bytes'] / MiB:.0f})"  # noqa: E731
            asy = mem["save m6 async"]
            lines.append(f"| {row['world']} | {row['ep']} | {r['rank']} | {r['share']['total'] / MiB:.1f} | "
                         f"{cell('save m6 sync')} | {cell('save m6 async')} [{asy['at_return_bytes'] / MiB:.0f}] | "
                         f"{cell('save anchor')} | {cell('load m6')} | {cell('load anchor')} |")
    lines += ["", "Bytes each rank wrote (m6: its DCP data file; anchor: rank 0's one file), MiB:", "",
              "| world | EP | m6 per-rank files | m6 sum | anchor file |", "|---|---|---|---|---|"]
    for row in result["layouts"]:
        data = {k: v for k, v in row["m6_files"].items() if k.endswith(".distcp")}
        lines.append(f"| {row['world']} | {row['ep']} | {', '.join(f'{v / MiB:.1f}' for v in data.values())} | "
                     f"{sum(data.values()) / MiB:.1f} (+ .metadata {row['m6_files'].get('.metadata', 0) / 1024:.0f} KiB) | "
                     f"{row['anchor_file_bytes'] / MiB:.1f} |")
    lines += ["", "Diagnostic (one untimed m6 load per rank, sampled every ~1 ms from a thread): increase of the "
              "virtual size and of RSS during the load, MiB:", "",
              "| world | EP | rank | virtual size | RSS (sampled) |", "|---|---|---|---|---|"]
    for row in result["layouts"]:
        for r in row["ranks"]:
            s = r["m6_load_sampled"]
            lines.append(f"| {row['world']} | {row['ep']} | {r['rank']} | {s['vm_increase'] / MiB:.0f} | "
                         f"{s['rss_increase'] / MiB:.0f} |")
    lines += ["", f"## 2. Wall time, seconds: median [min-max] of {result['rounds']} interleaved rounds", "",
              "Every operation starts after a barrier and ends with one (the slowest rank's time). Async stall = "
              "the slowest rank's save_checkpoint() return; async complete = until every rank's files are written "
              "and rank 0 has renamed the step directory into place. Paired ratios: per round (the variants run back to "
              "back in rotating order), then median [min-max]. The 2 cores are shared with other jobs (the load "
              "average column; this benchmark alone keeps it near the world size): expect noise; the memory figures "
              "above are the main result.", "",
              "| world | EP | m6 save sync | m6 async: stall | m6 async: complete | anchor save | anchor / m6 sync save "
              "(paired) | m6 load | anchor load | anchor / m6 load (paired) | 1-min load avg before, after |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["layouts"]:
        t = row["times"]
        lines.append(f"| {row['world']} | {row['ep']} | {_t(t['save m6 sync'])} | {_t(t['save m6 async: stall'])} | "
                     f"{_t(t['save m6 async'])} | {_t(t['save anchor'])} | {_t(t['save anchor / save m6 sync'])} | "
                     f"{_t(t['load m6'])} | {_t(t['load anchor'])} | {_t(t['load anchor / load m6'])} | "
                     f"{', '.join(f'{x:.1f}' for x in row['loadavg_1min_before_after'])} |")
    same = all(row["loads_restore_same_state"] for row in result["layouts"])
    lines += ["", f"Every load (both designs, every round, every rank) restored the state it read bit for bit: {same}."]
    res = result["resume"]
    lines += ["", "## 3. Resume at another layout", "",
              f"{res['steps']} steps straight at world {res['straight_layout'][0]} / EP {res['straight_layout'][1]} "
              "vs the same steps in segments, each resumed from the previous segment's checkpoint (global batch "
              "8, dropless, fp32, dropout 0).", "",
              "| segment | world | EP | steps | max abs loss diff | max rel loss diff |", "|---|---|---|---|---|---|"]
    for i, s in enumerate(res["segments"]):
        lines.append(f"| {i + 1} | {s['world']} | {s['ep']} | {s['steps'][0]}-{s['steps'][1]} | {s['max_abs_diff']:.2e} | "
                     f"{s['max_rel_diff']:.2e} |")
    lines += ["", "## 4. Shipped configs: checkpoint bytes per rank (12 B/param: fp32 weights + 2 Adam moments)", "",
              "EP = the largest divisor of the GPU count that divides num_experts. m6 per rank = experts/EP + "
              "replicated/world; held = experts/EP + replicated (what a rank stages for an async save and reads at "
              "load); spread = all/world (DCP also spreads the experts over their replicas when EP < world). "
              "Anchor: rank 0 gathers and writes all of it; at load every rank reads all of it.", "",
              "| config | GPUs | EP | params (experts) | m6 per rank | m6 held per rank | m6 spread | anchor rank 0 | anchor / m6 |",
              "|---|---|---|---|---|---|---|---|---|"]
    gib = lambda b: f"{b / 2**30:,.2f} GiB"  # noqa: E731
    for c in result["shipped"]:
        lines.append(f"| {c['config']} | {c['gpus']} | {c['ep']} | {c['total_params'] / 1e9:,.1f} B "
                     f"({100 * c['expert_params'] / c['total_params']:.2f}%) | {gib(c['m6_per_rank_bytes'])} | "
                     f"{gib(c['m6_held_per_rank_bytes'])} | {gib(c['m6_written_spread_bytes'])} | "
                     f"{gib(c['anchor_rank0_bytes'])} | {c['anchor_rank0_bytes'] / c['m6_per_rank_bytes']:,.0f}x |")
    lines += ["", "## Targets", "", "| target | measured | status |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']} | {t['status']} |" for t in result["targets"]]
    ranks = [r for row in result["layouts"] for r in row["ranks"]]
    per_largest = [r["memory"]["load m6"]["peak_increase_bytes"] / r["share"]["largest_tensor"] for r in ranks]
    ratios = {op: [r["memory"][op]["ratio"] for r in ranks] for op in ("save m6 async", "save m6 sync")}
    vm = [r["m6_load_sampled"]["vm_increase"] / MiB for r in ranks]
    rc = result["reader_copies"]
    lines += ["", "Notes:", "",
              "- m6's load peak is not a fraction of the share but of the largest tensor read: "
              f"{min(per_largest):.1f}-{max(per_largest):.1f}x the rank's largest tensor (DCP's reader holds about "
              "two items at a time: the previous one is still referenced while the next loads. Alone in one process, "
              f"reading one {rc['tensor_bytes'] / MiB:.0f} MiB tensor through m6.checkpoint.sharded_io.read raised RSS by "
              f"{rc['m6_sharded_read_one'] / MiB:.0f} MiB, two of them by {rc['m6_sharded_read_two'] / MiB:.0f} MiB, "
              f"a torch.load of one by {rc['torch_load_one'] / MiB:.0f} MiB; the rest varies between ranks and rounds "
              "and was not traced). As the share shrinks with world size, "
              "that fixed part weighs more: the ratio rises while the bytes fall. A checkpoint read at another "
              "layout loads each saved chunk whole and then narrows it (DCP's reader code; not measured here), so "
              "there the bound is the saved layout's largest chunk.",
              "- m6's async save copies the rank's whole share into its staging buffer, allocated at the first async "
              "save and kept for the run (counted here on top of each save's RSS increase): "
              f"{min(ratios['save m6 async']):.2f}-{max(ratios['save m6 async']):.2f}x; the sync "
              f"save writes straight from the tensors: {min(ratios['save m6 sync']):.2f}-{max(ratios['save m6 sync']):.2f}x.",
              "- Virtual size during an m6 load grows by "
              f"{min(vm):.0f}-{max(vm):.0f} MiB per rank (sampled; a lower bound, freed heap ranges are reused), against "
              f"a checkpoint of {result['state_bytes'] / MiB:.0f} MiB: a rank allocates only the rows it reads (an "
              "earlier version allocated every tensor at its global shape on every rank: 256-452 MiB here).",
              "- The anchor's rank 0 save holds the gathered expert tensors plus, per tensor, the gather buffers "
              "(dist.gather into a list, then torch.cat); with EP < world the first rank of every EP group gathers "
              "too. Its load reads the whole file on every rank."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, three layouts: a harness check")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds per layout (after one warm-up)")
    p.add_argument("--layouts", nargs="*", default=None, metavar="WORLDxEP",
                   help="layouts for parts 1-2, e.g. 1x1 4x2 (default: 1x1 2x2 2x1 4x4 4x2)")
    p.add_argument("--resume-steps", type=int, default=12, help="steps of the straight run (split in 3 segments)")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--workdir", default=None, help="where checkpoints are written (default: a temp dir)")
    args = p.parse_args(argv)
    if any(os.environ.get(k) != v for k, v in PIN_ENV.items()) or "MALLOC_MMAP_MAX_" in os.environ:
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_MAX_"} | PIN_ENV
        os.execve(sys.executable, [sys.executable, "-m", "bench.checkpoint", *(argv or sys.argv[1:])], env)
    started = time.time()
    kind = "quick" if args.quick else "full"
    model = MODEL[kind]
    work = Path(tempfile.mkdtemp(prefix="m6-bench-checkpoint-", dir=args.workdir))
    try:
        cfg = load(None, [*model, *COMMON])
        size = count_parameters(build_meta_model(cfg.model))
        chosen = [tuple(map(int, x.split("x"))) for x in args.layouts] if args.layouts else LAYOUTS[kind]
        reader = reader_copies(work)
        layouts = run_layouts(model, chosen, args.rounds, work)
        n = args.resume_steps
        resume = run_resume(model, n, [(4, 4, n // 3), (2, 2, 2 * n // 3), (1, 1, n)], work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    command = "python -m bench.checkpoint" + (" --quick" if args.quick else "") + \
        (f" --rounds {args.rounds}" if args.rounds != 5 else "") + \
        (f" --layouts {' '.join(args.layouts)}" if args.layouts else "")
    result = {"benchmark": "checkpoint", "command": command, "machine": machine_info(torch.device("cpu")),
              "env": {**PIN_ENV, "MALLOC_MMAP_MAX_": "unset (glibc default)"}, "model_overrides": model,
              "common_overrides": COMMON, "num_params": size.total, "expert_params": size.expert,
              "state_bytes": BYTES_PER_PARAM * size.total, "rounds": args.rounds, "layouts": layouts,
              "resume": resume, "reader_copies": reader, "shipped": [shipped_config_bytes(c, g) for c, g in SHIPPED]}
    result["targets"] = targets(result)
    result["wall_s"] = round(time.time() - started, 1)
    stem = f"checkpoint-{machine_tag(torch.device('cpu'))}" + ("-quick" if args.quick else "")
    write_results(args.out, stem, result, render(result))


if __name__ == "__main__":
    main()
