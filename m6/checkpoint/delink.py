"""Delink a pseudo-giant checkpoint (model.share_layers = k > 1) into the real model's: every block
of a group gets its own copy of the group's shared weights and of their optimizer state, and the
checkpoint then resumes a run with model.share_layers = 1 exactly where the shared run stood
(same forward, same optimizer moments, step, schedule, data position and RNG streams).

The checkpoint is read whole into host memory, rewritten with the copies, and saved as the same
step under ``DST/checkpoints`` (a run directory: resume it with ``run.dir=DST`` or
``checkpoint.resume=DST/checkpoints/step_N``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from m6.checkpoint.errors import CheckpointError
from m6.checkpoint.manager import CheckpointManager
from m6.checkpoint.reader import find_checkpoint, read_checkpoint
from m6.model.shared_blocks import delinked_copies


def delink_state(state: dict[str, Any]) -> dict[str, Any]:
    """The real model's checkpoint state from a pseudo giant's (the nested dict a checkpoint holds);
    the tensors of the copies are clones, and the saved config says model.share_layers: 1."""
    config = state.get("meta", {}).get("config", {})
    model_cfg = config.get("model", {})
    share_layers, num_layers = model_cfg.get("share_layers", 1), model_cfg.get("num_layers")
    if share_layers <= 1:
        raise CheckpointError(f"the checkpoint was saved with model.share_layers={share_layers}: its blocks share no "
                              f"weights, there is nothing to delink")
    model = state["model"]
    for target, source in delinked_copies(list(model), share_layers, num_layers).items():
        model[target] = model[source].clone()
    moments = state["optimizer"]["state"]
    for target, source in delinked_copies(list(moments), share_layers, num_layers).items():
        moments[target] = {key: value.clone() for key, value in moments[source].items()}
    model_cfg["share_layers"] = 1
    state["meta"]["delinked_from_share_layers"] = share_layers
    return state


def delink_checkpoint(src: str | Path, dst: str | Path) -> dict[str, Any]:
    """Write the delinked checkpoint of ``src`` (a step directory, or a run directory: its latest)
    into the run directory ``dst`` at the same step. Returns path, step and what was copied."""
    ckpt = find_checkpoint(src)
    state = read_checkpoint(ckpt)
    before = len(state["model"])
    state = delink_state(state)
    step = state["counters"]["step"]
    manager = CheckpointManager(dst, keep=1)
    if manager.step_dir(step).exists():
        raise CheckpointError(f"{manager.step_dir(step)} exists already; delink into another run directory")
    path = manager.save(step, state)
    manager.close()
    return {"src": str(ckpt), "dst": str(path), "step": step, "copied_tensors": len(state["model"]) - before,
            "share_layers": state["meta"]["delinked_from_share_layers"]}
