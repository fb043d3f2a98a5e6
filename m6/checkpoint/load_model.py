"""An m6 model with its weights from disk, for evaluation scripts: ``load_model(DIR)``."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint import CheckpointException

import m6.checkpoint.sharded_io as sharded_io
from m6.checkpoint.errors import CheckpointMismatch
from m6.checkpoint.info import MODEL, read_values
from m6.checkpoint.reader import find_checkpoint, load_metadata, raise_read_failure
from m6.config import Config, ConfigError
from m6.config_loader import from_dict
from m6.model.m6_model import M6Model, build_meta_model


def load_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[M6Model, Config]:
    """``(model, config)`` from ``path``: an ``import-hf`` output directory, a run directory (its
    latest complete checkpoint) or a checkpoint's step directory. The config is the one saved in
    the checkpoint; the model is built from its ``model`` section on ``device``, its weights read
    whole (any expert-parallel layout saved them), in the checkpoint's dtype cast to the model's
    (fp32), and returned in eval mode. Optimizer state is not read."""
    ckpt = find_checkpoint(path)
    metadata = load_metadata(ckpt)
    saved = read_values(ckpt, metadata, ("meta/config",)).get("meta", {}).get("config")
    if saved is None:
        raise CheckpointMismatch(f"checkpoint {ckpt} holds no config (meta/config): the model cannot be built")
    try:
        config = from_dict(Config, saved)
        config.model.validate()
    except ConfigError as e:
        raise CheckpointMismatch(f"checkpoint {ckpt}: its saved config does not load: {e}") from e
    model = build_meta_model(config.model)
    # Every tensor gets its values (buffers the checkpoint does not hold, e.g. non-persistent
    # ones, too), then the checkpoint's overwrite the weights.
    model.materialize(torch.device(device), seed=config.run.seed)
    targets = {f"{MODEL}{name}": t for name, t in model.state_dict().items()}
    on_disk = sharded_io.tensor_keys(metadata)
    missing = [k for k in targets if k not in on_disk]
    if missing:
        raise CheckpointMismatch(f"checkpoint {ckpt} has no tensor {missing[0]} ({len(missing)} missing), which its "
                                 f"saved model config builds")
    try:
        with torch.no_grad():
            sharded_io.read(ckpt, targets, {})
    except (Exception, CheckpointException) as e:  # DCP's own error is a BaseException
        raise_read_failure(ckpt, e)
    return model.eval(), config
