"""bench/gpu_suite.py runs end to end on the CPU at tiny shapes (--smoke) and writes what it promises;
a part that overruns its limit is killed and recorded while the next one still runs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

from bench.gpu_parts import PARTS
from bench.gpu_suite import run_part

ROOT = Path(__file__).resolve().parents[2]


def test_suite_smoke_on_cpu_writes_every_part(tmp_path):
    """Over 30 s on a shared 2-core machine (41 s in a full-suite run, ~2 min under a load average of 10): the
    suite runs each of its nine parts in a process of its own, as on the GPU, so each pays a Python
    and torch start; running them in one process would no longer test the isolation the suite
    relies on (a part that crashes or overruns leaves the others their results)."""
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_suite", "--out", str(tmp_path), "--device", "cpu", "--smoke"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    suite = json.loads((tmp_path / "suite.json").read_text())
    assert [p["part"] for p in suite["parts"]] == list(PARTS)
    assert all(p["status"] == "ok" for p in suite["parts"]), suite["parts"]
    md = (tmp_path / "suite.md").read_text()
    for part in PARTS:
        record = json.loads((tmp_path / f"{part}.json").read_text())
        assert record["device_info"]["torch"] and record["device_info"]["device"] == "cpu"
        assert record["smoke"] and f"## {part}: ok" in md
    tests = json.loads((tmp_path / "tests.json").read_text())["result"]
    assert tests["returncode"] == 0 and tests["passed"] >= 2 and tests["failures"] == 0
    gemm = json.loads((tmp_path / "gemm_rate.json").read_text())["result"]
    assert gemm["tflops_median"] > 0
    moe = json.loads((tmp_path / "moe_layer.json").read_text())["result"]["rows"]
    assert set(moe[0]["impls"]) == {"m6_capacity", "m6_dropless", "deepspeed", "dense"}
    kernels = json.loads((tmp_path / "moe_kernels.json").read_text())["result"]["rows"]
    assert {"m6_loop", "m6_grouped_mm", "m6_fused", "hf_grouped_mm", "dense"} <= set(kernels[0]["impls"])
    assert not kernels[0]["errors"]
    assert kernels[0]["impls"]["m6_fused"]["expert_kernel_ran"] == "fused"
    assert max(kernels[0]["rel_err_fused_vs_grouped_mm"].values()) < 1e-5  # fp32 through Triton's interpreter
    train = json.loads((tmp_path / "train_e2e.json").read_text())["result"]
    (run,) = train["runs"]
    assert run["timed_steps"] == 2 and run["tokens_per_s_median"] > 0, run
    # The step breakdown charges the step's host time to its categories (CPU: leaf ops' self time).
    charged = sum(run["ms_per_step"].values())
    assert 0.3 * run["wall_ms_per_step"] < charged <= 1.05 * run["wall_ms_per_step"], run
    assert run["ms_per_step"]["expert GEMMs"] > 0 and run["ms_per_step"]["attention"] > 0
    if importlib.util.find_spec("transformers") is not None:
        (peer,) = train["peers"]
        assert peer["tokens_per_s"] > 0 and peer["experts_implementation"], peer
    memory = json.loads((tmp_path / "memory.json").read_text())["result"]["variants"]
    plain = memory["plain (bf16 autocast)"]["model_state_device_side_peak_bytes_per_param"]
    assert 16.0 <= plain < 16.01  # fp32 params + grads + two AdamW moments (+ step counts), nothing offloaded
    assert memory["offload=optimizer"]["model_state_device_side_peak_bytes_per_param"] < plain / 2


def test_a_part_over_its_limit_is_killed_and_the_next_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    args = Namespace(device="cpu", smoke=True)
    slow = run_part("train_e2e", args, tmp_path, limit_s=1.0)
    assert slow["status"] == "timeout" and "log_tail" in slow and not (tmp_path / "train_e2e.json").exists()
    fast = run_part("gemm_rate", args, tmp_path, limit_s=120)
    assert fast["status"] == "ok" and fast["markdown"]


def test_train_e2e_variants_run_when_asked(tmp_path):
    """The per-step weight copy and the 152k vocabulary rows of train_e2e (smoke shapes on the CPU):
    named by --only, each runs with its overrides beside nothing else. ~26 s on a shared 2-core
    machine: two runs, each a process of its own (as on the GPU) paying a Python and torch start."""
    only = "m6-gpu-2b-mb32x1-per_step,m6-gpu-2b-mb8x1-v152k"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_parts", "train_e2e", "--out", str(tmp_path), "--device", "cpu",
                           "--smoke", "--only", only], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train = json.loads((tmp_path / "train_e2e.json").read_text())["result"]
    runs = {r["run"]: r for r in train["runs"]}
    assert set(runs) == set(only.split(",")) and train["peers"] == [], runs
    for run in runs.values():
        assert "error" not in run and run["tokens_per_s_median"] > 0, run
    assert "train.weight_copy=per_step" in runs["m6-gpu-2b-mb32x1-per_step"]["overrides"]
    assert "model.vocab_size=151936" in runs["m6-gpu-2b-mb8x1-v152k"]["overrides"]
