"""A run whose data gives no target token stops with a named error (exit 2) after a bounded number
of steps, instead of "training" to the end on empty batches with loss 0 and exit 0."""

from __future__ import annotations

from pathlib import Path

import pytest

import train as train_entry
from m6.train.no_target_steps import MAX_EMPTY_STEPS, NoTargetSteps, NoTrainingTargets

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


def test_consecutive_empty_steps_stop_at_the_limit_and_a_step_with_targets_resets_the_count():
    guard = NoTargetSteps(lambda: {"too_long": 12, "corrupt_image": 1}, seq_len=32, max_steps=100, limit=3)
    for step, targets in enumerate([0, 0, 5, 0, 0], start=1):
        guard.check(targets, step)
    with pytest.raises(NoTrainingTargets, match=r"steps 4-6 had no target token.*too_long: 12, corrupt_image: 1.*"
                                                 r"data.seq_len=32"):
        guard.check(0, 6)


def test_a_run_shorter_than_the_limit_with_no_target_at_all_is_still_stopped():
    guard = NoTargetSteps(lambda: {}, seq_len=32, max_steps=2)
    guard.check(0, 1)
    with pytest.raises(NoTrainingTargets, match="no record was skipped"):
        guard.check(0, 2)


def test_a_corpus_whose_every_record_is_too_long_exits_2_naming_the_reason(tmp_path, capsys):
    corpus = tmp_path / "long.txt"
    corpus.write_text("".join(f"document {i} " + "word " * 60 + "\n" for i in range(64)))
    code = train_entry.main([
        "--config", TINY, f"run.dir={tmp_path / 'run'}", "data.kind=files",
        f"data.sources=[{{path: '{corpus}', format: text}}]", "data.tasks={denoise: 1.0}",
        "data.eval_samples=0", "data.num_workers=0", "data.seq_len=32", "model.max_text_len=32",
        "model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.ffn_dim=64",
        "model.moe.num_experts=4", "train.global_batch_size=4", "train.max_steps=50", "train.eval_every=0",
        "checkpoint.enabled=false", "logging.console=false"])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert f"steps 1-{MAX_EMPTY_STEPS} had no target token" in err, err
    assert f"too_long: {4 * MAX_EMPTY_STEPS}" in err and "data.seq_len=32" in err, err
