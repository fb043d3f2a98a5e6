"""Host bytes per parameter of the offloaded update (memory.offload=optimizer) with each optimizer:
AdamW (torch's, and DeepSpeed's CPU Adam where its op builds) and Adafactor (optim.name=adafactor),
measured, next to m6's memory estimate (m6.memory.estimate, what m6.plan sizes layouts with).

    python -m bench.host_bytes             # bench/memory's 25M-parameter MoE model, ~3 min
    python -m bench.host_bytes --quick     # a small model: a harness check, not a measurement

Each setting runs in its own process (a fresh heap) on the CPU device, 3 training steps. Measured:
- the host-resident model states: the bytes of the distinct storages of the host masters, their
  gradient buffers and every optimizer state tensor, read from the tensors after the steps;
- the update's temporaries: the resident-set high-water mark during the last step's host update
  (GroupedApply.step, VmHWM reset just before it) minus the resident set at its start. The process
  runs without MALLOC_MMAP_MAX_=0, so glibc serves large temporaries with fresh mmapped pages,
  which the high-water mark sees (a reused heap block would hide them; MALLOC_MMAP_THRESHOLD_ is
  fixed at 128 KiB so that glibc does not raise it after the first step's frees). The last step's
  peak counts (the first one also creates the optimizer state).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile

import torch

from bench.harness import current_rss_bytes, machine_info, machine_tag, peak_rss_bytes, reset_peak_rss, write_results
from bench.memory import COMMON, MODEL
from m6.config import load
from m6.memory.estimate import estimate_memory
from m6.train.loop import Trainer
from m6.train.optim import no_decay_ids

SETTINGS = {
    "adamw (torch)": ["optim.name=adamw", "memory.host_optimizer=torch"],
    "adamw (deepspeed)": ["optim.name=adamw", "memory.host_optimizer=deepspeed"],
    "adafactor (torch)": ["optim.name=adafactor", "memory.host_optimizer=torch"],
}
STEPS = 3


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def measure_one(name: str, model: str) -> dict:
    """One setting, in this process: the host state's bytes and the update's temporaries."""
    overrides = [*COMMON, *MODEL[model], "train.device=cpu", "memory.offload=optimizer", "checkpoint.async_save=false",
                 *SETTINGS[name]]
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        tr = Trainer(load(None, [*overrides, f"run.dir={tmp}"]))
        apply_step = tr.update.apply.step
        peaks = []

        def measured_step(*args, **kwargs):
            start = current_rss_bytes()
            reset_peak_rss()
            apply_step(*args, **kwargs)
            peaks.append(peak_rss_bytes() - start)
        tr.update.apply.step = measured_step
        for _ in range(STEPS):
            tr.train_step()
        off = tr.update.offload
        params = [p for p in tr.model.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in params)
        # The gradient buffers are kept between steps (zero_grad drops only the .grad links).
        state = [v for s in tr.update.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        measured = {"params": _storage_bytes(off.masters_of(params)),
                    "grads": _storage_bytes(off._grad_buffers.values()),
                    "optimizer state": _storage_bytes(state),
                    "optimizer step temporaries": peaks[-1]}
        est = estimate_memory(tr.cfg, tr.model, no_decay_ids(tr.model), device_type="cpu").host
    return {"setting": name, "overrides": SETTINGS[name], "num_params": numel, "host_optimizer": tr.update.host_optimizer,
            "measured_bytes": measured, "estimated_bytes": {k: est.get(k, 0.0) for k in measured},
            "update_peak_per_step": peaks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    model = "quick" if args.quick else "full"
    if args.one:
        print(json.dumps(measure_one(args.one, model)))
        return
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_MAX_"}
    # A fixed threshold: glibc otherwise raises it to the size of each freed mmapped block, and the
    # next step's temporaries would come from reused heap pages the high-water mark does not see.
    env.update(OMP_PROC_BIND="close", OMP_PLACES="cores", MALLOC_MMAP_THRESHOLD_="131072")
    results = []
    for name in SETTINGS:
        cmd = [sys.executable, "-m", "bench.host_bytes", "--one", name] + (["--quick"] if args.quick else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            results.append({"setting": name, "failed": proc.stderr.strip().splitlines()[-1:]})
            continue
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    lines = ["# Host bytes per parameter of the offloaded update, by optimizer", "",
             f"Command: `python -m bench.host_bytes{' --quick' if args.quick else ''}`; bench/memory's `{model}` "
             f"model, memory.offload=optimizer, fp32, CPU device, {STEPS} steps per setting, each in its own "
             f"process; torch {torch.__version__}; {machine_info(torch.device('cpu'))['cpu_model']}, "
             f"{os.cpu_count()} cores.", "",
             "Bytes per parameter, measured (estimate of m6.memory.estimate in brackets):", "",
             "| setting | params | master weights | gradients | optimizer state | update temporaries (RSS peak) | total |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['setting']} | not run: {' '.join(r['failed'])} | | | | | |")
            continue
        n, m, e = r["num_params"], r["measured_bytes"], r["estimated_bytes"]
        cells = [f"{m[k] / n:.2f} [{e[k] / n:.2f}]" for k in m]
        lines.append(f"| {r['setting']} | {n / 1e6:.1f}M | " + " | ".join(cells)
                     + f" | {sum(m.values()) / n:.2f} [{sum(e.values()) / n:.2f}] |")
    result = {"command": f"python -m bench.host_bytes{' --quick' if args.quick else ''}", "model": MODEL[model],
              "machine": machine_info(torch.device("cpu")), "results": results}
    write_results(args.out, f"host_bytes-{machine_tag(torch.device('cpu'))}" + ("-quick" if args.quick else ""),
                  result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
