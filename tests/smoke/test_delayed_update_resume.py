"""train.py end to end with the delayed parameter update (optim.delayed_update): the banner says
so, and a run stopped at step 4 (its last update still in flight at the save) and resumed gives the
uninterrupted run's losses bitwise (CPU, fp32)."""

from __future__ import annotations

import json
from pathlib import Path

import train as train_entry

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")
ARGS = ["--config", TINY, "model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64",
        "model.max_text_len=48", "model.moe.every=1", "model.moe.num_experts=4", "data.kind=synthetic",
        "data.sources=[]", "data.num_workers=0", "data.seq_len=48", "data.num_samples=256", "data.eval_samples=0",
        "train.global_batch_size=4", "train.precision=fp32", "train.device=cpu", "train.eval_every=0",
        "optim.schedule=constant", "optim.warmup_steps=2", "logging.every=1", "checkpoint.every=0",
        "memory.offload=optimizer", "memory.host_optimizer=torch", "optim.delayed_update=true",
        "optim.delayed_update_after=2"]


def losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def test_resume_with_the_delayed_update_continues_bitwise(tmp_path, capsys):
    assert train_entry.main([*ARGS, f"run.dir={tmp_path / 'straight'}", "train.max_steps=8"]) == 0
    out = capsys.readouterr().out
    assert "delayed update from step 3 (" in out
    run = tmp_path / "stopped"
    assert train_entry.main([*ARGS, f"run.dir={run}", "train.max_steps=4"]) == 0
    assert train_entry.main([*ARGS, f"run.dir={run}", "train.max_steps=8"]) == 0
    assert "resumed from" in capsys.readouterr().out
    want = losses(tmp_path / "straight")
    assert [s for s, _ in want] == list(range(1, 9))
    assert losses(run) == want
