"""Planner validation: m6.plan's predicted per-rank peak memory and step time against real m6
runs of the same layouts on this host (CPU, gloo, torchrun at world 1, 2 and 4).

    python -m bench.plan_validation                 # every plan, 3 rounds (~15-20 min on 2 cores)
    python -m bench.plan_validation --only w2-ep2   # plans whose name contains the text

1. The gloo link: bench.plan_measure --probe times all_reduce and m6's all-to-all at 16 KiB -
   4 MiB per rank under torchrun at world 2 and 4, as a step issues them (fresh buffers, the
   mean per call: a step pays the sum of its calls); latency and bandwidth are fitted to the
   planner's own formulas (all-to-all: latency + bytes sent to others / bandwidth; ring
   all-reduce: latency + 2(n-1)/n x bytes / bandwidth) and passed to it, as --latency-us and
   --intra-node-GBps would be.
2. PREDICTED, per plan: the functions ``python -m m6.plan --gpu cpu`` ranks layouts with
   (m6.plan.memory.RankMemory -> m6.memory.estimate, m6.plan.timing.step_time with a
   HostProfile of the threads each rank gets, cores // ranks, timed in as many processes at once
   as there are ranks, waiting for each other where the run's collectives do), on this layout
   alone rather than searched. Memory: the estimate's ``peak_shared`` (device
   and host are one memory on CPU; equal to its device peak when nothing is offloaded).
3. MEASURED, per plan: a real Trainer under torchrun (bench.plan_measure): 3 warm-up steps, the
   median [min-max] of step_time_s - data_wait_s over 8 steps (data_wait_s shown), then one metered step: its
   high-water mark of live tensor storages (LiveBytes from the storages alive at its start, each uncounted once
   freed), the largest of the ranks.
   Steps 2 and 3 alternate ``--rounds`` times per plan (the host's speed drifts); the medians of
   the rounds' predicted and measured step times are compared, and the largest measured peak.

Batches: full-length samples (bench.plan_measure.DenseSamples), an image in every row and no
padding, dropless MoE (capacity_factor null): the densest batch the planner assumes, minus one
label per row. Routing is forced balanced (model.moe.force_balance), the planner's assumption;
what real routing's imbalance adds at EP > 1 is outside the model (docs/planning.md: The model).
Offloaded plans are also compared device and host apart: host = the offload's storages at the
step's start (masters, gradient buffers, optimizer state, streamed homes, staging), against the
planner's host bytes less the update's temporaries; device = the rest of the measured peak,
against the planner's device peak (what a GPU would hold: the synchronous update's temporaries
come after backward's peak; the delayed update's run beside the next step's forward and
backward, which the one-memory peak above assumes overlap its peak, and whether they do on a
CPU depends on how long each takes). `--only zero` runs the memory.offload=zero plans (#46).
Targets (issue): memory within 10%, step time within 15%.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.harness import write_results
from bench.plan_measure import BASE_CONFIG, COMMON, PIPELINE_PHASE
from m6.config import load
from m6.memory.estimate import activation_report
from m6.config import accumulation_steps, micro_batch_size
from m6.plan.memory import RankMemory
from m6.plan.pipeline import SCHEDULES, stage_config, stages_per_rank
from m6.plan.search import ModelSplit, pipeline_builds, split_memory, split_step_time
from m6.plan.tensor_parallel import rank_config
from m6.plan.timing import GLOO_GATHER_SCATTER_COST, HostProfile, cpu_hardware, step_time

CORES = os.cpu_count() or 1
MEMORY_TARGET, TIME_TARGET = 0.10, 0.15
MAX_LOAD = 2.5
SMALL = ["model.d_model=128", "model.num_layers=4", "model.num_heads=4", "model.ffn_dim=256", "model.moe.every=2",
         "model.moe.num_experts=8", "model.moe.capacity_factor=null", "data.seq_len=128", "model.max_text_len=128",
         "train.global_batch_size=16", "parallel.expert_parallel_size=1", "model.moe.force_balance=true"]
WIDE = [*SMALL, "model.d_model=256", "model.ffn_dim=512", "model.moe.num_experts=16"]
FULL, AUTO = "memory.activation_checkpointing=full", "memory.activation_checkpointing=auto"
ZERO = ["train.precision=bf16", "memory.offload=zero", "memory.offload_blocks=[]"]  # resident unless named
DELAYED = ["optim.delayed_update=true", "optim.delayed_update_after=0"]
TRANSIENT_HOST = "optimizer step temporaries"  # allocated during the update, not at the step's start


@dataclass
class Plan:
    name: str
    world_size: int
    overrides: list[str]


def ep(n: int) -> str:
    return f"parallel.expert_parallel_size={n}"


PLANS = [
    Plan("w1-base", 1, [*SMALL]),
    Plan("w1-mb4x4-full", 1, [*SMALL, "train.micro_batch_size=4", FULL]),
    Plan("w1-wide-auto-g4", 1, [*WIDE, AUTO, "optim.apply_groups=4"]),
    Plan("w1-off-opt", 1, [*SMALL, "memory.offload=optimizer"]),
    Plan("w1-off-params-mb8", 1, [*SMALL, "memory.offload=optimizer+params", "train.micro_batch_size=8"]),
    Plan("w2-ep1", 2, [*SMALL, ep(1)]),
    Plan("w2-ep2", 2, [*SMALL, ep(2)]),
    Plan("w2-ep2-bf16-mb4x2", 2, [*SMALL, ep(2), "model.moe.a2a_dtype=bf16", "train.micro_batch_size=4"]),
    Plan("w2-ep2-full-off-opt", 2, [*SMALL, ep(2), FULL, "memory.offload=optimizer"]),
    Plan("w2-ep2-wide-auto-g4-off-params", 2, [*WIDE, ep(2), AUTO, "optim.apply_groups=4",
                                              "memory.offload=optimizer+params"]),
    Plan("w4-ep4", 4, [*SMALL, ep(4)]),
    Plan("w4-ep2-mb2x2-full", 4, [*SMALL, ep(2), "train.micro_batch_size=2", FULL]),
    Plan("w4-ep4-bf16-off-opt-g4", 4, [*SMALL, ep(4), "model.moe.a2a_dtype=bf16", "memory.offload=optimizer",
                                       "optim.apply_groups=4"]),
    Plan("w4-ep1", 4, [*SMALL, ep(1)]),
    # Sharded data parallel (parallel.shard, FSDP2): `--only shard` runs these four alone.
    Plan("w2-shard-full", 2, [*SMALL, ep(1), "parallel.shard=full"]),
    Plan("w2-ep2-shard-opt", 2, [*SMALL, ep(2), "parallel.shard=optimizer"]),
    Plan("w4-ep1-shard-opt", 4, [*SMALL, ep(1), "parallel.shard=optimizer"]),
    Plan("w4-ep2-shard-full", 4, [*SMALL, ep(2), "parallel.shard=full"]),
    # fp16, gradient streaming with 16-bit host gradients, Adafactor and granular offload (#27):
    # `--only stream` runs these alone.
    Plan("w1-stream-fp16-off-params-mb8", 1, [*SMALL, "train.precision=fp16", "memory.offload=optimizer+params",
                                              "train.micro_batch_size=8"]),
    Plan("w1-stream-bf16-half-grads", 1, [*SMALL, "train.precision=bf16", "memory.offload=optimizer+params",
                                          "memory.host_grad_dtype=compute"]),
    Plan("w1-stream-adafactor-off-opt", 1, [*SMALL, "optim.name=adafactor", "memory.offload=optimizer"]),
    Plan("w1-stream-blocks-0-2", 1, [*SMALL, "memory.offload=optimizer+params", "memory.offload_blocks=[0,2]"]),
    Plan("w2-ep2-stream-fp16-adafactor-half-grads", 2, [*SMALL, ep(2), "train.precision=fp16", "optim.name=adafactor",
                                                        "memory.offload=optimizer+params", "memory.host_grad_dtype=compute"]),
    # Tensor parallel (#47): `--only tp` runs these alone.
    Plan("w2-tp2", 2, [*SMALL, ep(1), "parallel.tensor_parallel_size=2"]),
    Plan("w2-tp2-sp", 2, [*SMALL, ep(1), "parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true"]),
    Plan("w4-tp2-ep2", 4, [*SMALL, ep(2), "parallel.tensor_parallel_size=2"]),
    Plan("w4-tp2-sp-ep1-mb4", 4, [*SMALL, ep(1), "parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true",
                                  "train.micro_batch_size=4"]),
    # tp x FSDP2 over the 2 data-parallel ranks of each tp coordinate: `--only tp2-shard` runs these alone.
    Plan("w4-tp2-shard-opt", 4, [*SMALL, ep(1), "parallel.tensor_parallel_size=2", "parallel.shard=optimizer"]),
    Plan("w4-tp2-shard-full-rc", 4, [*SMALL, ep(1), "parallel.tensor_parallel_size=2", "parallel.shard=full", FULL]),
    # ZeRO-Offload's layout (memory.offload=zero, #46): bf16 device weights, fp32 host masters;
    # `--only zero` runs these alone. The delayed update from the first step (delayed_update_after=0).
    Plan("w1-zero-bf16", 1, [*SMALL, *ZERO]),
    Plan("w1-zero-bf16-half-grads", 1, [*SMALL, *ZERO, "memory.host_grad_dtype=compute"]),
    Plan("w1-zero-bf16-block-1-mb8", 1, [*SMALL, *ZERO[:2], "memory.offload_blocks=[1]", "train.micro_batch_size=8"]),
    Plan("w1-zero-bf16-delayed", 1, [*SMALL, *ZERO, *DELAYED]),
    Plan("w2-ep2-zero-bf16", 2, [*SMALL, ep(2), *ZERO]),
    Plan("w2-ep2-zero-bf16-half-grads-block-1", 2, [*SMALL, ep(2), *ZERO[:2], "memory.host_grad_dtype=compute",
                                                    "memory.offload_blocks=[1]"]),
    Plan("w2-ep1-zero-bf16-delayed", 2, [*SMALL, ep(1), *ZERO, *DELAYED]),
    # ZeRO-Offload partitioned (zero + parallel.shard=optimizer): each rank's host states 1/2;
    # `--only zero-part` runs these alone.
    Plan("w2-ep1-zero-part-bf16", 2, [*SMALL, ep(1), *ZERO, "parallel.shard=optimizer"]),
    Plan("w2-ep2-zero-part-bf16-delayed", 2, [*SMALL, ep(2), *ZERO, "parallel.shard=optimizer", *DELAYED]),
]

# Pipeline parallel (#47): measured only where this m6 builds pipelines (parallel.pipeline_parallel_size);
# `--only pp` runs these alone. 8 micro-batches of 2 per rank at pp 2 x dp 1 (x tp 2), 4 of 2 at pp 2 x dp 2.
PIPELINE_PLANS = [
    Plan(f"w2-pp2-{schedule}", 2, [*SMALL, ep(1), "parallel.pipeline_parallel_size=2", "train.micro_batch_size=2",
                                   f"parallel.pipeline_schedule={schedule}",
                                   f"parallel.pipeline_stages_per_rank={stages_per_rank(schedule)}"])
    for schedule in SCHEDULES
] + [Plan("w4-pp2-ep2-1f1b", 4, [*SMALL, ep(2), "parallel.pipeline_parallel_size=2", "train.micro_batch_size=2",
                                 "parallel.pipeline_schedule=1f1b", "parallel.pipeline_stages_per_rank=1"]),
       # Tensor parallel inside each stage: `--only pp2-tp2` runs it alone.
       Plan("w4-pp2-tp2-interleaved", 4, [*SMALL, ep(1), "parallel.pipeline_parallel_size=2",
                                          "parallel.tensor_parallel_size=2", "train.micro_batch_size=2",
                                          "parallel.pipeline_schedule=interleaved",
                                          "parallel.pipeline_stages_per_rank=2"]),
       # each rank's stages' masters and optimizer state on the host; `--only pp2-1f1b-off` runs it alone
       Plan("w2-pp2-1f1b-off-opt", 2, [*SMALL, ep(1), "parallel.pipeline_parallel_size=2", "train.micro_batch_size=2",
                                       "parallel.pipeline_schedule=1f1b", "parallel.pipeline_stages_per_rank=1",
                                       "memory.offload=optimizer"])]


THREADS_PER_RANK: int | None = None  # --threads-per-rank: fewer cores than the host has, on both sides


def threads_per_rank(world_size: int) -> int:
    """What m6.plan gives each rank on one node of CORES cores (and what the measured run gets)."""
    return THREADS_PER_RANK or max(1, CORES // world_size)


def node_cores(world_size: int) -> int:
    """The cores the planner is told the node has: CORES, or with --threads-per-rank those the ranks use."""
    return THREADS_PER_RANK * world_size if THREADS_PER_RANK else CORES


def wait_for_quiet(max_wait_s: float) -> float:
    """Sleep while the 1-minute load average is above MAX_LOAD (other agents share the cores);
    returns the load when the measurement starts."""
    waited = 0.0
    while os.getloadavg()[0] > MAX_LOAD and waited < max_wait_s:
        time.sleep(30)
        waited += 30
    return os.getloadavg()[0]


def torchrun(world_size: int, args: list[str], timeout: int = 600) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads_per_rank(world_size)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size),
           "-m", "bench.plan_measure", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def fit_link(probe: dict) -> dict:
    """Least-squares latency and bandwidth from the all-to-all and all-reduce, each x by the
    planner's formula; then how much an all-gather or reduce-scatter costs against the ring model
    at that latency and bandwidth (Hardware.gather_scatter_cost: least squares through the origin
    of their time over the latency against (n-1)/n x bytes / bandwidth, so the large sizes weigh)."""
    n = probe["world_size"]
    xs, ys = [], []
    for nbytes, t in probe["all_to_all"].items():
        xs.append(int(nbytes) * (n - 1) / n)
        ys.append(t)
    for nbytes, t in probe["all_reduce"].items():
        xs.append(2 * (n - 1) / n * int(nbytes))
        ys.append(t)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    latency = max(my - slope * mx, 1e-6)
    ring = [((n - 1) / n * int(nbytes) * slope, t - latency)
            for op in ("all_gather", "reduce_scatter") for nbytes, t in probe.get(op, {}).items()]
    cost = sum(x * y for x, y in ring) / sum(x * x for x, _ in ring) if ring else GLOO_GATHER_SCATTER_COST
    return {"latency_us": latency * 1e6, "GBps": 1 / slope / 1e9, "gather_scatter_cost": cost, "probe": probe}


def measure_link(world_size: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        torchrun(world_size, ["--out", tmp, "--probe"])
        return fit_link(json.loads((Path(tmp) / "probe.json").read_text()))


def predict(plan: Plan, link: dict, profiles: dict[int, HostProfile]) -> tuple[list[str], dict]:
    """The run's overrides (auto: the budget the planner would write) and the prediction."""
    overrides = list(plan.overrides)
    cfg = load(BASE_CONFIG, [*COMMON, *overrides])
    world, ep_size = plan.world_size, cfg.parallel.expert_parallel_size
    if cfg.memory.activation_checkpointing == "auto":
        # The planner writes an explicit budget; here half of the no-recompute bytes (between none and full).
        none = activation_report(cfg, world, ep_size, "cpu").kept()
        overrides.append(f"memory.activation_budget_gb={0.5 * none / 2**30:.6f}")
        cfg = load(BASE_CONFIG, [*COMMON, *overrides])
    hw = cpu_hardware(1e6, link["GBps"], link["latency_us"] * 1e-6, link["gather_scatter_cost"])
    threads = threads_per_rank(world)
    host = profiles.setdefault(world, HostProfile(threads, concurrent=world))
    tp, pp = cfg.parallel.tensor_parallel_size, getattr(cfg.parallel, "pipeline_parallel_size", 1)
    if tp > 1 or pp > 1:
        # The search's own path for a model split (m6.plan.search): the tp rank's share of the
        # pipeline rank's blocks at the data-parallel world, plus the split's collectives and bubble.
        schedule = getattr(cfg.parallel, "pipeline_schedule", None) if pp > 1 else None
        split = ModelSplit(tp, cfg.parallel.sequence_parallel, pp, schedule,
                           getattr(cfg.parallel, "pipeline_stages_per_rank", 1) if pp > 1 else 1)
        dp = world // (tp * pp)
        base = stage_config(rank_config(cfg, tp), pp)
        rm = RankMemory(base, dp, ep_size, "cpu")
        mem = split_memory(base, rm, split, dp, ep_size, micro_batch_size(base.train, dp),
                           accumulation_steps(base.train, dp), "cpu", rank_config(cfg, tp))
        t = split_step_time(cfg, base, split, world, dp, ep_size, world, hw, host, node_cores(world), rm.model)
    else:
        rm = RankMemory(cfg, world, ep_size, "cpu")
        mem = rm.report(cfg)
        t = step_time(cfg, world, ep_size, world, hw, host, node_cores(world), rm.model)
    # The host's persistent bytes (what the measured side counts at the step's start); the rest of
    # the shared peak is the device's (and the update's temporaries, which the measured peak holds too).
    host_bytes = mem.peak_host - mem.host.get(TRANSIENT_HOST, 0.0) if cfg.memory.offload != "none" else 0.0
    return overrides, {"peak_bytes": mem.peak_shared, "peak_device_bytes": mem.peak_device,
                       "host_bytes": host_bytes, "device_and_temporaries_bytes": mem.peak_shared - host_bytes,
                       "device": mem.device, "host": mem.host, "step_s": t.total,
                       "split_s": {"compute": t.compute, "all_to_all": t.all_to_all,
                                   "grad_sync": t.grad_sync + t.small_collectives,
                                   "offload": t.offload, "update": t.update,
                                   "tp/pp": t.tensor_parallel + t.pipeline_bubble + t.pipeline_p2p}}


