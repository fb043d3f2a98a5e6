"""Uneven experts per rank on gloo: with parallel.balance as weights at EP 2 each rank
holds a contiguous range of experts sized by its weight; the same global batch trains the even
run's curve, and checkpoints reshard between even and uneven layouts and other world sizes."""

from __future__ import annotations

from dist_helpers import train_ranks
from test_balance_dist import assert_same_curve
from test_train_world_sizes import SMALL, TINY, ranks, single, train_rows

# 8 experts: [2, 1] lays them out 5 + 3, [3, 1] 6 + 2 (m6.parallel.expert_ranges' rounding).
EP2 = ["model.moe.num_experts=8", "parallel.expert_parallel_size=2", "checkpoint.every=2", "checkpoint.keep=8"]


def ckpt(run_dir, step: int):
    return run_dir / "checkpoints" / f"step_{step:08d}"


def test_uneven_experts_train_the_even_curve_and_reshard(tmp_path):
    ranks(tmp_path / "even", 2, *EP2, "train.max_steps=8")
    even = train_rows(tmp_path / "even")
    assert len(even) == 8

    # [2, 1] straight through: 5 + 3 samples, experts 0-4 and 5-7; every loss term and the grad norm.
    stdout = ranks(tmp_path / "w21", 2, *EP2, "train.max_steps=8", "parallel.balance=[2,1]")
    assert ("rank 0 cpu (1 thread): 5 samples, experts 0-4; rank 1 cpu (1 thread): 3 samples, experts 5-7"
            in stdout), stdout
    assert_same_curve(train_rows(tmp_path / "w21"), even)

    # even -> [3, 1] (6 + 2 experts) from step 2 to 6 -> even again to step 8: the straight curve.
    stdout = ranks(tmp_path / "w31", 2, *EP2, "train.max_steps=6", "parallel.balance=[3,1]",
                   f"checkpoint.resume={ckpt(tmp_path / 'even', 2)}")
    assert "6 samples, experts 0-5; rank 1 cpu (1 thread): 2 samples, experts 6-7" in stdout, stdout
    assert_same_curve(train_rows(tmp_path / "w31"), even[2:6])
    ranks(tmp_path / "back", 2, *EP2, "train.max_steps=8", f"checkpoint.resume={ckpt(tmp_path / 'w31', 6)}")
    assert_same_curve(train_rows(tmp_path / "back"), even[6:8])

    # World 4 at EP 2: ranks 0 and 2 hold experts 0-4, ranks 1 and 3 experts 5-7, their gradients summed
    # over each pair. 0.03 MB buckets lie between the pairs' expert tensors (40 and 24 KB; 32 KB even), so cut by
    # their own bytes the pairs would close them at different parameters (the ranks' bucket check then fails).
    stdout = ranks(tmp_path / "w4", 4, *EP2, "train.max_steps=4", "checkpoint.every=0", "parallel.bucket_size_mb=0.03",
                   "parallel.balance=[2,1,2,1]")
    assert "rank 2 cpu (1 thread): 2 samples, experts 0-4; rank 3 cpu (1 thread): 2 samples, experts 5-7" \
        in stdout, stdout
    assert_same_curve(train_rows(tmp_path / "w4"), even[:4])

    # The uneven layout's checkpoint read by one process holding every expert.
    single(tmp_path / "one", "model.moe.num_experts=8", "train.max_steps=8",
           f"checkpoint.resume={ckpt(tmp_path / 'w21', 4)}")
    assert_same_curve(train_rows(tmp_path / "one"), even[4:8])


def test_impossible_uneven_layouts_are_config_errors(tmp_path):
    """One expert cannot be split over two expert-parallel ranks, and the chunked all-to-all needs
    the same experts on every rank: exit code 2 on every rank, the keys named, no traceback."""
    base = ["--config", TINY, *SMALL, "parallel.expert_parallel_size=2", "parallel.balance=[2,1]"]
    cases = {
        "one_expert": (["model.moe.num_experts=1", "model.moe.top_k=1"],
                       "parallel.balance=[2.0, 1.0] at parallel.expert_parallel_size=2: model.moe.num_experts (1) is "
                       "smaller than parallel.expert_parallel_size (2)"),
        "overlap": (["model.moe.a2a_overlap_degree=2"],
                    "model.moe.a2a_overlap_degree=2 with uneven experts per rank"),
    }
    for name, (extra, message) in cases.items():
        for rank, result in enumerate(train_ranks(2, [*base, f"run.dir={tmp_path / name}", *extra])):
            assert result.code == 2 and message in result.stderr, (name, rank, result.stderr[-3000:])
            assert "Traceback" not in result.stdout + result.stderr
