"""What a training checkpoint holds, as pieces the checkpoint writer collects by name instead of a
dict built and unpacked by hand: the model and optimizer tensors (each rank its own share, expert
rows keyed by global expert id), Stateful python pieces (``state_dict`` / ``load_state_dict``),
each rank's RNG streams.

The skip ledger's ``state_dict`` is a collective (it sums over ranks): every rank collects every
piece, in the same order.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from m6.data.record_dataset import RUNTIME_SKIP_REASONS
from m6.data.sources import SkipCounter
from m6.memory import HostOffload
from m6.memory.delayed_update import DelayedUpdate
from m6.memory.master_weights import MasterWeights
from m6.memory.zero_partition import Chunk, ZeroPartition
from m6.parallel import ShardedModel
from m6.parallel.fsdp import local_part, shard_rows
from m6.parallel.sharded_adafactor import ShardedAdafactor
from m6.checkpoint.compat import changed_keys, checkpoint_keys, shape_differences
from m6.checkpoint.errors import CheckpointError, CheckpointMismatch
from m6.checkpoint.info import read_values
from m6.checkpoint.manager import CheckpointManager
from m6.checkpoint.reader import load_metadata
from m6.checkpoint.rng import rng_state, set_rng_state
from m6.checkpoint.sharded_io import Shards
from m6.checkpoint.stateful import Stateful
from m6.train.resume_fit import model_mismatch_message

ReduceSum = Callable[[list[float]], list[float]]  # sums floats over all ranks (identity on one process)


class TrainerCounters:
    """Steps taken, and the non-finite steps that were skipped (consecutive and in all)."""

    def __init__(self) -> None:
        self.step = 0
        self.bad_steps = 0  # consecutive non-finite steps (train.max_bad_steps)
        self.skipped_steps = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "bad_steps": self.bad_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.bad_steps, self.skipped_steps = state["step"], state["bad_steps"], state["skipped_steps"]


class SkipLedger:
    """Records the data skipped, by reason: at indexing (counted once at start-up, the same on every
    rank), by this rank's loader, and before the run resumed. ``total`` is job-wide."""

    def __init__(self, index_skips: SkipCounter, reduce_sum: ReduceSum, rank: int) -> None:
        self.index = index_skips
        self.loader = SkipCounter()  # this rank's loader skips since the start of this process
        self.restored: dict[str, int] = {}  # loader skips before the resumed checkpoint, all ranks
        self.total = index_skips.total  # job-wide, indexing included
        self.reduce_sum, self.rank = reduce_sum, rank

    def report(self, skips: SkipCounter, where: str) -> None:
        """Print the first few skipped records (file and key) so bad data is visible, not just counted."""
        for ex in skips.examples:
            print(f"skipped record {where} (rank {self.rank}): {ex.source} [{ex.key}] {ex.reason}: {ex.detail}",
                  flush=True)

    def count(self, loaded, step: int) -> int:
        """Add the records skipped in one step's micro-batches (``loaded``) to this rank's ledger,
        printing new examples; returns how many (this rank)."""
        before, shown = self.loader.total, len(self.loader.examples)
        for lb in loaded:
            for ex in lb.skips:
                self.loader.record(*ex)
        if len(self.loader.examples) > shown:
            fresh = SkipCounter()
            fresh.examples = self.loader.examples[shown:]
            self.report(fresh, f"at step {step}")
        return self.loader.total - before

    def by_reason(self) -> dict[str, int]:
        """Skipped records by reason, job-wide (a collective: every rank calls it)."""
        assert set(self.loader.counts) <= set(RUNTIME_SKIP_REASONS), self.loader.counts
        # A fixed list: every rank must pass the same number of values to the collective.
        runtime = self.reduce_sum([float(self.loader.counts[r]) for r in RUNTIME_SKIP_REASONS])
        totals = Counter(self.index.counts) + Counter(self.restored)
        totals.update({r: int(n) for r, n in zip(RUNTIME_SKIP_REASONS, runtime)})
        return {r: n for r, n in sorted(totals.items()) if n}

    def state_dict(self) -> dict:
        """The job-wide total and the loader's skips by reason (indexing recounts on resume)."""
        return {"skipped_records": self.total,
                "by_reason": {r: n - self.index.counts.get(r, 0) for r, n in self.by_reason().items()}}

    def load_state_dict(self, state: dict) -> None:
        self.total = state["skipped_records"]
        self.restored = {r: n for r, n in state["by_reason"].items() if n}


