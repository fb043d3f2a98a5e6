"""checkpoint.enabled=false: a run writes no checkpoint, at its end or when SIGTERM stops it, and
says so; the delink of pseudo-to-real, which goes through a checkpoint, is refused."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from m6.config import ConfigError, load
from m6.train.loop import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_offload import SMALL  # noqa: E402


def test_a_run_with_checkpoints_off_writes_none_and_says_so(tmp_path, capsys):
    tr = Trainer(load(None, [*SMALL, "logging.console=true", "train.max_steps=3", f"run.dir={tmp_path}",
                             "checkpoint.enabled=false"]))
    tr.fit()
    out = capsys.readouterr().out
    assert "checkpoints OFF (checkpoint.enabled=false)" in out
    assert tr.step == 3 and tr.checkpoints.latest() is None
    assert not list(tmp_path.glob("checkpoints/step_*"))


def test_sigterm_with_checkpoints_off_stops_without_one(tmp_path, capsys):
    tr = Trainer(load(None, [*SMALL, "logging.console=true", "train.max_steps=6", f"run.dir={tmp_path}",
                             "checkpoint.enabled=false"]))
    step = tr.train_step

    def step_then_signal():
        metrics = step()
        if tr.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # recorded by the run's handler; the loop stops after this step
        return metrics

    tr.train_step = step_then_signal
    tr.fit()
    out = capsys.readouterr().out
    assert tr.step == 2 and tr.checkpoints.latest() is None
    assert "SIGTERM: stopped after step 2 of 6 without a checkpoint (checkpoint.enabled=false)" in out


def test_delink_needs_checkpoints():
    with pytest.raises(ConfigError, match="train.delink_at_step=2 with checkpoint.enabled=false"):
        load(None, ["model.share_layers=2", "model.num_layers=4", "train.delink_at_step=2", "train.max_steps=4",
                    "checkpoint.enabled=false"])
