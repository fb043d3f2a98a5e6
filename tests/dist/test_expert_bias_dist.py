"""Aux-loss-free balancing on gloo: the expert bias follows the same trajectory at world
1, 2 and 4, EP 1 and 2, with accumulation, and after a resume that reshards to another layout."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import run_distributed
from test_train_world_sizes import assert_same_curve, ranks, single, train_rows

from m6.moe import MoELayer
from m6.train.expert_bias import ExpertBiasUpdate

# Capacity on (cf 1.25 drops assignments), aux-free only (no balance loss), a rate large enough to
# change routing within a few steps.
AUX_FREE = ["model.moe.expert_bias_update_rate=0.02", "model.moe.aux_loss_coef=0", "model.moe.capacity_factor=1.25",
            "train.max_steps=6", "checkpoint.every=3"]


def biases(rows: list[dict]) -> list[dict]:
    return [r["expert_bias"] for r in rows]


def _update_from_global_counts(rank: int, world_size: int) -> None:
    """Each rank routes its own tokens (rank r: every token to expert r, 1 + r tokens per micro-batch,
    two micro-batches); the update must follow the global counts, where rank 0 alone is the
    least loaded expert but locally the only one used."""
    torch.manual_seed(0)
    layer = MoELayer(4, 8, 4, top_k=1, capacity_factor=None, expert_bias_update_rate=0.1, init_seed=0)
    with torch.no_grad():
        layer.router.weight.copy_(10 * torch.eye(4))
    update = ExpertBiasUpdate({"block0": layer}, torch.distributed.group.WORLD, torch.device("cpu"))
    for _ in range(2):
        layer(torch.eye(4)[rank].expand(1 + rank, 4))
        update.add_micro_batch()
    update.step(apply=True)
    counts = torch.tensor([2.0 * (1 + r) if r < world_size else 0.0 for r in range(4)])
    expected = 0.1 * torch.sign(counts.mean() - counts)
    assert layer.expert_bias.tolist() == pytest.approx(expected.tolist()), (rank, layer.expert_bias)


def test_update_sums_micro_batches_and_ranks():
    run_distributed(_update_from_global_counts, 4, timeout_s=60)


def test_bias_trajectory_is_world_size_and_layout_invariant(tmp_path):
    # World 1 accumulates 2 micro-batches of 4; world 2 (EP 1) one of 4 per rank; world 4 (EP 2,
    # resumed from world 2's step-3 checkpoint) one of 2 per rank.
    single(tmp_path / "w1", *AUX_FREE, "train.micro_batch_size=4")
    ranks(tmp_path / "w2", 2, *AUX_FREE, "parallel.expert_parallel_size=1")
    run4 = tmp_path / "w4"
    run4.mkdir()
    ranks(run4, 4, *AUX_FREE, "parallel.expert_parallel_size=2",
             f"checkpoint.resume={tmp_path / 'w2' / 'checkpoints' / 'step_00000003'}")
    w1, w2, w4 = (train_rows(tmp_path / name) for name in ("w1", "w2", "w4"))

    assert [r["step"] for r in w4] == [4, 5, 6]
    assert biases(w2) == biases(w1)
    assert biases(w4) == biases(w1)[3:]
    # Accumulation forms the z-loss per micro-batch (a mean of means): compare the LM loss there.
    assert [r["lm_loss"] for r in w2] == pytest.approx([r["lm_loss"] for r in w1], rel=1e-5)
    assert_same_curve(w4, w2[3:])
    # Each step's move is the rate toward the mean of that step's global counts (logged as
    # expert_tokens where nothing accumulates: summed over ranks, the whole step).
    rate = 0.02
    for rows in (w2, w4):
        for before, row in zip(rows, rows[1:]):
            for layer, counts in row["expert_tokens"].items():
                counts = torch.tensor(counts, dtype=torch.float64)
                move = torch.tensor(row["expert_bias"][layer]) - torch.tensor(before["expert_bias"][layer])
                assert move.tolist() == pytest.approx((rate * torch.sign(counts.mean() - counts)).tolist(), abs=1e-6)
    # The bias moved and reached the logged scalar.
    last = w1[-1]
    assert set(last["expert_bias"]) == {"block0", "block1"}
    for layer, values in last["expert_bias"].items():
        assert max(abs(v) for v in values) == last[f"moe/{layer}/expert_bias_max_abs"] > 0
        assert all(abs(v / rate - round(v / rate)) < 1e-4 and abs(v) <= 6 * rate + 1e-6 for v in values)