class ModelState:
    """The model's weights, layout-free: each expert tensor is this rank's rows of the global one,
    keyed by its global expert ids (so any layout reads it); offload's host masters follow a load.

    With the delayed update (``delayed``) the device weights are one update behind the host
    masters between steps: the weights are the masters (what a synchronous run holds at this step:
    init_from, export and a synchronous resume read them), and ``next_forward_tensors`` are the
    device weights the next step's forward uses, which an exact delayed resume restores too. With
    memory.offload=zero the weights are also the fp32 masters: the device's are their 16-bit roundings."""

    def __init__(self, sharded: ShardedModel, offload: HostOffload | None,
                 delayed: DelayedUpdate | None = None, device_masters: MasterWeights | None = None) -> None:
        """``device_masters``: train.weight_copy=per_step's fp32 masters, which a checkpoint holds in
        place of the module's bf16 copies (a load writes them; the copies follow)."""
        self.sharded, self.offload, self.delayed, self.device_masters = sharded, offload, delayed, device_masters

    def _state(self, masters: bool = False) -> dict[str, torch.Tensor]:
        """name -> tensor; a tensor that several blocks share (model.share_layers) appears once,
        under its first name. ``masters``: a parameter with a host (or device) master gives the master."""
        out, seen = {}, set()
        holder = self.device_masters or self.offload
        for name, t in self.sharded.model.state_dict(keep_vars=True).items():
            if id(t) not in seen:
                seen.add(id(t))
                out[name] = holder.masters[id(t)] if masters and id(t) in holder.masters else t.detach()
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        """name -> tensor (shares the model's storage, or its masters': a load writes straight into
        the weights); a sharded (FSDP2) parameter gives this rank's shard."""
        masters = (self.delayed is not None or self.device_masters is not None
                   or (self.offload is not None and self.offload.rounds_weights))
        return {name: local_part(t) for name, t in self._state(masters=masters).items()}

    def next_forward_tensors(self) -> dict[str, torch.Tensor]:
        """Delayed update: name -> the device weight the next forward uses, for each parameter
        with a host master (sharing its storage)."""
        with_master = {name for name, t in self.sharded.model.state_dict(keep_vars=True).items()
                       if id(t) in self.offload.masters}
        return {name: t for name, t in self._state().items() if name in with_master}

    def global_shapes(self) -> dict[str, torch.Size]:
        return {name: global_shape(self.sharded, name, t) for name, t in self._state().items()}

    def shards(self, prefix: str, device_weights: bool = False) -> Shards:
        """The row shards among ``tensors()`` (or, ``device_weights``, ``next_forward_tensors()``)."""
        # zero partitioned (m6.memory.zero_partition): a split parameter's master is this rank's rows
        # of it; its device weight is whole.
        partition = getattr(self.offload, "partition", None)
        chunks = partition.by_name() if partition is not None and not device_weights else {}
        return {f"{prefix}{name}": (global_shape(self.sharded, name, t),
                                    placement(self.sharded, name, t, chunks.get(name)))
                for name, t in self._state().items() if is_row_shard(self.sharded, name, t, chunks.get(name))}

    def after_load(self, next_forward_loaded: bool = False) -> None:
        """After a load wrote ``tensors()`` (and, when ``next_forward_loaded``, the
        ``next_forward_tensors()``): bring the other copy of the weights in line."""
        if self.device_masters is not None:
            self.device_masters.write_compute_weights()
        elif self.delayed is None:
            if self.offload:
                self.offload.pull_masters()
        elif not next_forward_loaded:  # the weights are the masters: the device starts from them
            self.offload.push_weights()
        else:  # the device holds the saved next-step weights; the masters' copy follows the next backward
            self.delayed.stale = True


def is_row_shard(sharded: ShardedModel, name: str, t: torch.Tensor, chunk: Chunk | None = None) -> bool:
    """Whether this rank holds only part of ``name``'s global tensor (its experts' rows, a
    parameter sharded by parallel.shard, a tensor-parallel split, or zero's partitioned ``chunk``
    of it), which a checkpoint then stores as chunks of the global tensor."""
    return name in sharded.expert_params or isinstance(t, DTensor) or name in sharded.tensor_split or chunk is not None


