"""A Trainer that is dropped frees its model (Python API: several runs in one process, notebooks).
The gradient sync's hooks live on the parameters; holding the sync strongly from them closed a
cycle through autograd's C++ side that gc cannot collect."""

from __future__ import annotations

import gc
import weakref

from m6.config import load
from m6.train.loop import Trainer

TINY = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=32",
        "model.image_size=16", "model.patch_size=8", "model.moe.every=2", "model.moe.num_experts=4",
        "data.kind=synthetic", "data.num_samples=16", "data.eval_samples=0", "data.seq_len=24", "data.num_workers=0",
        "train.global_batch_size=4", "train.max_steps=1", "train.eval_every=0", "logging.console=false",
        "checkpoint.every=0"]


def test_a_dropped_trainer_frees_its_model(tmp_path):
    trainer = Trainer(load(None, [*TINY, f"run.dir={tmp_path / 'run'}"]))
    trainer.train_step()
    model = weakref.ref(trainer.model)
    del trainer
    gc.collect()
    assert model() is None
