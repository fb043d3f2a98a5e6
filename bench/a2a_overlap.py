"""Hiding the all-to-all, measured on the multi-node test bed (bench/netbed.py): 2 "nodes" x 2
ranks (gloo, one thread each), the link out of each node rate-limited with tbf, one MoE layer
(top-2, experts split over all 4 ranks) forward + backward per step.

Settings, run round-robin in ONE job so machine drift hits all alike: the flat blocking exchange
(a2a_overlap_degree 1), chunked overlap at degree 2 and 4, node-limited routing (M = 1 of 2
node groups) blocking and at degree 2, and node-aware dispatch (a2a_dispatch node_aware: a token
crosses to a node once) without and with node-limited routing, blocking and chunked. Per setting: the step time (slowest rank, barrier before
and after each round), and the inter-node payload bytes per step COUNTED by the dispatcher from
the split sizes (AllToAllDispatcher.inter_node_bytes, summed over ranks). Also the blocking
exchanges alone (the same four payload exchanges per step, same splits, no compute), so the
share of the step the flat all-to-all takes is measured, not assumed.

    sudo python -m bench.a2a_overlap                  # needs root (namespaces) and ip/tc
    python -m bench.a2a_overlap --rate-gbit 0.5 --rounds 7 --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {  # name -> (a2a_overlap_degree, max_nodes_per_token, a2a_dispatch)
    "blocking": (1, 0, "flat"),
    "overlap2": (2, 0, "flat"),
    "overlap4": (4, 0, "flat"),
    "node_limited_M1": (1, 1, "flat"),
    "node_limited_M1_overlap2": (2, 1, "flat"),
    "node_aware": (1, 0, "node_aware"),
    "node_aware_overlap2": (2, 0, "node_aware"),
    "node_aware_M1": (1, 1, "node_aware"),
    "node_aware_M1_overlap2": (2, 1, "node_aware"),
    "node_aware_M1_overlap4": (4, 1, "node_aware"),
}


def _layer(args, degree: int, max_nodes: int, dispatch: str, groups):
    from m6.moe import MoELayer
    from m6.parallel import ParallelPlan, apply_plan
    torch.manual_seed(0)
    layer = MoELayer(args.d_model, args.ffn_dim, args.experts, top_k=2, capacity_factor=None,
                     node_groups=2, max_nodes_per_token=max_nodes)
    apply_plan(layer, ParallelPlan(split=[layer]), groups, a2a_overlap_degree=degree, a2a_dispatch=dispatch)
    return layer


def worker(args) -> None:
    """One rank: build every setting, then time them round-robin; rank 0 writes the raw results."""
    from m6.parallel import build_layout, create_process_groups, init_distributed
    torch.set_num_threads(1)
    env = init_distributed(timeout_s=300)
    rank, world = env.rank, env.world_size
    layout = build_layout(world, rank, world, args.experts, local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]))
    groups = create_process_groups(layout, timeout_s=300, node_aware=True)
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own tokens
    x = torch.randn(args.tokens, args.d_model, generator=g)
    settings = args.settings.split(",") if args.settings else list(SETTINGS)
    layers = {name: _layer(args, *SETTINGS[name], groups) for name in settings}

    def step(layer) -> None:
        xi = x.clone().requires_grad_(True)
        y, aux = layer(xi)
        (y.square().mean() + aux).backward()

    def exchanges_alone(layer) -> None:
        """The blocking layer's four payload exchanges (dispatch, combine, and their gradients) with
        the splits of its routing, no compute: what the flat all-to-all costs on this link."""
        d = layer.dispatcher
        with torch.no_grad():
            plan = layer.dispatch_plan(layer.router(x), None, x.shape[0])
            splits = d.exchange_counts(plan)[0]
        rows_out = torch.empty(sum(splits.send), args.d_model)
        rows_in = torch.empty(sum(splits.recv), args.d_model)
        for _ in range(2):  # forward and backward
            dist.all_to_all_single(rows_in, rows_out, splits.recv, splits.send, group=d.group)
            dist.all_to_all_single(rows_out, rows_in, splits.send, splits.recv, group=d.group)

    def node_stage_alone(layer) -> None:
        """The node-aware layer's four forwarding (stage B) exchanges per step with its splits, no
        compute: what the link inside a node costs (the planner check's intra-node figure)."""
        d = layer.dispatcher
        with torch.no_grad():
            n = d._source(x, layer.dispatch_plan(layer.router(x), None, x.shape[0]), 1).n
        rows_out, rows_in = torch.empty(sum(n.b_send[0]), args.d_model), torch.empty(sum(n.b_recv[0]), args.d_model)
        for _ in range(2):
            dist.all_to_all_single(rows_in, rows_out, n.b_recv[0], n.b_send[0], group=d.node_group)
            dist.all_to_all_single(rows_out, rows_in, n.b_send[0], n.b_recv[0], group=d.node_group)

    from m6.moe.loopback import LoopbackDispatcher
    compute = _layer(args, 1, 0, "flat", groups)
    # The same layer with every exchange skipped (m6.moe.loopback), all ranks at once: the compute
    # of a step under the same sharing of the cores (the planner check's compute). No barriers in
    # place of the exchanges: on this link a barrier costs milliseconds of its own.
    compute.dispatcher = LoopbackDispatcher(args.experts, world, None)
    runs = {**{name: (lambda l=layers[name]: step(l)) for name in settings},
            "exchanges_alone": lambda: exchanges_alone(layers["blocking"]),
            "compute_alone": lambda: step(compute)}
    if "node_aware" in layers:
        runs["node_stage_alone"] = lambda: node_stage_alone(layers["node_aware"])
    for fn in runs.values():  # warm-up
        fn()
    records = {name: {"wall_s": [], "cpu_util": [], "inter_node_bytes": []} for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            layer = layers.get(name)
            before = layer.dispatcher.inter_node_bytes if layer is not None else 0
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(args.steps):
                fn()
            dist.barrier()
            wall = (time.perf_counter() - t0) / args.steps
            util = (time.process_time() - c0) / (wall * args.steps)
            sent = torch.tensor([(layer.dispatcher.inter_node_bytes - before) / args.steps if layer else 0.0,
                                 util], dtype=torch.float64)
            gathered = [torch.zeros_like(sent) for _ in range(world)]
            dist.all_gather(gathered, sent)
            records[name]["wall_s"].append(wall)
            records[name]["cpu_util"].append([float(t[1]) for t in gathered])
            records[name]["inter_node_bytes"].append(sum(float(t[0]) for t in gathered))
    if rank == 0:
        Path(args.raw).write_text(json.dumps(records))
    dist.destroy_process_group()


def _summary(records: dict, min_util: float) -> dict:
    """Median and spread of the kept rounds (rounds where some rank got under ``min_util`` of a
    core are dropped for every setting: a starved rank stalls the whole exchange)."""
    rounds = len(next(iter(records.values()))["wall_s"])
    starved = {i for rec in records.values() for i in range(rounds) if min(rec["cpu_util"][i]) < min_util}
    kept = [i for i in range(rounds) if i not in starved]
    out = {"rounds": rounds, "rounds_dropped": len(starved), "settings": {}}
    base = records["blocking"]["wall_s"]
    for name, rec in records.items():
        walls = [rec["wall_s"][i] for i in kept]
        ratios = [rec["wall_s"][i] / base[i] for i in kept]  # paired with blocking in the same round
        out["settings"][name] = {
            "median_s": statistics.median(walls) if walls else None,
            "median_ratio_to_blocking": statistics.median(ratios) if ratios else None,
            "ratio_to_blocking_min_max": [min(ratios), max(ratios)] if ratios else None,
            "min_s": min(walls) if walls else None, "max_s": max(walls) if walls else None,
            "inter_node_bytes_per_step": statistics.median(rec["inter_node_bytes"]),
            "wall_s_all_rounds": rec["wall_s"], "cpu_util_all_rounds": rec["cpu_util"],
        }
    return out


def _markdown(result: dict) -> str:
    s, cfg = result["summary"]["settings"], result["config"]
    base = s["blocking"]["median_s"]
    lines = [
        "# Hiding the all-to-all on the test bed (bench/a2a_overlap.py)", "",
        f"Command: `{result['command']}`  ",
        f"Machine: {result['machine']['cpu_model']}, {result['machine']['cpu_count']} CPUs (shared with other "
        f"jobs), torch {result['machine']['torch']}, {result['machine']['platform']}  ",
        f"Test bed: 2 nodes x 2 ranks (network namespaces on a bridge, bench/netbed.py), gloo, 1 thread per rank; "
        f"each node's outgoing link tbf {cfg['rate_gbit']} Gbit/s, traffic inside a node unlimited.  ",
        f"Layer: d_model {cfg['d_model']}, ffn {cfg['ffn_dim']}, {cfg['experts']} experts (2 per rank), top-2, "
        f"dropless, fp32, {cfg['tokens']} tokens per rank; a step = forward + backward of the layer; "
        f"{cfg['steps']} steps per round, {result['summary']['rounds']} rounds round-robin, "
        f"{result['summary']['rounds_dropped']} dropped (a rank under {cfg['min_util']} of a core). CPU-time/wall "
        f"of every rank and round is in the json; a rank waiting on the link uses little CPU by design, so low "
        f"utilisation does not by itself mark a starved round here (hence --min-util 0 by default).", "",
        "| setting | median step (s) | min-max (s) | median / blocking | per-round ratio to blocking: median (min-max) | inter-node bytes / step (counted) |",
        "|---|---|---|---|---|---|",
    ]
    for name, v in s.items():
        if v["median_s"] is None:
            continue
        probe = name in ("exchanges_alone", "compute_alone", "node_stage_alone")
        rel = f"{v['median_s'] / base:.0%} of the blocking step" if probe else f"{v['median_s'] / base:.2f}x"
        moved = "-" if probe else f"{v['inter_node_bytes_per_step'] / 2**20:.2f} MiB"
        lo, hi = v["ratio_to_blocking_min_max"]
        paired = f"{v['median_ratio_to_blocking']:.2f} ({lo:.2f}-{hi:.2f})"
        lines.append(f"| {name} | {v['median_s']:.4f} | {v['min_s']:.4f}-{v['max_s']:.4f} | {rel} | {paired} | {moved} |")
    lines += ["", "exchanges_alone: the blocking layer's four payload exchanges per step (same splits, no "
              "compute), i.e. what the flat all-to-all alone costs on this link. compute_alone: the layer's step "
              "with its exchanges skipped (m6.moe.loopback), all ranks at once. node_stage_alone: the node-aware "
              "layer's four forwarding exchanges inside the node, no compute.", ""]
    return "\n".join(lines)


def plan_check(result: dict) -> dict:
    """The planner's all-to-all model (m6.plan.timing.expert_exchange_s, as step_time sums it: four
    payload exchanges and one counts exchange per layer; on a CPU host no overlap, so a chunked
    setting is predicted as its blocking form) plus the MEASURED compute of the same step with the
    exchanges skipped (compute_alone), against each setting's measured median step.
    The link figures the planner is given come from probes in the same run (bench.plan_validation
    likewise passes measured gloo figures): the inter-node bandwidth per rank from the flat exchanges
    alone (their bytes per rank over their time, a latency taken off each), the intra-node one from
    the node-aware forwarding exchanges alone; latency 100 us (the planner's CPU default)."""
    from m6 import config as m6config
    from m6.plan.timing import cpu_hardware, expert_exchange_s
    cfg, s = result["config"], result["summary"]["settings"]
    if "compute_alone" not in s or "exchanges_alone" not in s:
        return {}
    ep, per_node, latency, K = cfg["nodes"] * cfg["ranks_per_node"], cfg["ranks_per_node"], 100e-6, cfg["top_k"]
    row = cfg["d_model"] * 4  # fp32 payload
    inter_bytes = cfg["tokens"] * K * row * (ep - per_node) / ep  # a rank's rows for the other node, per exchange
    inter_GBps = inter_bytes / (s["exchanges_alone"]["median_s"] / 4 - latency) / 1e9
    intra_GBps = 1e3  # no forwarding measured: the node's own links taken as free
    if "node_stage_alone" in s:
        intra_bytes = cfg["tokens"] * K * row * (per_node - 1) / per_node
        intra_GBps = intra_bytes / max(s["node_stage_alone"]["median_s"] / 4 - latency, 1e-6) / 1e9
    hw = dataclasses.replace(cpu_hardware(16.0, intra_GBps, latency), inter_node_GBps=inter_GBps)
    base = [f"model.d_model={cfg['d_model']}", f"model.moe.num_experts={cfg['experts']}", f"model.moe.top_k={K}",
            "model.moe.num_prototypes=1", "model.moe.node_groups=2"]
    rows = {}
    for name, (degree, max_nodes, dispatch) in SETTINGS.items():
        if name not in s:
            continue
        run = m6config.load(REPO / "configs" / "tiny.yaml", [*base, f"model.moe.max_nodes_per_token={max_nodes}",
                                                              f"model.moe.a2a_dispatch={dispatch}"])
        a2a = 4 * expert_exchange_s(run, cfg["tokens"], 4, ep, per_node, hw) + latency
        predicted = s["compute_alone"]["median_s"] + a2a
        measured = s[name]["median_s"]
        rows[name] = {"predicted_s": predicted, "measured_s": measured, "error": predicted / measured - 1,
                      "all_to_all_s": a2a, "overlap_degree_run": degree}
    return {"inter_node_GBps_per_rank": inter_GBps, "intra_node_GBps": intra_GBps, "latency_s": latency,
            "compute_s": s["compute_alone"]["median_s"], "settings": rows}


def _plan_markdown(check: dict) -> str:
    if not check:
        return ""
    lines = ["", "## The planner's model against the test bed", "",
             f"Planner inputs: measured compute {check['compute_s']:.4f} s per step (compute_alone); link "
             f"{check['inter_node_GBps_per_rank'] * 1e3:.2f} MB/s per rank between nodes (fitted on the flat "
             f"exchanges alone), {check['intra_node_GBps'] * 1e3:.0f} MB/s inside a node (fitted on the "
             f"forwarding exchanges alone), latency {check['latency_s'] * 1e6:.0f} us. Predicted step = compute + "
             f"the planner's all-to-all (m6.plan.timing.expert_exchange_s x 4 + a counts exchange); on a CPU host "
             f"the planner does not model overlap, so a chunked setting is predicted as its blocking form.", "",
             "| setting | measured median (s) | predicted (s) | of which all-to-all (s) | error |",
             "|---|---|---|---|---|"]
    for name, r in check["settings"].items():
        lines.append(f"| {name} | {r['measured_s']:.4f} | {r['predicted_s']:.4f} | {r['all_to_all_s']:.4f} | "
                     f"{r['error']:+.0%} |")
    return "\n".join(lines + [""])


def pool(paths: list[str]) -> str:
    """Markdown: every setting's step time over the rounds of several runs, as a ratio to the
    blocking step of the same round (median, quartiles, share of rounds faster than blocking)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    lines = [f"# Pooled rounds of {', '.join(Path(p).name for p in paths)} (bench/a2a_overlap.py --pool)", "",
             f"Command: `python -m bench.a2a_overlap --pool {' '.join(paths)}`", "",
             "| setting | rounds | per-round ratio to blocking: median | quartiles | rounds faster than blocking |",
             "|---|---|---|---|---|"]
    for name in runs[0]["summary"]["settings"]:
        ratios = []
        for run in runs:
            settings = run["summary"]["settings"]
            ratios += [w / b for w, b in zip(settings[name]["wall_s_all_rounds"], settings["blocking"]["wall_s_all_rounds"])]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        faster = sum(r < 1 for r in ratios) / len(ratios)
        lines.append(f"| {name} | {len(ratios)} | {statistics.median(ratios):.2f} | {q1:.2f}-{q3:.2f} | {faster:.0%} |")
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-gbit", type=float, default=0.5)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--ffn-dim", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--min-util", type=float, default=0.0)
    parser.add_argument("--settings", help="comma-separated subset of the settings (blocking is always needed)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--stem", default="a2a_overlap")
    parser.add_argument("--pool", nargs="+", metavar="JSON", help="pool the rounds of these result files "
                        "(writes <out>/<stem>.md) instead of measuring")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--raw", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.pool:
        markdown = pool(args.pool)
        Path(args.out, f"{args.stem}.md").write_text(markdown)
        print(markdown)
        return
    from bench.harness import machine_info, write_results
    from bench.netbed import NetBed
    why = NetBed.unavailable()
    if why:
        raise SystemExit(f"bench.a2a_overlap: the test bed cannot be made here: {why}")
    raw = Path(args.out) / f".{args.stem}-raw-{os.getpid()}.json"
    raw.parent.mkdir(parents=True, exist_ok=True)
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    with NetBed(nodes=2, rate_gbit=args.rate_gbit) as bed:
        env = dict(os.environ, WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", MASTER_ADDR=bed.address(0), MASTER_PORT="29541",
                   GLOO_SOCKET_IFNAME="nb0", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        procs = []
        for rank in range(4):
            node = rank // 2
            procs.append(bed.popen(node, [sys.executable, "-m", "bench.a2a_overlap", *passthrough, "--worker",
                                          "--raw", str(raw)],
                                   env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank % 2)}, cwd=REPO))
        try:
            codes = [p.wait(timeout=3600) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    if any(codes):
        raise SystemExit(f"bench.a2a_overlap: worker exit codes {codes}")
    records = json.loads(raw.read_text())
    raw.unlink()
    result = {
        "command": "python -m bench.a2a_overlap " + " ".join(passthrough),
        "machine": {**machine_info(torch.device("cpu")), "lscpu": _lscpu()},
        "config": {"rate_gbit": args.rate_gbit, "tokens": args.tokens, "d_model": args.d_model,
                   "ffn_dim": args.ffn_dim, "experts": args.experts, "steps": args.steps, "min_util": args.min_util,
                   "nodes": 2, "ranks_per_node": 2, "top_k": 2, "backend": "gloo"},
        "summary": _summary(records, args.min_util),
    }
    result["plan_check"] = plan_check(result)
    write_results(args.out, args.stem, result, _markdown(result) + _plan_markdown(result["plan_check"]))


def _lscpu() -> list[str]:
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()[:12]
    except OSError:
        return [platform.processor()]


if __name__ == "__main__":
    main()
