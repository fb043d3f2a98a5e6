"""A run.dir that the nodes do not share, with real gloo ranks: the same run.dir value (a relative
path) resolves to a different directory on each rank (each rank starts in its own working
directory, as each node would see its own local disk). The first save must stop every rank with
exit 2 and one line naming run.dir, before any "saved" line, and leave no checkpoint that looks
complete. Before: the save printed "saved" and exited 0 while rank 1's shard sat in its own
directory, so the checkpoint could never be loaded."""

from __future__ import annotations

import io
import os
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from dist_helpers import REPO, run_distributed

from m6.train.cli import main as train_main

SMALL = [
    "model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=48",
    "model.image_size=16", "model.moe.every=1", "model.moe.num_experts=4", "data.kind=synthetic", "data.sources=[]",
    "data.num_workers=0", "data.num_samples=64", "data.eval_samples=0", "data.seq_len=48",
    "train.global_batch_size=4", "train.eval_every=0", "train.precision=fp32", "train.device=cpu",
    "train.max_steps=1", "logging.console=false", "parallel.expert_parallel_size=2", "run.dir=run",
]


def _unshared(rank: int, world: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    node = Path(root, f"node{rank}")  # this rank's view: one node each
    node.mkdir()
    os.chdir(node)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = train_main(["--config", str(REPO / "configs" / "tiny.yaml"), *SMALL])
    (node / "result.txt").write_text(f"{code}\n{out.getvalue()}\n---\n{err.getvalue()}")


def test_a_run_dir_the_nodes_do_not_share_stops_the_first_save(tmp_path):
    run_distributed(_unshared, 2, str(tmp_path), timeout_s=120)
    for rank in (0, 1):
        code, rest = (tmp_path / f"node{rank}" / "result.txt").read_text().split("\n", 1)
        out, err = rest.split("\n---\n")
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == "2" and len(lines) == 1 and "Traceback" not in err, (rank, code, err)
        line = lines[0]
        assert line.startswith(f"rank {rank}: error: checkpoint of step 1 not saved: rank 1 (host "), line
        assert "wrote __1_0.distcp into run/checkpoints/.tmp-step_00000001, but rank 0 (host " in line, line
        assert "does not see it there" in line and "run.dir (run) is not on a filesystem every node shares" in line
        assert "saved to" not in out, out
        checkpoints = tmp_path / f"node{rank}" / "run" / "checkpoints"
        assert sorted(p.name for p in checkpoints.iterdir()) == []  # nothing that looks like a checkpoint
