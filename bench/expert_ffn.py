"""Where the MoE layer's time goes at many experts: the expert FFN alone, four ways, in one run.

    python -m bench.expert_ffn [--experts 64] [--rows 8192]

m6's per-expert GEMM loop (GroupedExperts), the same with every expert padded to the largest
count and one batched bmm, torch's F.grouped_mm with autograd, and one dense FFN over the same
rows (the compute limit). Forward+backward, fp32, random (balanced-ish) routing, interleaved
round-robin, pinned threads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.harness import machine_info, machine_tag, time_round_robin
from m6.moe.experts import GroupedExperts


def build_steps(num_experts: int, rows: int, d_model: int, ffn_dim: int) -> tuple[dict, dict]:
    torch.manual_seed(0)
    counts = torch.bincount(torch.randint(0, num_experts, (rows,)), minlength=num_experts)
    splits = counts.tolist()
    x = torch.randn(rows, d_model, requires_grad=True)
    dy = torch.randn(rows, d_model)
    experts = GroupedExperts(num_experts, d_model, ffn_dim)
    w_in = experts.w_in.detach().clone().requires_grad_(True)
    w_out = experts.w_out.detach().clone().requires_grad_(True)
    longest = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    expert_of_row = torch.repeat_interleave(torch.arange(num_experts), counts)
    padded_slot = expert_of_row * longest + (torch.arange(rows) - starts[expert_of_row])
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    dense_in = torch.nn.Linear(d_model, ffn_dim, bias=False)
    dense_out = torch.nn.Linear(ffn_dim, d_model, bias=False)

    def clear(*params):
        for p in params:
            p.grad = None
        x.grad = None

    def loop():
        clear(*experts.parameters())
        experts(x, splits).backward(dy)

    def padded_bmm():
        clear(w_in, w_out)
        x_pad = x.new_zeros(num_experts * longest, d_model).index_copy(0, padded_slot, x)
        h = torch.bmm(x_pad.view(num_experts, longest, d_model), w_in)
        y = torch.bmm(F.gelu(h), w_out).view(-1, d_model)
        y.index_select(0, padded_slot).backward(dy)

    def grouped_mm():
        clear(w_in, w_out)
        h = F.grouped_mm(x, w_in, offs=offsets)
        F.grouped_mm(F.gelu(h), w_out, offs=offsets).backward(dy)

    def dense():
        clear(dense_in.weight, dense_out.weight)
        dense_out(F.gelu(dense_in(x))).backward(dy)

    info = {"rows_per_expert_mean": rows / num_experts, "rows_per_expert_max": longest,
            "padding_overhead": num_experts * longest / rows}
    return {"m6_loop": loop, "padded_bmm": padded_bmm, "torch_grouped_mm": grouped_mm, "dense": dense}, info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--rows", type=int, default=8192, help="routed rows (tokens x top_k)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.child:  # re-launch with pinned threads and no per-step page faults
        env = dict(os.environ, OMP_PROC_BIND="close", OMP_PLACES="cores", MALLOC_MMAP_MAX_="0")
        os.execve(sys.executable, [sys.executable, "-m", "bench.expert_ffn", *sys.argv[1:], "--child"], env)
    steps, info = build_steps(args.experts, args.rows, 512, 2048)
    t = time_round_robin(steps, torch.device("cpu"), min_rounds=args.rounds, max_rounds=3 * args.rounds)
    rows = {name: {"median_s": t.median(name), "spread_s": list(t.spread(name)),
                   "time_vs_dense": dict(zip(("median", "min", "max"), t.paired_ratio(name, "dense")))}
            for name in steps}
    result = {"benchmark": "expert_ffn", "command": f"python -m bench.expert_ffn --experts {args.experts} --rows {args.rows}",
              "machine": machine_info(torch.device("cpu")), "num_experts": args.experts, "rows": args.rows,
              "d_model": 512, "ffn_dim": 2048, **info, "rounds_kept": t.rounds_kept, "rounds_dropped": t.rounds_dropped,
              "results": rows}
    lines = [f"# Expert FFN alone, E={args.experts}, {args.rows} rows (d 512, ffn 2048, fp32, fwd+bwd)", "",
             f"Command: `{result['command']}` on {result['machine']['cpu_model']}; rows/expert mean "
             f"{info['rows_per_expert_mean']:.0f}, max {info['rows_per_expert_max']}; rounds kept/dropped "
             f"{t.rounds_kept}/{t.rounds_dropped}.", "", "| implementation | median s [min-max] | time / dense (paired) |", "|---|---|---|"]
    for name, r in rows.items():
        v = r["time_vs_dense"]
        lines.append(f"| {name} | {r['median_s']:.3f} [{r['spread_s'][0]:.3f}-{r['spread_s'][1]:.3f}] | "
                     f"{v['median']:.2f} [{v['min']:.2f}-{v['max']:.2f}] |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"expert_ffn-{machine_tag(torch.device('cpu'))}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
