"""What the saved-tensor meter costs a training forward with recompute on (m6 issue #26, item 11).

    python -m bench.recompute_meter            # configs/tiny.yaml, CPU, pinned threads (~1 min)
    python -m bench.recompute_meter --quick    # a harness check in seconds, not a measurement

With memory.activation_checkpointing=full, the trainer metered every micro-batch's forward with
saved-tensor hooks (m6.memory.activation_meter: host work on every tensor the forward saves) to
report activation_saved_mb; it now meters only the steps whose metrics are logged. This times the
two forwards the trainer runs, in one process, round-robin (bench.harness.time_round_robin):

- ``metered``: ``trainer.activations.micro_batch(n, measure=True)`` around ``forward_loss`` (what
  every micro-batch paid before, and a logging step pays now);
- ``unmetered``: ``measure=False`` (every other step now).

A real Trainer on configs/tiny.yaml (fp32 on the CPU, its plan made by one training step), one real
micro-batch of the sample corpus at each size; forward only (the meter's hooks run in forward), the
graph dropped after each call. On CPU the process re-executes itself with pinned threads
(OMP_PROC_BIND=close OMP_PLACES=cores, OMP_NUM_THREADS=1 unless set).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from bench.harness import machine_info, machine_tag, time_round_robin, write_results

PIN_ENV = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
COMMON = ["data.num_workers=0", "data.eval_samples=0", "train.eval_every=0", "checkpoint.every=0",
          "logging.console=false", "logging.wandb.enabled=false", "train.precision=fp32",
          "memory.activation_checkpointing=full"]


def measure(micro_batch: int, device: torch.device, rounds: int, max_rounds: int, quick: bool) -> dict:
    from m6 import Trainer, load_config
    from m6.memory.activation_meter import SavedActivationMeter

    overrides = [*COMMON, f"train.device={device.type}", f"train.global_batch_size={micro_batch}"]
    if quick:
        overrides += ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64"]
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(load_config("configs/tiny.yaml", [*overrides, f"run.dir={tmp}/run"]))
        trainer.train_step()  # the recompute plan
        batch = trainer.loader.next_step()[0][0].batch.to(device)

        cpu_s: dict[bool, list[float]] = {True: [], False: []}  # this thread's CPU time per call

        def forward(metered: bool):
            def run() -> None:
                c0 = time.thread_time()
                with trainer.activations.micro_batch(batch.num_target_tokens, measure=metered):
                    out = trainer.forward_loss(batch)
                del out
                cpu_s[metered].append(time.thread_time() - c0)
            return run

        saved = []
        pack = SavedActivationMeter._pack
        SavedActivationMeter._pack = lambda self, t: saved.append(1) or pack(self, t)
        try:
            forward(True)()
        finally:
            SavedActivationMeter._pack = pack
        cpu_s[True].clear()  # the call that counted the saved tensors
        timings = time_round_robin({"metered": forward(True), "unmetered": forward(False)}, device,
                                   min_rounds=rounds, max_rounds=max_rounds)
        timed_cpu = {m: v[2:] for m, v in cpu_s.items()}  # after the harness's two warm-up calls each
    metered, unmetered = timings.median("metered"), timings.median("unmetered")
    ratio = timings.paired_ratio("metered", "unmetered")
    return {"micro_batch": micro_batch, "saved_tensors_metered": len(saved),
            "metered_ms": {"median": metered * 1e3, "spread": [s * 1e3 for s in timings.spread("metered")]},
            "unmetered_ms": {"median": unmetered * 1e3, "spread": [s * 1e3 for s in timings.spread("unmetered")]},
            "metered_over_unmetered": {"median": ratio[0], "min": ratio[1], "max": ratio[2]},
            "thread_cpu_ms": {"metered": statistics.median(timed_cpu[True]) * 1e3,
                              "unmetered": statistics.median(timed_cpu[False]) * 1e3},
            "us_per_saved_tensor": (metered - unmetered) / len(saved) * 1e6,
            "rounds_kept": timings.rounds_kept, "rounds_dropped": timings.rounds_dropped}


def render(result: dict) -> str:
    lines = [f"# Saved-tensor meter cost: training forward with full recompute ({result['command']})", "",
             f"configs/tiny.yaml, fp32, {result['device']}; {result['machine']['cpu_model']}, "
             f"{result['machine']['num_threads']} thread(s), env {result['machine']['env']}; torch {result['machine']['torch']}. "
             f"Load average (1 min) before/after: {result['load_1min']}.", "",
             "| micro-batch | saved tensors metered | metered forward ms (before: every micro-batch) | "
             "unmetered forward ms (after: non-logging steps) | metered / unmetered (paired) | us per saved tensor | "
             "thread CPU ms, metered / unmetered | rounds kept (dropped) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['micro_batch']} | {r['saved_tensors_metered']} | {r['metered_ms']['median']:.2f} "
                     f"({r['metered_ms']['spread'][0]:.2f}-{r['metered_ms']['spread'][1]:.2f}) | "
                     f"{r['unmetered_ms']['median']:.2f} ({r['unmetered_ms']['spread'][0]:.2f}-"
                     f"{r['unmetered_ms']['spread'][1]:.2f}) | {r['metered_over_unmetered']['median']:.3f} "
                     f"({r['metered_over_unmetered']['min']:.3f}-{r['metered_over_unmetered']['max']:.3f}) | "
                     f"{r['us_per_saved_tensor']:.1f} | {r['thread_cpu_ms']['metered']:.2f} / "
                     f"{r['thread_cpu_ms']['unmetered']:.2f} | {r['rounds_kept']} ({r['rounds_dropped']}) |")
    lines += ["", "Wall-clock medians over the kept rounds (min-max in brackets), the paired ratio per round, and "
                  "the median CPU time of the calling thread over every timed call; a round is dropped when the "
                  "process got less than 75% of a core."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smaller model: a harness check, not a measurement")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[2, 32])
    p.add_argument("--rounds", type=int, default=30, help="clean rounds to keep")
    p.add_argument("--max-rounds", type=int, default=60)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    if any(os.environ.get(k) != v for k, v in PIN_ENV.items()):
        env = dict(os.environ, **PIN_ENV)
        env.setdefault("OMP_NUM_THREADS", "1")
        os.execve(sys.executable, [sys.executable, "-m", "bench.recompute_meter", *(argv or sys.argv[1:])], env)
    device = torch.device("cpu")
    started, loads = time.time(), [os.getloadavg()[0]]
    rows = [measure(n, device, args.rounds, args.max_rounds, args.quick) for n in args.micro_batches]
    loads.append(os.getloadavg()[0])
    command = " ".join(["python -m bench.recompute_meter", *(argv if argv is not None else sys.argv[1:])])
    result = {"benchmark": "recompute_meter", "command": command, "device": device.type,
              "machine": machine_info(device), "load_1min": [round(x, 2) for x in loads], "rows": rows,
              "wall_s": round(time.time() - started, 1)}
    stem = f"recompute_meter-{machine_tag(device)}" + ("-quick" if args.quick else "")
    write_results(args.out, stem, result, render(result))


if __name__ == "__main__":
    main()
