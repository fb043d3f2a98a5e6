"""Delink a pseudo-giant checkpoint (model.share_layers = k > 1) into the real model's: every block
of a group gets its own copy of the group's shared weights and of their optimizer state, and the
checkpoint then resumes a run with model.share_layers = 1 exactly where the shared run stood
(same forward, same optimizer moments, step, schedule, data position and RNG streams).

The checkpoint is read whole into host memory, rewritten with the copies, and saved as the same
step under ``DST/checkpoints`` (a run directory: resume it with ``run.dir=DST`` or
``checkpoint.resume=DST/checkpoints/step_N``).

In place inside a job (``delink_in_place``, train.delink_at_step), the weights and optimizer
moments are split over the ranks by rows instead: each rank reads, copies and writes its rows of
every such tensor (and every small entry whole: config, counters, RNG states), so a rank holds
about 1/world of the real model's checkpoint, not all of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from m6.checkpoint import sharded_io
from m6.checkpoint.errors import CheckpointError
from m6.checkpoint.manager import CheckpointManager
from m6.checkpoint.reader import find_checkpoint, load_metadata, read_checkpoint
from m6.checkpoint.sharded_io import Shards
from m6.checkpoint.state_tree import SEP, unflatten
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



def _tensor_name(key: str) -> str | None:
    """The model parameter / buffer / optimizer-state name a flat checkpoint key belongs to (None:
    another entry): ``model/<name>`` or ``optimizer/state/<name>/<statistic>``."""
    parts = key.split(SEP)
    if parts[0] == "model" and len(parts) == 2:
        return parts[1]
    if parts[:2] == ["optimizer", "state"] and len(parts) == 4:
        return parts[2]
    return None


def rank_rows(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first row, rows) of rank ``rank``'s contiguous share of ``num_rows`` (the first
    ``num_rows % world_size`` ranks one more)."""
    base, extra = divmod(num_rows, world_size)
    return rank * base + min(rank, extra), base + (rank < extra)


def delink_shards(metadata, rank: int, world_size: int) -> Shards:
    """The rows of each model and optimizer-state tensor rank ``rank`` delinks: a contiguous share
    of dim 0 of every such tensor with at least ``world_size`` rows (smaller ones are read whole
    by every rank, DCP writing them once)."""
    shards: Shards = {}
    for key, md in sharded_io.tensor_keys(metadata).items():
        if _tensor_name(key) is not None and len(md.size) >= 1 and md.size[0] >= world_size > 1:
            shards[key] = (md.size, rank_rows(md.size[0], rank, world_size)[0])
    return shards


def delink_in_place(manager: CheckpointManager, step: int) -> int:
    """Rewrite the checkpoint of ``step`` in ``manager``'s run as the real model's (a collective
    over ``manager.group``): each rank reads, copies and writes its rows of the weights and
    optimizer moments (``delink_shards``) and every other entry whole (DCP writes each once).
    Returns the bytes of model and optimizer tensors this rank read."""
    path = manager.step_dir(step)
    group = manager.group
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    metadata = load_metadata(path)
    shards = delink_shards(metadata, rank, world)
    targets, nbytes = {}, 0
    for key, md in sharded_io.tensor_keys(metadata).items():
        shape = list(md.size)
        if key in shards:
            shape[0] = rank_rows(md.size[0], rank, world)[1]
        targets[key] = torch.empty(shape, dtype=md.properties.dtype)
        nbytes += targets[key].nbytes if _tensor_name(key) is not None else 0
    targets.update({key: None for key in sharded_io.value_keys(metadata)})
    state = read_checkpoint(path, unflatten(targets), shards, group)
    model_cfg = state["meta"]["config"]["model"]
    share_layers, num_layers = model_cfg["share_layers"], model_cfg["num_layers"]
    # A copy is this rank's rows of its source: the same share of a tensor of the same shape.
    copied = {f"model{SEP}{target}": f"model{SEP}{source}"
              for target, source in delinked_copies(list(state["model"]), share_layers, num_layers).items()}
    moments = state["optimizer"]["state"]
    copied.update({f"optimizer{SEP}state{SEP}{target}{SEP}{stat}": f"optimizer{SEP}state{SEP}{source}{SEP}{stat}"
                   for target, source in delinked_copies(list(moments), share_layers, num_layers).items()
                   for stat in moments[source]})
    shards.update({target: shards[source] for target, source in copied.items() if source in shards})
    state = delink_state(state)
    manager.save(step, state, shards)
    return nbytes
