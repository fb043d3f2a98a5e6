"""Expert parallelism on one machine: the MoE layer at EP=1 (one process, all cores) vs EP=2
(two processes, one core each, experts split, m6's all-to-all), same global tokens, in ONE job.

    python -m bench.moe_ep            # launches itself under torchrun with 2 gloo processes
    python -m bench.moe_ep --quick    # tiny shapes: a harness check

EP=1 runs on rank 0 with 2 threads while rank 1 waits at a barrier; EP=2 runs on both ranks with
1 thread each; the two alternate round-robin so machine drift hits both. Also: a per-phase
forward breakdown at EP=2 (route, permute, all-to-all, experts, combine; each phase ends with a
barrier so it is the slowest rank's time) and the bytes the all-to-all actually sent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.harness import machine_info, machine_tag
from m6.moe import MoELayer
from m6.moe.all_to_all import AllToAllHandle, all_to_all
from m6.moe.dispatch import combine_tokens, permute_tokens
from m6.parallel import ParallelPlan, apply_plan, build_layout, create_process_groups


def _timed(fn, threads: int) -> tuple[float, float]:
    """Wall seconds and CPU-time/wall of one call with ``threads`` intra-op threads."""
    torch.set_num_threads(threads)
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    return wall, (time.process_time() - c0) / wall


def _phases(layer: MoELayer, x_TD: torch.Tensor, group) -> dict[str, float]:
    """Forward of the EP layer split into phases, each closed by a barrier (slowest rank's time)."""
    out, t = {}, time.perf_counter()

    def mark(name):
        nonlocal t
        dist.barrier(group)
        now = time.perf_counter()
        out[name] = now - t
        t = now

    with torch.no_grad():
        routing = layer.router(x_TD)
        plan = layer.dispatch_plan(routing, None, x_TD.shape[0])
        mark("route")
        d = layer.dispatcher
        splits = d.exchange_counts(plan)[0]
        kept = plan.kept(sum(splits.send))
        x_ND = permute_tokens(x_TD, kept)
        mark("permute")
        x_recv = all_to_all(x_ND, splits.recv, splits.send, group)
        mark("all2all_dispatch")
        order = d.local_order(splits.recv_counts_RL, sum(splits.recv))
        y_local = layer.experts(x_recv.index_select(0, order), splits.local_experts)
        mark("experts")
        y_ND = d.send_back(y_local, AllToAllHandle(kept, splits.send, splits.recv, order, x_TD.dtype))
        mark("all2all_combine")
        combine_tokens(y_ND, kept, x_TD.dtype)
        mark("combine")
    return out


def child(args) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    D, F, T = (64, 128, 256) if args.quick else (512, 2048, 4096)
    rows = []
    for E in args.experts:
        for cf in (None, 1.25):
            torch.manual_seed(0)
            full = MoELayer(D, F, E, top_k=2, capacity_factor=cf)
            ep1 = full if rank == 0 else None
            torch.manual_seed(0)
            ep2 = MoELayer(D, F, E, top_k=2, capacity_factor=cf)
            ep2.load_state_dict(full.state_dict())
            groups = create_process_groups(build_layout(world, rank, world, E, local_world_size=world))
            apply_plan(ep2, ParallelPlan(split=[ep2]), groups)
            g = torch.Generator().manual_seed(1)
            x = torch.randn(T, D, generator=g)
            dy = torch.randn(T, D, generator=g)
            share = T // world
            x_mine, dy_mine = x[rank * share:(rank + 1) * share], dy[rank * share:(rank + 1) * share]

            def step(layer, xi, dyi):
                for p in layer.parameters():
                    p.grad = None
                xi = xi.clone().requires_grad_(True)
                y, aux = layer(xi)
                ((y * dyi).sum() + aux).backward()

            times = {"ep1": [], "ep2": []}
            dropped = 0
            for r in range(args.warmup + args.max_rounds):
                dist.barrier()
                w1, u1 = _timed(lambda: step(ep1, x, dy), 2) if rank == 0 else (0.0, 2.0)
                dist.barrier()
                w2, u2 = _timed(lambda: step(ep2, x_mine, dy_mine), 1)
                stats = torch.tensor([w1, w2, min(u1 / 2, u2)])
                dist.all_reduce(stats[:2], op=dist.ReduceOp.MAX)
                dist.all_reduce(stats[2:], op=dist.ReduceOp.MIN)
                if r < args.warmup:
                    continue
                if stats[2] < 0.75:  # a core was taken away during this round: drop it
                    dropped += 1
                    continue
                times["ep1"].append(float(stats[0]))
                times["ep2"].append(float(stats[1]))
                if len(times["ep1"]) >= args.rounds:
                    break
            phases = [_phases(ep2, x_mine, groups.expert) for _ in range(3)]
            # Rows this rank sent to the other rank in one forward dispatch (measured routing).
            routing = ep2.router(x_mine)
            plan = ep2.dispatch_plan(routing, None, share)
            local = range(groups.layout.first_local_expert, groups.layout.first_local_expert + E // world)
            remote_rows = torch.tensor(float(sum(c for e, c in enumerate(plan.counts_E.tolist()) if e not in local)))
            dist.all_reduce(remote_rows)
            row = {
                "num_experts": E, "capacity_factor": cf, "tokens": T, "d_model": D, "ffn_dim": F, "top_k": 2,
                "rounds_kept": len(times["ep1"]), "rounds_dropped": dropped,
                "ep1_median_s": statistics.median(times["ep1"]) if times["ep1"] else None,
                "ep2_median_s": statistics.median(times["ep2"]) if times["ep2"] else None,
                "ep1_spread_s": [min(times["ep1"]), max(times["ep1"])] if times["ep1"] else None,
                "ep2_spread_s": [min(times["ep2"]), max(times["ep2"])] if times["ep2"] else None,
                "ep2_forward_phases_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
                # fp32 rows of d_model, sent in the dispatch and the combine, forward and backward.
                "a2a_bytes_per_step_all_ranks": int(remote_rows) * D * 4 * 4,
            }
            if rank == 0:
                print(json.dumps({k: row[k] for k in ("num_experts", "capacity_factor", "ep1_median_s", "ep2_median_s",
                                                      "rounds_kept", "rounds_dropped")}), file=sys.stderr, flush=True)
            rows.append(row)
    if rank == 0:
        Path(args.json_out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def render(result: dict) -> str:
    lines = [f"# MoE layer, expert parallelism on one machine ({result['machine'].get('cpu_model')})", "",
             f"Command: `{result['command']}`. Same {result['rows'][0]['tokens']} global tokens, top-2, "
             f"d_model {result['rows'][0]['d_model']}, ffn {result['rows'][0]['ffn_dim']}, fp32, forward+backward. "
             "EP=1: one process, 2 threads; EP=2: two gloo processes, 1 thread each, experts split, m6 all-to-all. "
             "Interleaved round-robin; median [min-max]; rounds where a process got less than 75% of its cores dropped.", "",
             "| E | capacity | EP=1 s/step | EP=2 s/step | EP=2 speedup | a2a MB/step | EP=2 forward phases (ms): route / permute / a2a / experts / a2a back / combine | rounds kept/dropped |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        cap = "dropless" if r["capacity_factor"] is None else r["capacity_factor"]
        if not r["rounds_kept"]:
            lines.append(f"| {r['num_experts']} | {cap} | - | - | - | - | every round degraded (CPU share "
                         f"< 75%): no figure | 0/{r['rounds_dropped']} |")
            continue
        ph = r["ep2_forward_phases_s"]
        phases = " / ".join(f"{ph[k] * 1e3:.1f}" for k in ("route", "permute", "all2all_dispatch", "experts", "all2all_combine", "combine"))
        lines.append(f"| {r['num_experts']} | {cap} | {r['ep1_median_s']:.3f} [{r['ep1_spread_s'][0]:.3f}-{r['ep1_spread_s'][1]:.3f}] "
                     f"| {r['ep2_median_s']:.3f} [{r['ep2_spread_s'][0]:.3f}-{r['ep2_spread_s'][1]:.3f}] "
                     f"| {r['ep1_median_s'] / r['ep2_median_s']:.2f} | {r['a2a_bytes_per_step_all_ranks'] / 1e6:.1f} "
                     f"| {phases} | {r['rounds_kept']}/{r['rounds_dropped']} |")
    es = sorted({r["num_experts"] for r in result["rows"]})
    if len(es) > 1:
        lines += ["", "| capacity | time(E=%d)/time(E=%d) at EP=1 | at EP=2 |" % (es[-1], es[0]), "|---|---|---|"]
        for cf in (None, 1.25):
            lo = next(r for r in result["rows"] if r["num_experts"] == es[0] and r["capacity_factor"] == cf)
            hi = next(r for r in result["rows"] if r["num_experts"] == es[-1] and r["capacity_factor"] == cf)
            if not (lo["rounds_kept"] and hi["rounds_kept"]):
                lines.append(f"| {'dropless' if cf is None else cf} | - | - |")
                continue
            lines.append(f"| {'dropless' if cf is None else cf} | {hi['ep1_median_s'] / lo['ep1_median_s']:.3f} "
                         f"| {hi['ep2_median_s'] / lo['ep2_median_s']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--experts", type=int, nargs="*", default=[8, 64])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--max-rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "moe_ep-" + machine_tag(torch.device("cpu")) + ("-quick" if args.quick else "")
    tmp = out / f".{stem}.rows.json"
    env = dict(os.environ, OMP_PROC_BIND="false", MALLOC_MMAP_MAX_="0", OMP_NUM_THREADS="2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29531",
           "-m", "bench.moe_ep", "--child", "--json-out", str(tmp), "--experts", *map(str, args.experts),
           "--rounds", str(args.rounds), "--max-rounds", str(args.max_rounds), "--warmup", str(args.warmup)]
    if args.quick:
        cmd.append("--quick")
    started = time.time()
    subprocess.run(cmd, env=env, check=True)
    result = {"benchmark": "moe_ep", "command": "python -m bench.moe_ep" + (" --quick" if args.quick else ""),
              "machine": machine_info(torch.device("cpu")), "timing_env": "MALLOC_MMAP_MAX_=0, threads unpinned "
              "(two processes share the cores)", "rows": json.loads(tmp.read_text()), "wall_s": round(time.time() - started, 1)}
    tmp.unlink()
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    (out / f"{stem}.md").write_text(render(result))
    print(render(result))


if __name__ == "__main__":
    main()
