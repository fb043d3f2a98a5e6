"""A resume with another train.max_steps says that the learning-rate schedule changes with it."""

from __future__ import annotations

from pathlib import Path

from m6.config import load
from m6.train.loop import Trainer
from m6.train.optim import lr_at

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")
SMALL = [
    "model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.ffn_dim=64", "model.max_text_len=48",
    "model.moe.every=1", "model.moe.num_experts=4", "data.num_samples=64", "data.eval_samples=8",
    "train.global_batch_size=4", "train.eval_every=0", "train.eval_batches=1", "logging.console=false",
    "data.kind=synthetic", "data.sources=[]", "data.num_workers=0", "data.seq_len=48", "optim.warmup_steps=1",
]


def cfg(run_dir, *extra: str):
    return load(TINY, [*SMALL, f"run.dir={run_dir}", *extra])


def test_resume_with_another_max_steps_names_the_schedule_change(tmp_path, capsys):
    Trainer(cfg(tmp_path, "train.max_steps=3")).fit()
    capsys.readouterr()
    longer = Trainer(cfg(tmp_path, "train.max_steps=9"))
    out = capsys.readouterr().out
    longer.loader.close()
    optim = longer.cfg.optim
    expected = (f"train.max_steps changed from 3 (the checkpoint's run) to 9: the cosine schedule is recomputed "
                f"over 9 steps (stretched): the learning rate at step 3 is {lr_at(3, optim, 9):.3g} where the "
                f"saved run's schedule had {lr_at(3, optim, 3):.3g}")
    assert expected in out, out
    assert "To keep the saved schedule, resume with train.max_steps=3" in out
    # The note is what the run does: the scheduler's next learning rate is the new schedule's.
    assert longer.update.lr == lr_at(3, optim, 9) != lr_at(3, optim, 3)


def test_resume_with_the_same_max_steps_or_a_constant_schedule_says_nothing(tmp_path, capsys):
    Trainer(cfg(tmp_path / "a", "train.max_steps=2")).fit()
    Trainer(cfg(tmp_path / "b", "train.max_steps=2", "optim.schedule=constant")).fit()
    capsys.readouterr()
    for run, extra in ((tmp_path / "a", ["train.max_steps=2"]), (tmp_path / "b", ["train.max_steps=4", "optim.schedule=constant"])):
        resumed = Trainer(cfg(run, *extra))
        resumed.loader.close()
        out = capsys.readouterr().out
        assert "resumed from" in out and "train.max_steps changed" not in out, out