def placement(sharded: ShardedModel, name: str, t: torch.Tensor, chunk: Chunk | None = None) -> int | list:
    """Where this rank's tensor of ``name`` lies in the global one, as m6.checkpoint.sharded_io's
    Shards say it: the first row, or (global offsets, local offsets, sizes) per piece for a
    tensor-parallel split (its q, k and v sections for the fused qkv)."""
    if name in sharded.tensor_split:
        layout = sharded.groups.layout
        rows = shard_rows(t) if isinstance(t, DTensor) else None  # parallel.shard: this rank's rows of its tp shard
        return sharded.tensor_split[name].pieces(t.shape, layout.tensor_parallel_size, layout.tp_rank, rows)
    return first_row(sharded, name, t, chunk)


def first_row(sharded: ShardedModel, name: str, t: torch.Tensor, chunk: Chunk | None = None) -> int:
    """The global row (dim 0) where this rank's rows of ``name`` start: the first local expert's
    id, plus where a sharded parameter's shard (or zero's partitioned ``chunk``) starts among those rows."""
    first = sharded.first_expert(name) if name in sharded.expert_params else 0
    return first + (shard_rows(t)[0] if isinstance(t, DTensor) else chunk.first if chunk is not None else 0)


def global_shape(sharded: ShardedModel, name: str, t: torch.Tensor, chunk: Chunk | None = None) -> torch.Size:
    """The shape of ``name`` over all ranks: expert tensors hold this rank's range of the layer's
    experts (dim 0), even or uneven (``t`` a DTensor: its other dims are already those over its
    shards; ``t`` zero's partitioned ``chunk`` of this rank's tensor: its rows are the chunk's)."""
    if chunk is not None:  # (no tensor parallel with it: config.py refuses it)
        rows = sharded.global_experts[name] if name in sharded.expert_params else chunk.rows
        return torch.Size([rows, *t.shape[1:]])
    if name in sharded.tensor_split:
        return sharded.tensor_split[name].global_shape(t.shape)
    if name not in sharded.expert_params:
        return t.shape
    return torch.Size([sharded.global_experts[name], *t.shape[1:]])


# The per-parameter state tensors each optim.name keeps (besides its step count).
OPTIMIZER_STATE_KEYS = {"adamw": {"exp_avg", "exp_avg_sq"}, "adafactor": {"row_var", "col_var", "variance"}}


# Param-group keys that pick torch's optimizer kernels rather than the optimization itself.
KERNEL_CHOICES = frozenset({"foreach", "fused", "capturable", "differentiable"})