def measure(plan: Plan, overrides: list[str], max_wait_s: float) -> dict:
    load_before = wait_for_quiet(max_wait_s)
    with tempfile.TemporaryDirectory() as tmp:
        torchrun(plan.world_size, ["--out", tmp, *overrides])
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(plan.world_size)]
    # Rank 0 logs the step time (train_step's own clock, which every rank shares through the
    # step's collectives); the peak is the largest rank's.
    # The planner does not model data loading: data_wait_s (collation, inside step_time_s) is taken out.
    times = [t - w for t, w in zip(ranks[0]["step_time_s"], ranks[0]["data_wait_s"])]
    return {"load_1min_at_start": load_before, "load_1min_during": [r["load_1min"] for r in ranks][0],
            "step_s_median": statistics.median(times), "step_s_min": min(times), "step_s_max": max(times),
            "data_wait_s_max": max(max(r["data_wait_s"]) for r in ranks),
            "peak_bytes": max(r["peak_bytes"] for r in ranks), "host_bytes": max(r["host_bytes"] for r in ranks),
            "device_peak_bytes": max(r["device_peak_bytes"] for r in ranks), "per_rank": ranks}


def merge_rounds(rounds: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """One prediction and one measurement from the rounds: medians of the step times (and of each
    predicted component: they need not add up to the median step), the largest measured peak, every timed step's range, the last round's
    per-rank details."""
    preds, meas = [p for p, _ in rounds], [m for _, m in rounds]
    pred = dict(preds[-1], step_s=statistics.median(p["step_s"] for p in preds),
                step_s_rounds=[p["step_s"] for p in preds],
                split_s={k: statistics.median(p["split_s"][k] for p in preds) for k in preds[0]["split_s"]})
    merged = dict(meas[-1], step_s_median=statistics.median(m["step_s_median"] for m in meas),
                  step_s_rounds=[m["step_s_median"] for m in meas],
                  step_s_min=min(m["step_s_min"] for m in meas), step_s_max=max(m["step_s_max"] for m in meas),
                  data_wait_s_max=max(m["data_wait_s_max"] for m in meas),
                  peak_bytes=max(m["peak_bytes"] for m in meas), host_bytes=max(m["host_bytes"] for m in meas),
                  device_peak_bytes=max(m["device_peak_bytes"] for m in meas),
                  load_1min_at_start=max(m["load_1min_at_start"] for m in meas))
    return pred, merged


def tail_ratios(probe: dict) -> str:
    """Range of mean / median over the probed sizes, per collective."""
    out = []
    for op in ("all_to_all", "all_reduce"):
        r = [probe[op][n] / probe["median"][op][n] for n in probe[op]]
        out.append(f"{op.replace('_', '-')} {min(r):.2f}-{max(r):.2f}x")
    return ", ".join(out)


def judge(pred: float, meas: float, target: float) -> dict:
    ratio = pred / meas
    return {"predicted": pred, "measured": meas, "ratio": ratio, "pass": abs(ratio - 1) <= target}


def forward_backward_and_listed(phases: dict[str, float]) -> tuple[float, float]:
    """Measured forward + backward seconds per step and the seconds of every listed call, from
    PhaseClock's phases. At pipeline parallel the schedule runs the forwards and backwards (the
    trainer's forward_loss and the update's backward are never called) and the update's finish
    inside it: its forward + backward is the schedule less the finish (p2p waits and the bubble
    included), and the finish is counted once."""
    finish = phases["finish (grad sync wait, offload)"]
    schedule = phases.get(PIPELINE_PHASE)
    if schedule is None:
        return phases["forward"] + phases["backward"], sum(phases.values())
    return schedule - finish, sum(phases.values()) - finish


def markdown(rows: list[dict], info: dict) -> str:
    mib = 2**20
    lines = ["# m6.plan predictions vs measured runs (CPU, gloo, torchrun)", "",
             f"Machine: {info['cpu_model']}, {info['cpu_count']} cores (shared with other agents); torch "
             f"{info['torch']}; `{info['command']}`; {info['date']}.",
             "Link (measured, passed to the planner): " + "; ".join(
                 f"world {w}: latency {l['latency_us']:.0f} us, {l['GBps']:.2f} GB/s, all-gather / reduce-scatter "
                 f"{l['gather_scatter_cost']:.2f}x a ring's time" for w, l in info["links"].items()),
             "Link probe, mean / median time per call (the tail a step pays; mean fitted): " + "; ".join(
                 f"world {w}: {tail_ratios(l['probe'])}" for w, l in info["links"].items()),
             "", "Targets: predicted peak within 10%, predicted step time within 15% of the measured ones.", "",
             "| plan | world | predicted peak MiB | measured peak MiB (max rank) | ratio | mem | predicted step s "
             "(compute/a2a/sync/offload/update/tp+pp) | measured step s (step_time_s - data_wait_s) median [min-max] | ratio | time | load 1-min |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, t, s = r["memory"], r["time"], r["predicted"]["split_s"]
        lines.append(
            f"| {r['name']} | {r['world_size']} | {m['predicted'] / mib:.1f} | {m['measured'] / mib:.1f} | "
            f"{m['ratio']:.3f} | {'pass' if m['pass'] else 'MISS'} | {t['predicted']:.3f} ("
            + "/".join(f"{v:.3f}" for v in s.values())
            + f") | {t['measured']:.3f} [{r['measured']['step_s_min']:.3f}-{r['measured']['step_s_max']:.3f}] | "
            f"{t['ratio']:.3f} | {'pass' if t['pass'] else 'MISS'} | {r['measured']['load_1min_at_start']:.2f} |")
    lines += ["", "Where the time goes: predicted split vs the measured trainer calls (seconds per step, "
              "rank 0, mean over the timed steps; 'other' = step - the calls listed: loss bookkeeping, "
              "metrics, zero_grad, the step's small all-reduces).", "",
              "| plan | predicted compute | measured forward + backward | predicted all-to-all | measured all-to-all "
              "calls in the step (s, calls; inside forward + backward, waits included) | predicted sync + offload | "
              "measured finish (sync wait, offload) | predicted update | measured clip + update | measured other | "
              "run's recompute plan | process CPU / wall (rank 0) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, rank0 = r["predicted"]["split_s"], r["measured"]["per_rank"][0]
        ph = rank0["phase_s_per_step"]
        fb, listed = forward_backward_and_listed(ph)
        other = statistics.fmean(rank0["step_time_s"]) - statistics.fmean(rank0["data_wait_s"]) - listed
        plan = rank0["recompute_plan"]
        a2a = f"{rank0['all_to_all_s_per_step']:.3f} ({rank0['all_to_all_calls_per_step']:.0f})" \
            if rank0.get("all_to_all_calls_per_step") else "-"
        lines.append(f"| {r['name']} | {s['compute']:.3f} | {fb:.3f} | {s['all_to_all']:.3f} | {a2a} | "
                     f"{s['grad_sync'] + s['offload']:.3f} | "
                     f"{ph['finish (grad sync wait, offload)']:.3f} | {s['update']:.3f} | "
                     f"{ph['clip'] + ph['update']:.3f} | {other:.3f} | "
                     f"{'-' if plan is None else len(plan)} | {rank0['timed_cpu_s'] / rank0['timed_wall_s']:.2f} |")
    split = [r for r in rows if r["measured"]["host_bytes"]]
    if split:
        lines += ["", "Offloaded plans, device and host apart (host: the offload's storages at the step's start — "
                  "masters, gradient buffers, optimizer state, streamed homes, staging — against the planner's host "
                  "bytes less the update's temporaries; device: the rest of the measured peak, against the "
                  "planner's device peak, what a GPU holds; the delayed update's temporaries, which the "
                  "one-memory peak above counts beside it, are on the host).", "",
                  "| plan | predicted device MiB | measured device MiB | ratio | within 10% | predicted host MiB | "
                  "measured host MiB | ratio | within 10% |", "|---|---|---|---|---|---|---|---|---|"]
        for r in split:
            d, h = r["device"], r["host"]
            lines.append(f"| {r['name']} | {d['predicted'] / mib:.2f} | {d['measured'] / mib:.2f} | {d['ratio']:.3f} | "
                         f"{'pass' if d['pass'] else 'MISS'} | {h['predicted'] / mib:.2f} | {h['measured'] / mib:.2f} | "
                         f"{h['ratio']:.3f} | {'pass' if h['pass'] else 'MISS'} |")
    lines += ["", *(f"NOTE: {n}" for n in info.get("notes", []))] if info.get("notes") else []
    mem_ok = sum(r["memory"]["pass"] for r in rows)
    time_ok = sum(r["time"]["pass"] for r in rows)
    lines += ["", f"Memory within 10%: {mem_ok} of {len(rows)}. Step time within 15%: {time_ok} of {len(rows)}.",
              "data_wait_s (largest over ranks and timed steps): "
              + ", ".join(f"{r['name']} {r['measured']['data_wait_s_max'] * 1e3:.1f} ms" for r in rows) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None, help="run the plans whose name contains this")
    p.add_argument("--max-wait", type=float, default=60.0, help="seconds to wait for load <= 2.5 per plan")
    p.add_argument("--rounds", type=int, default=3, help="profile + measured run pairs per plan (medians compared)")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--stem", default=f"plan-cpu-{CORES}core")
    p.add_argument("--threads-per-rank", type=int, default=None,
                   help="threads each rank computes with, predicted and measured alike (default: cores // ranks); "
                        "1 keeps a rank's ops off OpenMP's wait for a second core that another process holds")
    args = p.parse_args(argv)
    global THREADS_PER_RANK
    THREADS_PER_RANK = args.threads_per_rank
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    notes = []
    candidates = PLANS
    if pipeline_builds():
        candidates = [*PLANS, *PIPELINE_PLANS]
    elif args.only is None or any(args.only in pl.name for pl in PIPELINE_PLANS):
        notes.append("Pipeline plans (" + ", ".join(pl.name for pl in PIPELINE_PLANS if args.only is None
                                                     or args.only in pl.name)
                     + ") skipped: this m6 has no parallel.pipeline_parallel_size (m6.config.ParallelConfig), so "
                     "nothing can run them; they are measured by this script once it has.")
    plans = [pl for pl in candidates if args.only is None or args.only in pl.name]
    for note in notes:
        print(f"NOTE: {note}", flush=True)
    worlds = sorted({pl.world_size for pl in plans if pl.world_size > 1})
    links = {w: measure_link(w) for w in worlds}
    links[1] = {"latency_us": 100.0, "GBps": 1.0, "gather_scatter_cost": 1.0,
                "probe": None}  # world 1 communicates nothing
    for w in worlds:
        print(f"link at world {w}: latency {links[w]['latency_us']:.0f} us, {links[w]['GBps']:.2f} GB/s", flush=True)
    rows = []
    for plan in plans:
        # Rounds alternate the planner's profiling and the measured run, so a change of the shared
        # host's speed between the two hits both alike; the medians over rounds are compared.
        rounds = []
        for _ in range(args.rounds):
            overrides, pred = predict(plan, links[plan.world_size], {})
            rounds.append((pred, measure(plan, overrides, args.max_wait)))
        pred, meas = merge_rounds(rounds)
        row = {"name": plan.name, "world_size": plan.world_size, "overrides": overrides, "predicted": pred,
               "measured": meas, "memory": judge(pred["peak_bytes"], meas["peak_bytes"], MEMORY_TARGET),
               "time": judge(pred["step_s"], meas["step_s_median"], TIME_TARGET)}
        if meas["host_bytes"]:
            row["device"] = judge(pred["peak_device_bytes"], meas["device_peak_bytes"], MEMORY_TARGET)
            row["host"] = judge(pred["host_bytes"], meas["host_bytes"], MEMORY_TARGET)
        rows.append(row)
        print(f"{plan.name}: memory {row['memory']['ratio']:.3f}, time {row['time']['ratio']:.3f} "
              f"(pred {pred['step_s']:.3f} s, measured {meas['step_s_median']:.3f} s, load "
              f"{meas['load_1min_at_start']:.2f})", flush=True)
    with open("/proc/cpuinfo") as f:
        model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
    info = {"cpu_model": model, "cpu_count": CORES, "torch": torch.__version__,
            "command": "python -m bench.plan_validation" + (f" --only {args.only}" if args.only else "")
            + (f" --threads-per-rank {args.threads_per_rank}" if args.threads_per_rank else ""),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "links": {str(w): {k: v for k, v in links[w].items()} for w in worlds}, "notes": notes}
    write_results(args.out, args.stem, {"machine": info, "plans": rows}, markdown(rows, info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
