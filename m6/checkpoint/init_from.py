"""Weights-only initialisation from a checkpoint (config key checkpoint.init_from): the model's
weights come from another run's checkpoint; optimizer state, schedule, data position and step
start fresh.

Each rank reads only its rows of the expert tensors (the ``model/`` keys and expert shards that
the model declares), so a checkpoint saved at any layout initialises any other.

Dense -> MoE upcycling: where the checkpoint holds a dense FFN (DenseMLP: ``fc_in.weight`` [F, D],
``fc_out.weight`` [D, F], each with a bias) and this model has an MoE layer (GroupedExperts:
``w_in`` [E, D, F], ``w_out`` [E, F, D], no biases), every expert gets a copy of the dense FFN
(``w_in[e] = fc_in.weight.T``, ``w_out[e] = fc_out.weight.T``); the router keeps its fresh init and
the dense biases are dropped (and named). A SwiGLU dense FFN (``fc_gate.weight`` too: model.ffn_activation
=swiglu) upcycles into SwiGLU experts (``w_gate[e] = fc_gate.weight.T``). Everything else must match by
name and shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.checkpoint import CheckpointException

import m6.checkpoint.sharded_io as sharded_io
from m6.checkpoint.compat import shape_differences
from m6.checkpoint.errors import CheckpointError
from m6.checkpoint.reader import find_checkpoint, load_metadata, read_failure
from m6.checkpoint.stateful import ModelTensors

_PREFIX = "model/"
_MOE_FFN = re.compile(r"^(blocks\.\d+\.ffn\.)experts\.w_in$")
_EXPERT_BIAS = ".ffn.expert_bias"  # model.moe.expert_bias_update_rate > 0
_MAX_LISTED_DIFFS = 5


@dataclass
class InitPlan:
    """Which checkpoint keys fill which model tensors: by name, or by copying a dense FFN into
    every expert of an MoE layer (``upcycled``: the layers' ``blocks.{i}.ffn.`` prefixes)."""

    by_name: list[str] = field(default_factory=list)
    upcycled: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # dense biases with no expert counterpart
    fresh: list[str] = field(default_factory=list)  # routers of upcycled layers: keep their init
    fresh_biases: list[str] = field(default_factory=list)  # expert biases the checkpoint lacks: start at 0


def plan_init(model_shapes: dict[str, torch.Size], saved_shapes: dict[str, torch.Size], source: str) -> InitPlan:
    """Match the model's tensors (name -> global shape) to a checkpoint's ``model/`` tensors (name
    -> shape); raises a CheckpointError listing every difference."""
    plan, diffs = InitPlan(), []
    model_rest, saved_rest = dict(model_shapes), dict(saved_shapes)
    for name in model_shapes:
        match = _MOE_FFN.match(name)
        ffn = match.group(1) if match else None
        if ffn is None or name in saved_shapes or f"{ffn}fc_in.weight" not in saved_shapes:
            continue
        plan.upcycled.append(ffn)
        diffs += _upcycle_differences(ffn, model_shapes, saved_shapes)
        for key in [k for k in model_rest if k.startswith(ffn)]:
            del model_rest[key]
            if key.startswith(f"{ffn}router.") or key == f"{ffn}expert_bias":
                plan.fresh.append(key)
            elif key not in (f"{ffn}experts.w_in", f"{ffn}experts.w_out", f"{ffn}experts.w_gate"):
                diffs.append(f"{key}: no dense counterpart to upcycle it from")
        for key in [k for k in saved_rest if k.startswith(ffn)]:
            del saved_rest[key]
            if key.endswith(".bias"):
                plan.dropped.append(key)
    for key in [k for k in model_rest if k.endswith(_EXPERT_BIAS) and k not in saved_rest]:
        # Aux-free balancing turned on over weights trained without it: the bias starts at zero.
        del model_rest[key]
        plan.fresh_biases.append(key)
    diffs += shape_differences({k: torch.Size(v) for k, v in model_rest.items()}, saved_rest)
    if diffs:
        shown = "\n  ".join(diffs[:_MAX_LISTED_DIFFS])
        more = f"\n  ... and {len(diffs) - _MAX_LISTED_DIFFS} more" if len(diffs) > _MAX_LISTED_DIFFS else ""
        raise CheckpointError(f"checkpoint.init_from={source}: the checkpoint's weights do not fit this model "
                              f"({len(diffs)} difference(s)):\n  {shown}{more}")
    plan.by_name = list(model_rest)
    return plan


_DENSE_TO_EXPERT = (("fc_in.weight", "experts.w_in"), ("fc_out.weight", "experts.w_out"),
                    ("fc_gate.weight", "experts.w_gate"))


def _upcycled_pairs(ffn: str, model: dict[str, torch.Size]) -> list[tuple[str, str]]:
    """(dense key, expert key) pairs an upcycled layer copies: the gate too for SwiGLU experts."""
    return [(d, e) for d, e in _DENSE_TO_EXPERT if e != "experts.w_gate" or f"{ffn}{e}" in model]


def _upcycle_differences(ffn: str, model: dict[str, torch.Size], saved: dict[str, torch.Size]) -> list[str]:
    """Why the dense FFN ``ffn`` in the checkpoint cannot become this model's experts (or [])."""
    diffs = []
    if f"{ffn}experts.w_gate" in model and f"{ffn}fc_gate.weight" not in saved:
        return [f"{ffn}experts.w_gate: SwiGLU experts cannot be upcycled from a dense GELU FFN "
                f"(model.moe.activation must match the checkpoint's model.ffn_activation)"]
    if f"{ffn}experts.w_gate" not in model and f"{ffn}fc_gate.weight" in saved:
        return [f"{ffn}fc_gate.weight: a dense SwiGLU FFN cannot be upcycled into GELU experts "
                f"(model.moe.activation must match the checkpoint's model.ffn_activation)"]
    for dense, expert in _upcycled_pairs(ffn, model):
        if f"{ffn}{dense}" not in saved:
            diffs.append(f"missing in checkpoint: {ffn}{dense} (to upcycle into {ffn}{expert})")
            continue
        want = torch.Size(reversed(model[f"{ffn}{expert}"][1:]))  # expert [D, F] <- dense [F, D] (and back)
        if torch.Size(saved[f"{ffn}{dense}"]) != want:
            diffs.append(f"{ffn}{dense}: checkpoint {list(saved[f'{ffn}{dense}'])} cannot fill {ffn}{expert} "
                         f"{list(model[f'{ffn}{expert}'])} (needs {list(want)})")
    known = {f"{ffn}{k}" for k in ("fc_in.weight", "fc_in.bias", "fc_out.weight", "fc_out.bias", "fc_gate.weight",
                                    "fc_gate.bias")}
    diffs += [f"unexpected in checkpoint: {k}" for k in saved if k.startswith(ffn) and k not in known]
    return diffs


def init_from_checkpoint(path: str | Path, model: ModelTensors, group=None,
                         log: Callable[[str], None] = print) -> Path:
    """Fill ``model``'s weights from the checkpoint at ``path`` (a step directory or its metadata
    file, or a run directory: its latest checkpoint); a collective over ``group`` (None with one
    process). Returns the checkpoint directory read."""
    ckpt = find_checkpoint(path)
    metadata = load_metadata(ckpt)
    saved = {k[len(_PREFIX):]: md.size for k, md in sharded_io.tensor_keys(metadata).items() if k.startswith(_PREFIX)}
    plan = plan_init(model.global_shapes(), saved, str(path))
    tensors = model.tensors()
    targets = {f"{_PREFIX}{name}": tensors[name] for name in plan.by_name}
    dense = {}
    shapes = model.global_shapes()
    for ffn in plan.upcycled:
        for key in (f"{ffn}{d}" for d, _ in _upcycled_pairs(ffn, shapes)):
            dtype = metadata.state_dict_metadata[f"{_PREFIX}{key}"].properties.dtype
            dense[key] = targets[f"{_PREFIX}{key}"] = torch.empty(saved[key], dtype=dtype)
    step_key = "counters/step"
    if step_key in sharded_io.value_keys(metadata):
        targets[step_key] = None
    try:
        sharded_io.read(ckpt, targets, model.shards(_PREFIX), group)
    except (Exception, CheckpointException) as e:  # DCP's own error is a BaseException
        error = read_failure(ckpt, e)
        if error is e:
            raise
        raise type(error)(f"checkpoint.init_from={path}: {error}") from e
    with torch.no_grad():
        for ffn in plan.upcycled:
            # Every expert is the dense FFN: y = gelu(x @ fc_in.weight.T) @ fc_out.weight.T (no biases),
            # or its SwiGLU form with fc_gate.
            for dense_key, expert_key in _upcycled_pairs(ffn, shapes):
                w = tensors[f"{ffn}{expert_key}"]
                w.copy_(dense[f"{ffn}{dense_key}"].t().unsqueeze(0).expand_as(w))
    model.after_load()
    _report(log, path, ckpt, targets.get(step_key), plan)
    return ckpt


def _report(log: Callable[[str], None], source: str | Path, ckpt: Path, step, plan: InitPlan) -> None:
    at = f" (step {step} of that run)" if step is not None else ""
    log(f"checkpoint.init_from={source}: model weights initialised from {ckpt}{at}; optimizer state, "
        f"learning-rate schedule and data position start fresh at step 0")
    if plan.upcycled:
        layers = ", ".join(ffn[:-len(".ffn.")] for ffn in plan.upcycled)
        log(f"checkpoint.init_from: upcycled the dense FFN of {layers} into every expert; the router"
            f"{'s keep their' if len(plan.upcycled) > 1 else ' keeps its'} fresh init")
    if plan.fresh_biases:
        log(f"checkpoint.init_from: the checkpoint has no aux-free expert bias for {len(plan.fresh_biases)} MoE "
            f"layer(s) (saved without model.moe.expert_bias_update_rate); their biases start at 0")
    if plan.dropped:
        log(f"warning: checkpoint.init_from: dropped dense FFN biases that experts do not have: "
            f"{', '.join(plan.dropped)}")
