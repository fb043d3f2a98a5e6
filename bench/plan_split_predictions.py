"""Whether tensor or pipeline parallel is the fastest fitting plan of a published config (#47):
m6.plan's search over every config in configs/ on the cluster it is planned for, with tp (1, 2,
4, 8 inside a node, with and without sequence parallel) and pp (1, 2, 4, 8; each schedule) beside
EP, shard, offload and recompute. Pipelines are modelled whether or not this m6 builds them yet
(m6.plan.search.search(pps=...)); the table says which.

    python -m bench.plan_split_predictions [--only NAME]

Every figure is a PREDICTION (datasheet peaks x an assumed efficiency, assumed links: printed);
none is measured on those GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass

import torch

from bench.harness import write_results
from m6.config import load
from m6.plan.search import SHARD, pipeline_builds, search
from m6.plan.pipeline_offload import PP_OFFLOAD
from m6.plan.tensor_parallel import TP_OFFLOAD, TP_RECOMPUTE, TP_SHARD
from m6.plan.timing import GPUS, HostProfile

HOST_GIB = 1024.0
PPS = (1, 2, 4, 8)


@dataclass
class Case:
    name: str
    config: str
    overrides: list[str]
    gpus: int
    gpu: str
    memory_gib: float
    per_node: int = 8


CASES = [
    Case("m6-base-moe", "configs/m6-base-moe.yaml", [], 8, "h100", 80),
    Case("m6-gpu-2b", "configs/m6-gpu-2b.yaml", [], 8, "h100", 80),
    Case("m6-gpu-finegrained", "configs/m6-gpu-finegrained.yaml", [], 8, "h100", 80),
    Case("m6-dense-7b-moe", "configs/m6-dense-7b-moe.yaml", [], 16, "h100", 80),
    Case("m6-dense-7b-moe-v100", "configs/m6-dense-7b-moe.yaml", [], 16, "v100", 32),
    Case("mixtral-8x7b", "configs/mixtral-8x7b.yaml", [], 16, "h100", 80),
    # As shipped the states' async checkpoint staging fills the hosts unless the model is split;
    # with synchronous saves (what python -m m6.plan adds by itself) FSDP2 + offload fits too.
    Case("mixtral-8x7b sync saves", "configs/mixtral-8x7b.yaml", ["checkpoint.async_save=false"], 16, "h100", 80),
    Case("olmoe-1b-7b", "configs/olmoe-1b-7b.yaml", [], 8, "h100", 80),
    Case("qwen3-moe-30b-a3b", "configs/qwen3-moe-30b-a3b.yaml", [], 16, "h100", 80),
    Case("m6-100b", "configs/m6-100b.yaml", [], 64, "h100", 80),
    # The giants at the scales bench/results/plan-predictions*.md plan them (M6-10T on V100s with
    # the settings that fit there: Adafactor, synchronous saves).
    Case("M6-T (m6-1t)", "configs/m6-1t.yaml", ["train.global_batch_size=960"], 480, "v100", 32),
    Case("M6-10T (m6-10t)", "configs/m6-10t.yaml", [], 512, "h100", 80),
    Case("M6-10T (m6-10t) V100", "configs/m6-10t.yaml", ["optim.name=adafactor", "checkpoint.async_save=false"],
         512, "v100", 32),
]


def summary(c) -> dict:
    t = c.time
    return {"layout": c.layout_name() or "no model split", "tp": c.tensor_parallel_size, "sp": c.sequence_parallel,
            "pp": c.pipeline_parallel_size, "schedule": c.pipeline_schedule, "ep": c.expert_parallel_size,
            "micro_batch": c.micro_batch, "recompute": c.recompute, "offload": c.offload, "shard": c.shard,
            "tokens_per_s": c.tokens_per_s, "mfu": c.mfu, "peak_gib": c.memory.peak_device / 2**30,
            "step_s": t.total, "compute_s": t.compute, "tp_s": t.tensor_parallel, "bubble_s": t.pipeline_bubble,
            "p2p_s": t.pipeline_p2p, "all_to_all_s": t.all_to_all, "grad_sync_s": t.grad_sync,
            "offload_s": t.offload, "update_s": t.update}


def plan_case(case: Case) -> dict:
    cfg = load(case.config, case.overrides)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tensor_parallel_size=1,
                                                                sequence_parallel=False))
    hw = dataclasses.replace(GPUS[case.gpu], memory_gib=case.memory_gib)
    host = HostProfile(1, host_cores_per_gpu=12)
    t0 = time.perf_counter()
    result = search(cfg, case.gpus, case.per_node, hw, host, HOST_GIB, 8, shard=SHARD,
                    pps=tuple(p for p in PPS if case.gpus % p == 0))
    out = {"case": dataclasses.asdict(case), "seconds": time.perf_counter() - t0, "considered": result.considered,
           "fitting": result.fitting, "skipped": result.skipped_splits}
    feasible = result.feasible
    pick = {"best": feasible[:1],
            "best without tp or pp": [c for c in feasible if c.tensor_parallel_size == 1 and c.pipeline_parallel_size == 1][:1],
            "best with tp": [c for c in feasible if c.tensor_parallel_size > 1][:1],
            **{f"best with pp {s}": [c for c in feasible if c.pipeline_schedule == s][:1]
               for s in ("1f1b", "interleaved", "zero_bubble")}}
    out["plans"] = {k: summary(v[0]) if v else None for k, v in pick.items()}
    return out


def why(row: dict) -> str:
    """The winner and, for a split that loses, the part of its step that costs it."""
    p = row["plans"]
    best, plain = p["best"], p["best without tp or pp"]
    if best is None:
        return "nothing fits"
    if best["tp"] > 1 or best["pp"] > 1:
        if plain is None:
            return f"{best['layout']} wins: nothing without a model split fits"
        return (f"{best['layout']} wins: {best['tokens_per_s'] / plain['tokens_per_s']:.2f}x the best without "
                f"(compute {best['compute_s']:.3f} vs {plain['compute_s']:.3f} s, grad sync {best['grad_sync_s']:.3f} "
                f"vs {plain['grad_sync_s']:.3f}, offload {best['offload_s']:.3f} vs {plain['offload_s']:.3f}, update "
                f"{best['update_s']:.3f} vs {plain['update_s']:.3f})")
    parts = []
    tp = p["best with tp"]
    if tp is None:
        parts.append("TP: no fitting layout" + (f" ({'; '.join(v for k, v in row['skipped'].items() if k.startswith('tp'))})"
                                                if any(k.startswith("tp") for k in row["skipped"]) else ""))
    else:
        parts.append(f"TP {tp['tokens_per_s'] / best['tokens_per_s']:.2f}x (compute {tp['compute_s']:.3f} vs "
                     f"{best['compute_s']:.3f} s: the MoE layers run whole on every tp rank; tp collectives "
                     f"{tp['tp_s']:.3f} s)")
    pps = [v for k, v in p.items() if k.startswith("best with pp") and v]
    if not pps:
        parts.append("PP: no fitting layout")
    else:
        top = max(pps, key=lambda v: v["tokens_per_s"])
        parts.append(f"PP {top['tokens_per_s'] / best['tokens_per_s']:.2f}x ({top['layout']}: bubble "
                     f"{top['bubble_s']:.3f} + sends {top['p2p_s']:.3f} s against compute {top['compute_s']:.3f} s; "
                     f"its EP {top['ep']} over {row['case']['gpus'] // top['pp'] // top['tp']} data-parallel ranks)")
    return "; ".join(parts)


def markdown(rows: list[dict], info: dict) -> str:
    lines = ["# Tensor and pipeline parallel in the planner's search over the published configs", "",
             f"Every figure is a PREDICTION of m6.plan (datasheet peaks x an assumed efficiency, assumed links; "
             f"see docs/planning.md), none measured on these GPUs. Host: {info['host']}; torch {info['torch']}; "
             f"{info['date']}. 1 TB host memory per node, 8 GPUs per node. Searched: tp 1/2/4/8 inside a node "
             f"(with and without sequence parallel; with recompute {'/'.join(TP_RECOMPUTE)}, offload "
             f"{'/'.join(TP_OFFLOAD)} and sharding {'/'.join(TP_SHARD)}, as m6 builds tensor parallel today), pp 1/2/4/8 "
             f"with each schedule (recompute none or full, offload {'/'.join(PP_OFFLOAD)}, sharding none; also x tp "
             f"inside each stage, recompute none or full, no sequence parallel; each pipeline rank sized with its own stages; "
             f"zero_bubble not where the config has a caption eval, which m6 refuses on it), beside EP, micro-batch, "
             f"recompute, offload and parallel.shard none/optimizer/full.",
             f"Pipelines: {info['pipelines']}", "",
             "| config | GPUs | fastest fitting plan | tokens/s | MFU | best without tp/pp | best with tp | "
             "best with pp (1f1b / interleaved / zero_bubble) | verdict |", "|---|---|---|---|---|---|---|---|---|"]

    def cell(s: dict | None) -> str:
        if s is None:
            return "none fits"
        return (f"{s['layout']}, EP {s['ep']}, mb {s['micro_batch']}, recompute {s['recompute']}, offload "
                f"{s['offload']}, shard {s['shard']}: {s['tokens_per_s']:,.0f}")

    for r in rows:
        c, p = r["case"], r["plans"]
        best = p["best"]
        pp = " / ".join(f"{v['tokens_per_s']:,.0f} (pp {v['pp']})" if v else "none fits"
                        for k, v in p.items() if k.startswith("best with pp"))
        lines.append(f"| {c['name']} {' '.join(c['overrides'])} | {c['gpus']} x {c['gpu']} {c['memory_gib']:g} GB | "
                     f"{cell(best)} | {best['tokens_per_s']:,.0f} | "
                     f"{'-' if best['mfu'] is None else format(best['mfu'], '.1%')} | {cell(p['best without tp or pp'])} | "
                     f"{cell(p['best with tp'])} | {pp} | {why(r)} |" if best else
                     f"| {c['name']} | {c['gpus']} x {c['gpu']} | none fits | | | | | | |")
    wins = [r["case"]["name"] for r in rows if r["plans"]["best"] and (r["plans"]["best"]["tp"] > 1
                                                                         or r["plans"]["best"]["pp"] > 1)]
    lines += ["", "Configs whose fastest fitting plan splits the model: " + (", ".join(wins) if wins else "none") + "."]
    needs = []
    for r in rows:
        best, p = r["plans"]["best"], r["plans"]
        if best and p["best with tp"] is None and not any(v for k, v in p.items() if k.startswith("best with pp")):
            used = [f"{what} {best[key]}" for what, key in (("recompute", "recompute"), ("offload", "offload"),
                                                           ("shard", "shard")) if best[key] != "none"]
            if used:
                needs.append(f"{r['case']['name']} ({', '.join(used)})")
    if needs:
        lines += ["", "Where neither split fits, the fastest plan needs memory features that tensor parallel or "
                  "pipelines are not searched with (tensor parallel: offload and auto recompute; pipelines: sharding, "
                  "auto recompute and offload other than optimizer): " + "; ".join(needs) + ". At those "
                  "scales the model states, not the compute or the links, decide the layout."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--stem", default="plan-predictions-pp-tp")
    args = p.parse_args(argv)
    rows = []
    for case in CASES:
        if args.only is None or args.only in case.name:
            rows.append(plan_case(case))
            best = rows[-1]["plans"]["best"]
            print(f"{case.name}: {why(rows[-1])} ({rows[-1]['seconds']:.0f} s)"
                  + (f"; best {best['layout']} {best['tokens_per_s']:,.0f} tokens/s" if best else ""), flush=True)
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    info = {"host": f"{cpu}, {os.cpu_count()} cores", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "pipelines": ("this m6 builds them (parallel.pipeline_parallel_size)" if pipeline_builds() else
                          "this m6 does not build them yet (m6.config.ParallelConfig has no pipeline_parallel_size): "
                          "the pp columns are what the planner predicts for the schedules once it does")}
    write_results(args.out, args.stem, {"info": info, "rows": rows}, markdown(rows, info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