class OptimizerState:
    """The optimizer's moments keyed by parameter name (expert moments sharded like their experts)
    and its hyperparameters per group."""

    def __init__(self, sharded: ShardedModel, optimizer: torch.optim.Optimizer,
                 names: dict[int, str] | None, partition: ZeroPartition | None = None) -> None:
        """``partition``: zero's partitioned host states, whose moments are this rank's rows."""
        self.sharded, self.optimizer = sharded, optimizer
        self._chunks = partition.by_name() if partition is not None else {}
        name_of = names if names is not None else {id(p): n for n, p in sharded.model.named_parameters()}
        self.params = {name_of[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
        self._group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}

    def tensors(self, create: set[str] = frozenset()) -> dict[str, dict[str, torch.Tensor]]:
        """name -> {exp_avg, exp_avg_sq, step}; ``create``: names whose state is made (zeros) where
        the optimizer has none yet, so a load can fill it in place."""
        out = {}
        for name, p in self.params.items():
            state = self.optimizer.state[p]
            if not state and name in create:
                state.update(self._fresh_state(p))
            tensors = {k: local_part(v) for k, v in state.items() if torch.is_tensor(v)}
            if tensors:
                out[name] = tensors
        return out

    def _fresh_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The optimizer's own lazy state for ``p``, made before its first step so that a load can
        fill it in place: a float32 step count on the CPU (foreach), or on ``p``'s device where its
        group is fused or capturable (torch's fused AdamW refuses a host step count for CUDA params)."""
        if isinstance(self.optimizer, ShardedAdafactor):  # its state's layout over the shards is its own
            return self.optimizer.fresh_state(p)
        group = self._group_of[id(p)]
        step = torch.zeros((), dtype=torch.float32,
                           device=p.device if group.get("fused") or group.get("capturable") else None)
        if self.kind == "adamw":
            return {"step": step, "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        if p.dim() > 1:  # torch.optim.Adafactor's factored second moment: a row and a column mean
            return {"step": step, "row_var": p.new_zeros((*p.shape[:-1], 1)),
                    "col_var": p.new_zeros((*p.shape[:-2], 1, p.shape[-1]))}
        return {"step": step, "variance": torch.zeros_like(p, memory_format=torch.preserve_format)}

    @property
    def kind(self) -> str:
        """optim.name of this run's optimizer (DeepSpeed's CPU Adam keeps AdamW's state)."""
        return "adafactor" if isinstance(self.optimizer, torch.optim.Adafactor) else "adamw"

    def check_kind(self, path: Path, saved_keys: set[str]) -> None:
        """Refuse a checkpoint whose optimizer state another optimizer wrote (``saved_keys``: the
        state tensors' names in it, e.g. exp_avg): AdamW's moments and Adafactor's factored second
        moments do not convert into each other, and starting one from nothing must be asked for."""
        saved = {kind for kind, keys in OPTIMIZER_STATE_KEYS.items() if saved_keys & keys}
        if saved and self.kind not in saved:
            (other,) = saved
            raise CheckpointMismatch(
                f"checkpoint {path} holds {other} optimizer state ({', '.join(sorted(saved_keys & OPTIMIZER_STATE_KEYS[other]))}); "
                f"this run has optim.name={self.kind}. Resume with optim.name={other}, or keep only the weights "
                f"(a fresh {self.kind} state) with checkpoint.init_from=PATH and checkpoint.resume=none.")

    def shards(self, prefix: str) -> Shards:
        out = {}
        for name, p in self.params.items():
            for key, t in self.optimizer.state[p].items():
                chunk = self._chunks.get(name)
                if torch.is_tensor(t) and t.dim() > 0 and is_row_shard(self.sharded, name, t, chunk):
                    out[f"{prefix}{name}/{key}"] = (global_shape(self.sharded, name, t, chunk),
                                                    placement(self.sharded, name, t, chunk))
        return out

    def hyperparameters(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def load_hyperparameters(self, groups: list[dict]) -> None:
        if len(groups) != len(self.optimizer.param_groups):
            raise CheckpointError(f"the checkpoint's optimizer has {len(groups)} parameter groups, this run's "
                                  f"{len(self.optimizer.param_groups)}")
        for group, saved in zip(self.optimizer.param_groups, groups):
            # The kernels are this run's choice (optim.implementation, the device), not the saving
            # run's: a checkpoint written on a CPU resumes with CUDA's fused AdamW, and back.
            group.update({k: v for k, v in saved.items() if k not in KERNEL_CHOICES})


class RNGState:
    """The python, numpy, torch and CUDA generators of this process."""

    def state_dict(self) -> dict:
        return rng_state()

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state)


class TrainingState:
    """What one checkpoint holds: the model and optimizer tensors (sharded; with the delayed update
    also the next forward's device weights, ``delayed_update/next_forward/``), the rank-independent
    Stateful pieces (``values``, identical on every rank: written once), this rank's RNG streams
    (``rng/rank{r}``) and fixed metadata (config, layout). A piece named in ``optional`` that a
    checkpoint lacks (the fp16 loss scale, resuming a bf16 or fp32 run) keeps its fresh state;
    ``missing`` then names it."""

    def __init__(self, model: ModelState, optimizer: OptimizerState, values: dict[str, Stateful],
                 rank: int, metadata: dict, optional: set[str] = frozenset()) -> None:
        self.model, self.optimizer, self.values = model, optimizer, values
        self.rank, self.metadata, self.optional = rank, metadata, set(optional)
        self.missing: list[str] = []
        self.rng = RNGState()

    def state_dict(self) -> tuple[dict, Shards]:
        """(nested state, expert shards): collected in the same order on every rank (collectives)."""
        state = {"model": self.model.tensors(),
                 **({"delayed_update": {"next_forward": self.model.next_forward_tensors()}}
                    if self.model.delayed is not None else {}),
                 "optimizer": {"state": self.optimizer.tensors(), "param_groups": self.optimizer.hyperparameters()},
                 **{name: piece.state_dict() for name, piece in self.values.items()},
                 "rng": {f"rank{self.rank}": self.rng.state_dict()},
                 "meta": self.metadata}
        return state, {**self.model.shards("model/"), **self._next_forward_shards(),
                       **self.optimizer.shards("optimizer/state/")}

    def _next_forward_shards(self) -> Shards:
        """The expert rows among the delayed update's next-step weights (none without it)."""
        if self.model.delayed is None:
            return {}
        prefix = f"{NEXT_FORWARD}/"
        names = {prefix + name for name in self.model.next_forward_tensors()}
        return {k: v for k, v in self.model.shards(prefix, device_weights=True).items() if k in names}

    def load(self, manager: CheckpointManager, path: Path) -> dict:
        """Restore everything from the checkpoint ``path`` (a collective); returns its metadata.

        The model must have the checkpoint's shape (checked first, nothing loaded otherwise); the
        RNG streams are restored when this rank's were saved (same world size), else the run goes
        on with its own seeded streams and says so.
        """
        saved = checkpoint_keys(manager.resolve(path))
        # Pipeline parallel: the other stages' weights are in the checkpoint, not this rank's model.
        elsewhere = getattr(self.model.sharded.model, "other_stages_state", frozenset())
        diffs = shape_differences(self.model.global_shapes(), {k[len("model/"):]: v for k, v in saved.items()
                                                               if k.startswith("model/")
                                                               and k[len("model/"):] not in elsewhere})
        if diffs:
            step_dir = manager.resolve(path)
            saved_config = read_values(step_dir, load_metadata(step_dir), ("meta/",)).get("meta", {}).get("config", {})
            changed = changed_keys(saved_config, self.metadata.get("config", {}), ("model.",))
            raise CheckpointMismatch(model_mismatch_message(path, changed, diffs))
        with_state = {k.split("/")[2] for k in saved if k.startswith("optimizer/state/")}
        self.optimizer.check_kind(path, {k.split("/")[3] for k in saved if k.startswith("optimizer/state/")
                                         and k.count("/") >= 3})
        rng_key = f"rank{self.rank}"
        self.missing = [name for name in self.values if name in self.optional
                        and not any(k == name or k.startswith(name + "/") for k in saved)]
        targets = {"model": self.model.tensors(),
                   "optimizer": {"state": self.optimizer.tensors(create=with_state), "param_groups": None},
                   **{name: None for name in self.values if name not in self.missing},
                   "meta": None}
        if any(k.startswith(f"rng/{rng_key}/") for k in saved):
            targets["rng"] = {rng_key: None}
        # Delayed update: the device weights the next forward uses, when the checkpoint has them (a
        # synchronous run's has not: the device then starts from the weights).
        next_forward = self.model.delayed is not None and any(k.startswith(f"{NEXT_FORWARD}/") for k in saved)
        if next_forward:
            targets["delayed_update"] = {"next_forward": self.model.next_forward_tensors()}
        shards = {**self.model.shards("model/"), **(self._next_forward_shards() if next_forward else {}),
                  **self.optimizer.shards("optimizer/state/")}
        loaded = manager.load(path, targets, shards)
        data_changes = changed_keys(loaded["meta"].get("config", {}), self.metadata.get("config", {}), DATA_IDENTITY)
        if data_changes:
            raise CheckpointMismatch(
                f"checkpoint {path} was saved with other training data, so its data position would point into "
                f"different samples: " + "; ".join(data_changes) + ". " + _WEIGHTS_ONLY)
        self.model.after_load(next_forward_loaded=next_forward)
        self.optimizer.load_hyperparameters(loaded["optimizer"]["param_groups"])
        for name, piece in self.values.items():
            if name in self.missing:
                continue
            try:
                piece.load_state_dict(loaded[name])
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointMismatch(
                    f"checkpoint {path}: its {name} state does not fit this run ({e}). "
                    + config_changes(loaded["meta"].get("config", {}), self.metadata.get("config", {}), name)) from e
        if "rng" in loaded:
            self.rng.load_state_dict(loaded["rng"][rng_key])
        return loaded["meta"]


# Where a delayed-update checkpoint keeps the device weights of the next forward (one update behind "model/").
NEXT_FORWARD = "delayed_update/next_forward"


# Config sections that decide each restored piece: where to look when it does not fit.
_DECIDED_BY = {"data": ("data", "run.seed", "train.global_batch_size"), "scheduler": ("optim", "train.max_steps")}
# What the saved data position means: which sample an index is. A change makes the position point
# into other data, even when its sizes still fit, so it is refused before anything is restored.
DATA_IDENTITY = ("data.kind", "data.sources", "data.eval_samples", "data.num_samples", "data.text_only_fraction",
                 "data.tasks")


_WEIGHTS_ONLY = ("Resume with the saved values, or keep only the weights with checkpoint.init_from=PATH and "
                 "checkpoint.resume=none.")


def config_changes(saved: dict, current: dict, piece: str) -> str:
    """A sentence naming the changed config keys that decide ``piece``, for an error message."""
    changed = changed_keys(saved, current, _DECIDED_BY.get(piece, ()))
    if not changed:
        return "The config keys that decide it are the same as at save."
    return "Changed since the save: " + "; ".join(changed) + ". " + _WEIGHTS_ONLY
