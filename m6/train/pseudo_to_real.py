"""train.delink_at_step: pseudo-to-real inside one run. The pseudo giant (model.share_layers = k)
trains to step N and saves its checkpoint there; that checkpoint is delinked in place (the same
step, m6.checkpoint.delink) and the real model (share_layers = 1) resumes from it, in the same
process, to train.max_steps. The switch is a checkpoint and a resume, so a run delinked in place
continues exactly as one delinked offline and resumed, and a restart after step N resumes the real
model from the run's latest checkpoint (a pseudo checkpoint of step N left by a crash before the
delink is a config error that says how to delink it offline).

The pseudo Trainer (its weights, optimizer state, pinned buffers) is gone before the real one is
built: it lives only inside ``_train_pseudo``, and the reference cycles a Trainer holds (bound
methods handed to its collaborators) are collected there and then, not at some later gc pass.
"""

from __future__ import annotations

import copy
import gc
from pathlib import Path
from typing import Callable

import torch

from m6.checkpoint import CheckpointManager
from m6.checkpoint.delink import delink_in_place
from m6.checkpoint.reader import read_checkpoint
from m6.checkpoint.step_dirs import latest_step_dir, step_of
from m6.config import Config, ConfigError, run_dir


def real_config(cfg: Config) -> Config:
    """``cfg`` for the delinked model: every block its own weights."""
    real = copy.deepcopy(cfg)
    real.model.share_layers = 1
    return real


def _resume_point(cfg: Config) -> Path | None:
    """The checkpoint this run would resume from (checkpoint.resume auto: the run's latest)."""
    resume = cfg.checkpoint.resume
    if resume == "none":
        return None
    if resume == "auto":
        return latest_step_dir(Path(run_dir(cfg)) / "checkpoints")
    return Path(resume)


def _saved_share_layers(path: Path) -> int:
    meta = read_checkpoint(path, {"meta": None})["meta"]
    return int(meta.get("config", {}).get("model", {}).get("share_layers", 1))


def _train_pseudo(cfg: Config, trainer_class: Callable, delink_at: int) -> tuple[list[dict], bool]:
    """The pseudo giant's steps to ``delink_at`` and the delink of that step's checkpoint; returns
    its history and whether it got there (not stopped by a signal). Its Trainer dies with this call."""
    pseudo = trainer_class(cfg)
    history = pseudo.fit(stop_at=delink_at)
    if pseudo.step < delink_at:  # stopped by a signal: resumes later
        return history, False
    manager = CheckpointManager(pseudo.run_dir, cfg.checkpoint.keep, pseudo.rank, pseudo.checkpoints.group)
    delink_in_place(manager, delink_at)
    manager.close()
    pseudo._print_main(f"train.delink_at_step={delink_at}: delinked the model.share_layers="
                       f"{cfg.model.share_layers} blocks; the real model resumes from step {delink_at}")
    return history, True


def train_pseudo_to_real(cfg: Config, trainer_class: Callable) -> list[dict]:
    """Train the pseudo giant to train.delink_at_step, delink, train the real model to the end."""
    delink_at = cfg.train.delink_at_step
    resume = _resume_point(cfg)
    resumed_step = step_of(resume) if resume is not None else None
    if resumed_step is None or resumed_step < delink_at:
        history, delinked = _train_pseudo(cfg, trainer_class, delink_at)
        if not delinked:
            return history
        gc.collect()  # the pseudo Trainer's cycles: its memory back before the real model is built
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        real = real_config(cfg)
        real.checkpoint.resume = "auto"  # the delinked step is now this run's latest
        return history + trainer_class(real).fit()
    if _saved_share_layers(resume) > 1:
        # A crash between the pseudo giant's save of step N and its delink (or a checkpoint of another
        # run): the processes of this job have no process group yet to delink it together.
        raise ConfigError(f"checkpoint {resume} (step {resumed_step}) still holds the shared blocks of "
                          f"model.share_layers={_saved_share_layers(resume)} at or past train.delink_at_step="
                          f"{delink_at}; delink it with `python -m m6.checkpoint delink {resume} NEW_RUN_DIR` and "
                          f"resume there with model.share_layers=1")
    return trainer_class(real_config(cfg)).fit()
