"""Continued pretraining from a Hugging Face model: a tiny Mixtral imported with ``import-hf`` starts
a run at expert-parallel size 2 over real gloo ranks (each rank its own experts of the imported
weights), trains 20 steps, and a run resumed from its step-10 checkpoint continues exactly.
About 15 s on 2 cores: the issue's 20 steps plus 10 resumed ones, on two ranks."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from dist_helpers import run_distributed

from m6.checkpoint import import_hf, read_checkpoint
from m6.config import load
from m6.train.loop import Trainer

pytest.importorskip("transformers")  # the `test` extra
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_hf_checkpoint import save_tiny_hf  # noqa: E402

TRAIN = ["data.kind=synthetic", "data.num_workers=0", "data.num_samples=256", "data.eval_samples=8",
         "data.seq_len=48", "train.global_batch_size=8", "train.micro_batch_size=2",
         "train.eval_every=0", "train.precision=fp32", "train.device=cpu", "logging.console=false",
         "checkpoint.async_save=false", "checkpoint.every=10", "parallel.expert_parallel_size=2"]


def _train_and_resume(rank: int, world: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    imported = Path(root) / "imported"
    config = imported / "config.yaml"
    trainer = Trainer(load(config, [*TRAIN, f"run.dir={root}/run", "train.max_steps=20"]))
    assert trainer.step == 0
    saved = read_checkpoint(imported / "checkpoints" / "step_00000000")["model"]
    for name, t in trainer.model.state_dict().items():
        if name.startswith("patch_embed."):
            continue
        if name in trainer.sharded.expert_params:
            first = trainer.sharded.first_expert(name)
            assert t.shape[0] == 2 and torch.equal(t, saved[name][first:first + 2]), (rank, name)
        else:
            assert torch.equal(t, saved[name]), (rank, name)
    losses = [h["loss"] for h in trainer.fit()]
    assert len(losses) == 20 and losses[-1] < losses[0], losses

    resumed = Trainer(load(config, [*TRAIN, f"run.dir={root}/resumed", "train.max_steps=20",
                                    f"checkpoint.resume={root}/run/checkpoints/step_00000010"]))
    assert resumed.step == 10
    assert [h["loss"] for h in resumed.fit()] == losses[10:]


def test_imported_model_trains_at_ep2_and_resumes_exactly(tmp_path):
    save_tiny_hf("mixtral", tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "imported", log=lambda _: None)
    run_distributed(_train_and_resume, 2, str(tmp_path))
