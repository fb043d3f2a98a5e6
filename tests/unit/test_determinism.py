"""train.deterministic: torch's deterministic algorithms are on while the run trains (and restored
after), cuBLAS gets its fixed workspace before the first matmul, and on the CPU, where m6 is
bitwise reproducible anyway, the losses are the same as without it."""

from __future__ import annotations

import os

import pytest
import torch

from m6.config import ConfigError, load
from m6.train.loop import Trainer

SHORT = ["data.num_workers=0", "train.max_steps=2", "train.global_batch_size=4", "train.eval_every=0",
         "data.eval_samples=4", "train.eval_batches=1", "checkpoint.every=0", "logging.every=1"]


def _fit(tmp_path, name: str, deterministic: bool) -> tuple[list[float], list[bool]]:
    cfg = load("configs/tiny.yaml", SHORT + [f"run.dir={tmp_path / name}", f"train.deterministic={deterministic}"])
    trainer = Trainer(cfg)
    seen: list[bool] = []
    trainer.model.register_forward_pre_hook(lambda *_: seen.append(torch.are_deterministic_algorithms_enabled()))
    history = trainer.fit()
    return [h["loss"] for h in history], seen


def test_deterministic_algorithms_while_training_and_the_same_losses_on_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    plain, seen_plain = _fit(tmp_path, "plain", False)
    strict, seen_strict = _fit(tmp_path, "strict", True)
    assert seen_strict and all(seen_strict) and not any(seen_plain)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert not torch.are_deterministic_algorithms_enabled()  # restored after fit
    assert strict == plain  # bitwise: the CPU path already was deterministic


def test_the_key_takes_a_boolean_only():
    with pytest.raises(ConfigError, match="train.deterministic"):
        load("configs/tiny.yaml", ["train.deterministic=sometimes"])
