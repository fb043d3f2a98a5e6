"""Pipeline parallel on real gloo processes: pp 2 (each schedule), pp 4 (1f1b) and pp 2 x ep 2 at
world 4 train with the single-process losses and gradient norms (dropless, fp32) over 10 steps."""

from __future__ import annotations

import pytest
from dist_helpers import train_ranks
from test_train_world_sizes import SMALL, TINY, assert_same_curve, train_rows

# 4 blocks, every second one MoE (stages of dense and MoE blocks alike); 4 micro-batches of 2 per
# step at world 1 (global batch 8), the pipeline's micro-batches. The caption eval and the tied
# head are not built with pipelining (refused by config.check_pipeline).
COMMON = ["train.max_steps=10", "model.moe.every=2", "model.num_layers=4", "train.micro_batch_size=2",
          "data.eval_samples=0", "model.tie_embeddings=false", "checkpoint.enabled=false"]


def run(run_dir, nproc: int, *overrides: str) -> list[dict]:
    """The metrics rows of a run; rank 0's console output in ``run.stdout``."""
    results = train_ranks(nproc, ["--config", TINY, *SMALL, *COMMON, f"run.dir={run_dir}", *overrides])
    for rank, r in enumerate(results):
        assert r.code == 0, f"rank {rank} exited {r.code}: {r.stderr[-3000:]}"
    run.stdout = results[0].stdout
    return train_rows(run_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("w1"), 1)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zero_bubble"])
def test_pp2_trains_like_one_process(tmp_path, reference, schedule):
    rows = run(tmp_path, 2, "parallel.pipeline_parallel_size=2", f"parallel.pipeline_schedule={schedule}")
    assert "parallel world 2 = pipeline-parallel 2" in run.stdout
    assert_same_curve(rows, reference)
