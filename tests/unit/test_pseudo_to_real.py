"""Pseudo-to-real: blocks sharing weights (model.share_layers), the config's checks, and delinking a
checkpoint: the real model's forward equals the shared one's at the delink point, optimizer state
copied per block, the delinked run resumes deterministically."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from m6.checkpoint.__main__ import main as checkpoint_cli
from m6.checkpoint.reader import read_checkpoint
from m6.config import Config, ConfigError, load
from m6.model import M6Model
from m6.model.flops import count_parameters
from m6.model.shared_blocks import delinked_copies
from m6.train.loop import Trainer, train
from tests.smoke.test_train import SMALL, TINY

PSEUDO = ["model.num_layers=4", "model.share_layers=2", "model.moe.every=1", "logging.every=1", "train.eval_every=0",
          "checkpoint.every=3"]


def test_config_checks():
    with pytest.raises(ConfigError, match="needs model.share_layers > 1"):
        load(TINY, [*SMALL, "train.delink_at_step=2"])
    for overrides, message in (({"share_layers": 3}, "must divide model.num_layers"),
                               ({"share_layers": 0}, "integer >= 1"),
                               ({"share_layers": 2, "moe_every": 2}, "mix MoE and dense")):
        cfg = Config()
        cfg.model.num_layers = 4
        cfg.model.share_layers = overrides["share_layers"]
        cfg.model.moe.every = overrides.get("moe_every", 1)
        with pytest.raises(ConfigError, match=message):
            cfg.validate()
    with pytest.raises(ConfigError, match="memory.offload=optimizer\\+params"):
        load(TINY, [*SMALL, "model.share_layers=2", "memory.offload=optimizer+params"])


def test_shared_blocks_hold_one_set_of_weights():
    torch.manual_seed(0)
    cfg = load(TINY, [*SMALL, "model.num_layers=4", "model.share_layers=2", "model.moe.every=1"]).model
    pseudo = M6Model(cfg)
    real = M6Model(load(TINY, [*SMALL, "model.num_layers=4", "model.moe.every=1"]).model)
    names = [n for n, _ in pseudo.named_parameters()]
    assert not any(n.startswith(("blocks.1.", "blocks.3.")) for n in names)
    assert pseudo.blocks[1].attn is pseudo.blocks[0].attn and pseudo.blocks[3].ffn.experts is pseudo.blocks[2].ffn.experts
    assert pseudo.blocks[1].ffn is not pseudo.blocks[0].ffn  # own stats, own dispatcher
    per_block = sum(p.numel() for p in real.blocks[0].parameters())
    assert count_parameters(pseudo).total == count_parameters(real).total - 2 * per_block
    assert count_parameters(pseudo).expert * 2 == count_parameters(real).expert
    # Every real name is a pseudo name or a copy of one.
    real_names = set(real.state_dict())
    pseudo_names = list(dict.fromkeys(n for n, _ in pseudo.named_parameters()))
    assert set(pseudo_names) | set(delinked_copies(pseudo_names, 2, 4)) == real_names


def rows(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "loss" in r]


def test_delinked_checkpoint_continues_the_shared_model(tmp_path: Path, capsys: pytest.CaptureFixture):
    pseudo_dir, real_dir = tmp_path / "pseudo", tmp_path / "real"
    Trainer(load(TINY, [*SMALL, *PSEUDO, "train.max_steps=5", f"run.dir={pseudo_dir}"])).fit()
    step3 = pseudo_dir / "checkpoints" / "step_00000003"
    assert checkpoint_cli(["delink", str(step3), str(real_dir)]) == 0
    assert "step 3" in capsys.readouterr().out

    saved = read_checkpoint(real_dir / "checkpoints" / "step_00000003")
    assert saved["meta"]["config"]["model"]["share_layers"] == 1
    for leader, follower in ((0, 1), (2, 3)):
        for name, t in saved["model"].items():
            if name.startswith(f"blocks.{leader}.") and "expert_bias" not in name:
                assert torch.equal(saved["model"][name.replace(f"blocks.{leader}.", f"blocks.{follower}.", 1)], t)
        moments = saved["optimizer"]["state"]
        for name, state in moments.items():
            if name.startswith(f"blocks.{leader}."):
                copy = moments[name.replace(f"blocks.{leader}.", f"blocks.{follower}.", 1)]
                assert all(torch.equal(copy[k], v) for k, v in state.items()) and torch.any(state["exp_avg"] != 0)

    real = [*SMALL, *PSEUDO, "model.share_layers=1", "train.max_steps=5", f"run.dir={real_dir}"]
    Trainer(load(TINY, real)).fit()
    shared_rows, real_rows = rows(pseudo_dir), rows(real_dir)
    # Step 4's forward runs the delinked weights on step 4's data: the same loss as the shared model.
    assert real_rows[0]["step"] == 4 and real_rows[0]["lm_loss"] == shared_rows[3]["lm_loss"]
    assert real_rows[0]["loss"] == shared_rows[3]["loss"]
    # Delinked, each block's copy is updated from its own gradient: the runs part from step 5 on.
    assert real_rows[1]["step"] == 5
    # The delinked run resumes exactly: again from the same delinked checkpoint, the same steps.
    again = tmp_path / "again"
    shutil.copytree(real_dir, again)
    shutil.rmtree(again / "checkpoints" / "step_00000005")
    (again / "checkpoints" / "latest").unlink()
    (again / "metrics.jsonl").unlink()
    Trainer(load(TINY, [*real[:-1], f"run.dir={again}"])).fit()
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in rows(again)] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in real_rows]

    assert checkpoint_cli(["delink", str(real_dir), str(tmp_path / "twice")]) == 2
    assert "nothing to delink" in capsys.readouterr().err

    # train.delink_at_step=3 in one run: the shared run's steps 1-3, then the offline-delinked run's.
    in_run = tmp_path / "in_run"
    history = train(load(TINY, [*SMALL, *PSEUDO, "train.delink_at_step=3", "train.max_steps=5", f"run.dir={in_run}"]))
    assert "delinked the model.share_layers=2 blocks" in capsys.readouterr().out
    expected = [(r["step"], r["loss"], r["grad_norm"]) for r in shared_rows[:3] + real_rows]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in history] == expected
    assert [(r["step"], r["loss"]) for r in rows(in_run)] == [(step, loss) for step, loss, _ in expected]
    # Restarted after the delink: the real model resumes from the run's latest checkpoint.
    (in_run / "checkpoints" / "latest").unlink()
    shutil.rmtree(in_run / "checkpoints" / "step_00000005")
    again = train(load(TINY, [*SMALL, *PSEUDO, "train.delink_at_step=3", "train.max_steps=5", f"run.dir={in_run}"]))
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in again] == expected[3:]


def test_the_pseudo_trainer_is_freed_before_the_real_one_is_built(tmp_path: Path):
    """train.delink_at_step: the pseudo Trainer, its weights and its optimizer state are collected
    before the real Trainer exists (they held the device through the whole real run)."""
    import weakref

    from m6.train.pseudo_to_real import train_pseudo_to_real

    pseudo_refs: list[weakref.ref] = []
    alive_when_real_built: list[bool] = []

    def trainer_class(cfg: Config) -> Trainer:
        if pseudo_refs:
            alive_when_real_built.extend(ref() is not None for ref in pseudo_refs)
        trainer = Trainer(cfg)
        if not pseudo_refs:
            param = next(trainer.model.parameters())
            pseudo_refs.extend([weakref.ref(trainer), weakref.ref(param), weakref.ref(trainer.update.optimizer)])
        return trainer

    cfg = load(TINY, [*SMALL, *PSEUDO, "train.delink_at_step=1", "train.max_steps=2", "data.eval_samples=0",
                      "checkpoint.async_save=false", f"run.dir={tmp_path}"])
    history = train_pseudo_to_real(cfg, trainer_class)
    assert [r["step"] for r in history] == [1, 2]
    assert alive_when_real_built == [False, False, False]
