"""Everything m6 wants measured on a GPU, in one command (~10 min on one H100):

    python -m bench.gpu_suite --out DIR                      # on the GPU machine
    python -m bench.gpu_suite --out DIR --device cpu --smoke # tiny shapes on a CPU: checks the harness

Parts (bench/gpu_parts.py), each in its own process under its own time limit, so a failure, a
CUDA error or a hang in one is recorded and the rest still run:
  tests            pytest --device cuda on the device-aware tests (tests/conftest.py)
  gemm_rate        the device's measured bf16 matmul rate (8192^3, CUDA events, median)
  moe_layer        bench/moe_layer's layer table on the device: m6 vs DeepSpeed-MoE vs dense, GPU shapes
  moe_kernels      bench/moe_layer --kernels: m6 loop/grouped_mm/fused vs HF grouped_mm vs dense, fine-grained shapes
  train_e2e        m6-gpu-2b and m6-gpu-finegrained at several tokens per step (tokens/s, MFU, peak
                   memory, the step's device time by category, host syncs) and the HF Qwen3-MoE peer
  memory           offload / cast-on-use: device bytes per parameter and step time vs plain
DIR gets PART.json for each part (with the device name, torch, CUDA and driver versions), the
logs, and suite.json + suite.md summing them up.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

# Seconds per part on a GPU (a call runs the parts it names with --parts, inside its 10-minute limit).
BUDGET_S = {"tests": 230, "gemm_rate": 20, "moe_layer": 150, "moe_kernels": 330, "train_e2e": 560, "memory": 80,
            "offload_layouts": 220, "fp16_tiny": 130, "fp16_base": 200}
SMOKE_BUDGET_S = 180  # per part on a shared CPU


def run_part(part: str, args, out: Path, limit_s: float) -> dict:
    """Run one part in a fresh process group; killed with its children when it overruns."""
    cmd = [sys.executable, "-m", "bench.gpu_parts", part, "--out", str(out), "--device", args.device]
    if args.smoke:
        cmd.append("--smoke")
    t0 = time.time()
    log = out / f"{part}.stdout.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            rc = proc.wait(timeout=limit_s)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc, status = None, "timeout"
    record = {"part": part, "status": status, "returncode": rc, "wall_s": round(time.time() - t0, 1),
              "limit_s": limit_s, "log": log.name}
    result_file = out / f"{part}.json"
    if status == "ok" and result_file.exists():
        record["markdown"] = json.loads(result_file.read_text())["markdown"]
    else:
        record["log_tail"] = log.read_text()[-3000:]
    return record


def main(argv: list[str] | None = None) -> int:
    from bench.gpu_parts import PARTS, device_info

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the results (JSON + markdown + logs)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny shapes: a harness check in seconds, not a measurement")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no usable CUDA device here", file=sys.stderr)
        return 2
    parts = [x for x in args.parts.split(",") if x]
    unknown = [x for x in parts if x not in PARTS]
    if unknown:
        print(f"--parts: unknown {unknown}; choose from {list(PARTS)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = device_info(torch.device(args.device))
    t0 = time.time()
    records = []
    for part in parts:
        limit = SMOKE_BUDGET_S if args.smoke else BUDGET_S[part]
        print(f"[gpu_suite] {part} (limit {limit} s) ...", flush=True)
        rec = run_part(part, args, out, limit)
        print(f"[gpu_suite] {part}: {rec['status']} in {rec['wall_s']} s", flush=True)
        records.append(rec)
    suite = {"device_info": info, "smoke": args.smoke, "wall_s": round(time.time() - t0, 1),
             "command": "python -m bench.gpu_suite " + " ".join(argv if argv is not None else sys.argv[1:]),
             "parts": records}
    (out / "suite.json").write_text(json.dumps(suite, indent=2))
    md = [f"# m6 GPU suite{' (SMOKE: tiny shapes, not a measurement)' if args.smoke else ''}", "",
          f"Device: {info.get('name')} ({info['device']}), torch {info['torch']}, CUDA runtime {info['cuda_runtime']}, "
          f"driver {info.get('driver', '-')}, capability {info.get('capability', '-')}; total wall {suite['wall_s']} s.  ",
          f"Command: `{suite['command']}`", ""]
    for rec in records:
        md += [f"## {rec['part']}: {rec['status']} ({rec['wall_s']} s of {rec['limit_s']} s)", ""]
        md += rec.get("markdown") or ["```", rec.get("log_tail", "").strip()[-1500:], "```"]
        md.append("")
    (out / "suite.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
