"""Plan an m6 layout: the fastest predicted layout that fits, with its memory and time by component.

    python -m m6.plan configs/m6-10t.yaml --gpus 512 --gpu-memory 80GB --gpus-per-node 8 --gpu h100 \\
        [--host-memory 1TB] [--host-cores-per-gpu 12] [--intra-node-GBps X --inter-node-GBps Y] [--top 5]
        [--out plan.overrides] [--shard config|any|...] [--delayed-update any|config|true|false]
        [--offload-modes runnable|all]

Every number printed is PREDICTED; the GPU figures rest on the assumptions printed with them.
Layouts whose predictions are the same (settings the model says change nothing, such as the update
split in more groups where its temporaries are no peak) are shown once, the simplest, naming the
others. The best layout's overrides go into the printed launch command, or, with ``--out FILE``,
into FILE (nothing is written unless asked), which ``train.py --overrides FILE`` reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import time

from m6 import config as m6config
from m6.config_loader import ConfigError
from m6.plan.link_floor import LINK_ASSUMED
from m6.plan.mixed import describe_mixed, parse_inventory, plan_mixed, read_inventory
from m6.plan.offload_layouts import DELAYED_ASSUMED, PLANNED_OFFLOAD, ZERO, ZERO_ASSUMED, runnable_offload_modes
from m6.plan.search import DELAYED, SHARD, Candidate, search
from m6.plan.step_breakdown import describe_overlaps, describe_streamed
from m6.plan.sizes import parse_size
from m6.plan.timing import GPUS, HostProfile, cpu_hardware
from m6.plan.zero_partition_step import PARTITION_ASSUMED

GiB = 2**30
HOST_CORES_PER_GPU = 12  # a 96-core, 8-GPU server


def _gib(n: float) -> str:
    return f"{n / GiB:,.2f}"


def describe(c: Candidate, rank: int, ranks_per_node: int = 1, delayed_after: int = 40) -> str:
    """A layout's lines: its settings, the step by component, what overlaps what, its memory;
    ``delayed_after``: optim.delayed_update_after (the synchronous steps before the delayed ones)."""
    t, mem = c.time, c.memory
    layout = c.layout_name()
    lines = [f"#{rank}  " + (f"{layout}, " if layout else "")
             + f"EP {c.expert_parallel_size}, micro-batch {c.micro_batch}, recompute {c.recompute}"
             + (f" (budget {c.budget_gb:.2f} GiB)" if c.budget_gb is not None else "")
             + f", offload {c.offload}" + describe_streamed(c.offload, c.offload_blocks)
             + (f", delayed update (one step stale from step {delayed_after + 1})" if c.delayed_update else "")
             + f", shard {c.shard}, apply_groups {c.apply_groups}, a2a {c.a2a_dtype or 'compute dtype'}"
             + (f", overlap {c.a2a_overlap_degree}, dispatch {c.a2a_dispatch}" if c.expert_parallel_size > 1 else "")
             + (f" (the same prediction with {'; '.join(c.equivalents)})" if c.equivalents else ""),
             f"    PREDICTED {c.tokens_per_s:,.0f} tokens/s, step {t.total:.3f} s = compute {t.compute:.3f} + "
             f"all-to-all {t.all_to_all:.3f}" + (f" exposed ({t.all_to_all_hidden:.3f} hidden)" if t.all_to_all_hidden else "")
             + f" + grad sync {t.grad_sync:.3f}" + (f" exposed ({t.grad_sync_hidden:.3f} hidden)" if t.grad_sync_hidden else "")
             + " + small collectives "
             f"{t.small_collectives:.3f} + offload {t.offload:.3f}" + (" exposed" if t.offload_hidden else "") + " + "
             f"update {t.update:.3f}" + (" exposed" if t.update_hidden else "")
             + (f" + inter-node link shared {t.link_shared:.3f}" if t.link_shared else "")
             + (f" + tp collectives {t.tensor_parallel:.3f}" if c.tensor_parallel_size > 1 else "")
             + (f" + pipeline bubble {t.pipeline_bubble:.3f} + stage sends {t.pipeline_p2p:.3f}"
                if c.pipeline_parallel_size > 1 else "") + (f"; MFU {c.mfu:.1%} (active-parameter FLOPs)" if c.mfu is not None else ""),
             *describe_overlaps(t, delayed_after),
             f"    per-GPU device memory peak {_gib(mem.peak_device)} GiB: "
             + ", ".join(f"{k} {_gib(v)}" for k, v in mem.device.items() if v),
             f"    host memory per rank {_gib(mem.peak_host)} GiB, per node of {ranks_per_node} ranks "
             f"{_gib(mem.peak_host * ranks_per_node)} GiB: " + ", ".join(f"{k} {_gib(v)}" for k, v in mem.host.items() if v)]
    return "\n".join(lines)


def split_verdict(result) -> str:
    """Whether tensor or pipeline parallel wins, and why: the best layout against the best without
    either (and the best with each), by the parts of their steps that differ."""
    best = result.feasible[0]
    plain = next((c for c in result.feasible if c.tensor_parallel_size == 1 and c.pipeline_parallel_size == 1), None)
    lines = []
    for name, pick in (("TP", lambda c: c.tensor_parallel_size > 1), ("PP", lambda c: c.pipeline_parallel_size > 1)):
        top = next((c for c in result.feasible if pick(c)), None)
        if top is None:
            lines.append(f"{name}: no fitting layout with it" + (
                "; left out: " + "; ".join(f"{k}: {v}" for k, v in result.skipped_splits.items()
                                           if k.startswith(name.lower())) if any(
                    k.startswith(name.lower()) for k in result.skipped_splits) else ""))
        elif plain is None:
            lines.append(f"{name} wins: only layouts with a model split fit ({top.layout_name()} predicted "
                         f"{top.tokens_per_s:,.0f} tokens/s)")
        else:
            t, p = top.time, plain.time
            verdict = "wins" if top.tokens_per_s > plain.tokens_per_s else "loses"
            lines.append(f"{name} {verdict}: best with it ({top.layout_name()}, EP {top.expert_parallel_size}, micro-batch "
                         f"{top.micro_batch}, recompute {top.recompute}) {top.tokens_per_s:,.0f} tokens/s vs "
                         f"{plain.tokens_per_s:,.0f} without (EP {plain.expert_parallel_size}, micro-batch "
                         f"{plain.micro_batch}, recompute {plain.recompute}, offload {plain.offload}, shard {plain.shard}): "
                         f"compute {t.compute:.3f} vs {p.compute:.3f} s, tp collectives {t.tensor_parallel:.3f}, bubble "
                         f"{t.pipeline_bubble:.3f} + sends {t.pipeline_p2p:.3f}, all-to-all {t.all_to_all:.3f} vs "
                         f"{p.all_to_all:.3f}, grad sync {t.grad_sync:.3f} vs {p.grad_sync:.3f}, offload "
                         f"{t.offload:.3f} vs {p.offload:.3f}, update {t.update:.3f} vs {p.update:.3f}")
    return "\n".join(lines)


def short_of(c: Candidate, limit_gib: float, host_gib: float, ranks_per_node: int) -> str:
    """What the closest plan is short of, by how much, and where its bytes go."""
    mem = c.memory
    states = sum(v for k, v in mem.device.items() if k in ("params", "optimizer state", "grads"))
    where = (f"EP {c.expert_parallel_size}, micro-batch {c.micro_batch}, recompute {c.recompute}, "
             f"offload {c.offload}, shard {c.shard}")
    device = (f"{_gib(mem.peak_device)} GiB per GPU of {limit_gib:g} GiB (params+grads+optimizer on the device "
              f"{_gib(states)} GiB, activations {_gib(mem.device.get('activations (per micro-batch)', 0))} GiB)")
    host = f"{_gib(mem.peak_host * ranks_per_node)} GiB host memory per node of {host_gib:g} GiB"
    return f"the closest plan ({where}) needs {device} and {host}"


# What the planner may change beyond the layout when nothing fits, in this order, each with why
# it saves memory and what it costs.
MEMORY_LIGHT_WHY = {
    "checkpoint.async_save": "synchronous checkpoint saves: no host copy of the states to write from, "
                             "training waits while a checkpoint is written",
    "optim.name": "Adafactor: factored second moments and no first moment instead of AdamW's two "
                  "fp32 moments; another optimizer, with its own learning-rate behaviour",
}


def memory_light_changes(cfg: m6config.Config, result) -> list[list[str]]:
    """The overrides to try, lightest change first, when ``result`` (the config as given) has no
    layout that fits: synchronous checkpoint saves, then Adafactor too. None where it fits, or
    where the config already has them."""
    if result.feasible:
        return []
    steps = []
    if cfg.checkpoint.async_save:
        steps.append("checkpoint.async_save=false")
    tried = [list(steps)] if steps else []
    if cfg.optim.name != "adafactor" and cfg.memory.host_optimizer != "deepspeed":
        tried.append([*steps, "optim.name=adafactor"])
    return tried


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted overrides applied before planning")
    p.add_argument("--gpus", default=None, help="ranks of the job (a number), or a mixed inventory: 8xh100,8xv100[:16GB]")
    p.add_argument("--inventory", default=None, help="a file of a mixed inventory, one COUNTxKIND[:MEMORY] a line")
    p.add_argument("--gpu-memory", default="80GB", help="device memory per rank")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--host-memory", default="1TB", help="host memory per node")
    p.add_argument("--gpu", choices=sorted(GPUS) + ["cpu"], default="h100")
    p.add_argument("--intra-node-GBps", type=float, default=None)
    p.add_argument("--inter-node-GBps", type=float, default=None)
    p.add_argument("--latency-us", type=float, default=None, help="per collective")
    p.add_argument("--cores", type=int, default=os.cpu_count(), help="--gpu cpu: cores of a node")
    p.add_argument("--host-cores-per-gpu", type=int, default=HOST_CORES_PER_GPU,
                   help="host cores running each GPU rank's offloaded update (default %(default)s: a 96-core "
                        "8-GPU server); the update is timed here per core and divided by them")
    p.add_argument("--shard", choices=("config", "any", "none", "optimizer", "full"), default="config",
                   help="parallel.shard settings to consider: the config's (default), all three (any), or one")
    p.add_argument("--delayed-update", choices=("any", "config", "true", "false"), default="any",
                   help="optim.delayed_update settings to consider with offload on GPUs: both (any, the default), "
                        "the config's, or one")
    p.add_argument("--offload-modes", choices=("runnable", "all"), default="runnable",
                   help="memory.offload settings to consider: those this checkout's train.py accepts (default), or "
                        "all the planner models (" + ", ".join(PLANNED_OFFLOAD) + ")")
    p.add_argument("--top", type=int, default=3)
    p.add_argument("--out", default=None, metavar="FILE",
                   help="write the best layout's key=value lines to FILE (for train.py --overrides FILE); "
                        "default: nothing written, the overrides are printed in the launch command")
    args = p.parse_intermixed_args(argv)
    t0 = time.perf_counter()
    if args.inventory is not None or (args.gpus is not None and not args.gpus.strip().isdigit()):
        return plan_inventory(args)
    if args.gpus is None:
        p.error("--gpus (a number or COUNTxKIND,...) or --inventory FILE is required")
    args.gpus = int(args.gpus)
    try:
        cfg = m6config.load(args.config, args.overrides)
        # The search picks the tensor-parallel degree (and sequence parallel) itself, as it picks EP.
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tensor_parallel_size=1,
                                                                    sequence_parallel=False))
        if args.gpus <= 0 or cfg.train.global_batch_size % args.gpus:
            raise ConfigError(f"train.global_batch_size ({cfg.train.global_batch_size}) must be divisible by "
                              f"--gpus ({args.gpus})")
        memory_gib, host_gib = parse_size(args.gpu_memory, "--gpu-memory"), parse_size(args.host_memory, "--host-memory")
        if args.gpu == "cpu":
            hw = cpu_hardware(memory_gib, args.intra_node_GBps or 1.0, (args.latency_us or 100.0) * 1e-6)
        else:
            hw = dataclasses.replace(GPUS[args.gpu], memory_gib=memory_gib)
            for flag, fieldname in (("intra_node_GBps", "intra_node_GBps"), ("inter_node_GBps", "inter_node_GBps")):
                if getattr(args, flag) is not None:
                    hw = dataclasses.replace(hw, **{fieldname: getattr(args, flag)})
            if args.latency_us is not None:
                hw = dataclasses.replace(hw, latency_s=args.latency_us * 1e-6)
        threads = max(1, (args.cores or 1) // min(args.gpus, args.gpus_per_node))
        if args.host_cores_per_gpu < 1:
            raise ConfigError(f"--host-cores-per-gpu must be >= 1, got {args.host_cores_per_gpu}")
        profile = HostProfile(threads, concurrent=min(args.gpus, args.gpus_per_node) if args.gpu == "cpu" else 1,
                              host_cores_per_gpu=None if args.gpu == "cpu" else args.host_cores_per_gpu)
        shards = SHARD if args.shard == "any" else (cfg.parallel.shard if args.shard == "config" else args.shard,)
        delayed = DELAYED if args.delayed_update == "any" else \
            (cfg.optim.delayed_update if args.delayed_update == "config" else args.delayed_update == "true",)
        offload = PLANNED_OFFLOAD if args.offload_modes == "all" else runnable_offload_modes()
        result = search(cfg, args.gpus, args.gpus_per_node, hw, profile, host_gib, args.cores or 1, shard=shards,
                        delayed=delayed, offload=offload)
        first, changes = result, []
        for extra in memory_light_changes(cfg, result):
            lighter = m6config.load(args.config, [*args.overrides, *extra])
            found = search(lighter, args.gpus, args.gpus_per_node, hw, profile, host_gib, args.cores or 1, shard=shards,
                           delayed=delayed, offload=offload)
            if found.feasible:
                cfg, result, changes = lighter, found, extra
                break
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if not result.feasible:
        print(f"no layout fits: {short_of(first.smallest, memory_gib, host_gib, min(args.gpus, args.gpus_per_node))} "
              f"({first.considered} layouts considered"
              + ("; none either with " + " or ".join(" ".join(c) for c in memory_light_changes(cfg, first))
                 if memory_light_changes(cfg, first) else "") + ")", file=sys.stderr)
        return 2
    print(f"{args.config} on {args.gpus} x {hw.name} ({memory_gib:g} GiB), {args.gpus_per_node} per node: "
          f"{result.fitting} of {result.considered} layouts fit, {result.timed} timed with their exchange "
          f"forms, {len(result.feasible)} of distinct predictions ({time.perf_counter() - t0:.1f} s)")
    assumed = list(hw.assumed)
    if args.gpu != "cpu":
        rates = ", ".join(f"{name} {ns:.2f} ns/parameter" for name, ns in profile.host_rates().items())
        assumed.append(f"offloaded host update: a per-core rate timed on this host (1 thread{': ' + rates if rates else ''}) "
                       f"x {args.host_cores_per_gpu} cores per GPU (--host-cores-per-gpu), scaling linearly")
    shown = result.feasible[:args.top]
    assumed += [ZERO_ASSUMED] if any(c.offload == ZERO for c in shown) else []
    assumed += [PARTITION_ASSUMED] if any(c.offload == ZERO and c.shard == "optimizer" for c in shown) else []
    assumed += [DELAYED_ASSUMED] if any(c.delayed_update for c in shown) else []
    assumed += [LINK_ASSUMED] if any(c.time.link_windows for c in shown) else []
    for note in profile.notes:
        print(f"NOTE: {note}")
    unrunnable = sorted({c.offload for c in shown} - set(runnable_offload_modes()))
    if unrunnable:
        print(f"NOTE: memory.offload={', '.join(unrunnable)} is planned (--offload-modes all) but this checkout's "
              "config does not accept it: train.py refuses the launch command below until its runtime is installed")
    if assumed:
        print("ASSUMED (not measured): " + "; ".join(assumed))
    if changes:
        print(f"NOTE: no layout fits with the config as given ({first.considered} layouts considered); these do with "
              f"{' '.join(changes)} (" + "; ".join(MEMORY_LIGHT_WHY[c.split('=')[0]] for c in changes) + ")")
    for i, c in enumerate(result.feasible[:args.top], 1):
        print(describe(c, i, min(args.gpus, args.gpus_per_node), cfg.optim.delayed_update_after))
    print(split_verdict(result))
    best = result.feasible[0]
    # The planning command's own overrides first: the layout's come after them and win, as they did in the search.
    overrides = [*args.overrides, *changes, *best.overrides()]
    train_args = overrides if args.out is None else ["--overrides", write_overrides(args.out, overrides)]
    print("\n".join(launch_lines(args.gpus, args.gpus_per_node, cfg.run.name, args.config, train_args)))
    return 0


RENDEZVOUS_PORT = 29400


def launch_lines(gpus: int, gpus_per_node: int, run_name: str, config: str, train_args: list[str]) -> list[str]:
    """How to start the planned job: one torchrun on one node; on several, the rendezvous store in
    its own process on the first node and one torchrun agent per node pointing at it, as
    docs/parallelism.md launches (HEAD: the first node's address)."""
    nodes, per_node = max(1, -(-gpus // gpus_per_node)), min(gpus, gpus_per_node)
    train = f"train.py --config {shlex.quote(config)} " + " ".join(shlex.quote(a) for a in train_args)
    if nodes == 1:
        return ["run:", f"  torchrun --standalone --nproc_per_node {per_node} {train}"]
    return [f"run on {nodes} nodes of {per_node} GPUs (HEAD: the first node's address; Slurm: docs/parallelism.md):",
            f"  on HEAD, for the life of the job: python -m m6.parallel.rendezvous_store --port {RENDEZVOUS_PORT}",
            f"  on every node: torchrun --nnodes {nodes} --nproc_per_node {per_node} --rdzv_backend c10d "
            f"--rdzv_endpoint HEAD:{RENDEZVOUS_PORT} --rdzv_conf is_host=false --rdzv_id {shlex.quote(run_name)} {train}"]


def write_overrides(path: str, overrides: list[str]) -> str:
    """Write the ``key=value`` lines train.py's ``--overrides FILE`` reads; returns ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(overrides) + "\n")
    print(f"wrote {path}")
    return path


def plan_inventory(args: argparse.Namespace) -> int:
    """A mixed inventory: each kind's share and experts (m6.plan.mixed), written as overrides."""
    try:
        if args.inventory is not None and args.gpus is not None:
            raise ConfigError("give the devices by --gpus or by --inventory, not both")
        inventory = read_inventory(args.inventory) if args.inventory else parse_inventory(args.gpus)
        cfg = m6config.load(args.config, args.overrides)
        plan = plan_mixed(cfg, inventory)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    world = sum(k.count for k in inventory)
    print(f"{args.config} on a mixed inventory of {world} devices: "
          + ", ".join(f"{k.count} x {k.hw.name} ({k.hw.memory_gib:g} GiB)" for k in inventory)
          + f"; EP {plan.expert_parallel_size}, {plan.num_micro} micro-batch(es) per rank")
    print("ASSUMED (not measured): " + "; ".join(dict.fromkeys(a for k in inventory for a in k.hw.assumed)))
    print("\n".join(describe_mixed(plan)))
    overrides = [*args.overrides, *plan.overrides()]
    train_args = overrides if args.out is None else ["--overrides", write_overrides(args.out, overrides)]
    print("train.py rounds each share to whole samples (docs/heterogeneous.md); the ranks are numbered in the "
          "order the kinds are given")
    print("\n".join(launch_lines(world, args.gpus_per_node, cfg.run.name, args.config, train_args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
