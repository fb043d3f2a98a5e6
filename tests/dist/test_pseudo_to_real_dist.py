"""Pseudo-to-real on gloo: a shared-block model (model.share_layers) with its experts
split over 2 ranks trains the curve of world size 1, and its delinked checkpoint resumes at EP 2."""

from __future__ import annotations

from test_train_world_sizes import assert_same_curve, ranks, single, train_rows

from m6.checkpoint.__main__ import main as checkpoint_cli

SHARED = ["model.num_layers=4", "model.share_layers=2", "train.max_steps=4", "checkpoint.every=2"]


def test_shared_blocks_with_expert_parallelism_and_delinked_resume(tmp_path):
    single(tmp_path / "w1", *SHARED)
    ranks(tmp_path / "ep2", 2, *SHARED, "parallel.expert_parallel_size=2")
    assert_same_curve(train_rows(tmp_path / "ep2"), train_rows(tmp_path / "w1"))

    # Delink the 2-rank checkpoint of step 2; resume the real model at EP 2: its step 3 is the
    # shared model's step 3.
    assert checkpoint_cli(["delink", str(tmp_path / "ep2" / "checkpoints" / "step_00000002"), str(tmp_path / "real")]) == 0
    ranks(tmp_path / "real", 2, *SHARED, "model.share_layers=1", "parallel.expert_parallel_size=2")
    real = train_rows(tmp_path / "real")
    assert [r["step"] for r in real] == [3, 4]
    shared = train_rows(tmp_path / "w1")
    assert abs(real[0]["lm_loss"] - shared[2]["lm_loss"]) <= 1e-6 * shared[2]["lm_loss"]
