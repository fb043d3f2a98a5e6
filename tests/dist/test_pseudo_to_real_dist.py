"""Pseudo-to-real on gloo: a shared-block model (model.share_layers) with its experts
split over 2 ranks trains the curve of world size 1, its delinked checkpoint resumes at EP 2, and
the in-run delink (each rank its share of the tensors) writes the offline delink's checkpoint and
continues its curve."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from test_train_world_sizes import assert_same_curve, ranks, single, train_rows

from m6.checkpoint.__main__ import main as checkpoint_cli
from m6.checkpoint.reader import read_checkpoint
from m6.checkpoint.state_tree import flatten

SHARED = ["model.num_layers=4", "model.share_layers=2", "train.max_steps=4", "checkpoint.every=2"]


def test_shared_blocks_with_expert_parallelism_and_delinked_resume(tmp_path):
    """One 1-rank and three 2-rank launches of 2-4 steps and one 2-rank delink: each part needs the
    checkpoints of the one before, so they share one test (over 30 s on a loaded 2-core machine)."""
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

    # The in-run delink at the same step: steps 1-2 of the shared run, then the delinked run's 3-4.
    ranks(tmp_path / "in_run", 2, *SHARED, "parallel.expert_parallel_size=2", "train.delink_at_step=2")
    assert_same_curve(train_rows(tmp_path / "in_run"), train_rows(tmp_path / "ep2")[:2] + real)

    # delink_in_place itself: each rank reads and writes its share of the tensors, and together
    # they write the offline delink's checkpoint.
    shutil.copytree(tmp_path / "ep2", tmp_path / "in_place")
    run_distributed(_delink_in_place, 2, str(tmp_path / "in_place"), timeout_s=60)
    read = [json.loads((tmp_path / "in_place" / f"read{r}.json").read_text())["bytes"] for r in range(2)]
    step = "checkpoints/step_00000002"
    pseudo = flatten(read_checkpoint(tmp_path / "ep2" / step))
    whole = sum(t.nbytes for key, t in pseudo.items() if key.startswith(("model/", "optimizer/state/")))
    assert all(0 < n < 0.75 * whole for n in read), (read, whole)
    in_place = flatten(read_checkpoint(tmp_path / "in_place" / step))
    offline = flatten(read_checkpoint(tmp_path / "real" / step))
    assert in_place.keys() == offline.keys()
    for key, value in offline.items():
        same = torch.equal(in_place[key], value) if isinstance(value, torch.Tensor) else in_place[key] == value
        assert same, key


def _delink_in_place(rank: int, world: int, run_dir: str) -> None:
    from m6.checkpoint import CheckpointManager
    from m6.checkpoint.delink import delink_in_place

    manager = CheckpointManager(run_dir, keep=5, rank=rank, group=dist.group.WORLD)
    nbytes = delink_in_place(manager, 2)
    manager.close()
    Path(run_dir, f"read{rank}.json").write_text(json.dumps({"bytes": nbytes}))
