"""What a training checkpoint holds, as Stateful pieces (``state_dict`` / ``load_state_dict``) that
the checkpoint writer collects by name, instead of a dict built and unpacked by hand.

Some pieces' ``state_dict`` are collectives (the model and optimizer gather experts, the skip
ledger sums over ranks): every rank collects every piece, in the same order; only rank 0's
result is written, and pieces that gather return None elsewhere.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Protocol

import torch

from m6.data.record_dataset import RUNTIME_SKIP_REASONS
from m6.data.sources import SkipCounter
from m6.memory import HostOffload
from m6.parallel import ShardedModel
from m6.parallel.checkpoint_state import (full_model_state, full_optimizer_state, local_model_state,
                                          local_optimizer_state)
from m6.train.checkpoint import CheckpointError, load_model_state, rng_state, set_rng_state

ReduceSum = Callable[[list[float]], list[float]]  # sums floats over all ranks (identity on one process)


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> None: ...


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


class RNGState:
    """The python, numpy, torch and CUDA generators of this process."""

    def state_dict(self) -> dict:
        return rng_state()

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state)


class ModelState:
    """The model's weights, layout-free (whole expert tensors); offload's host masters follow a load."""

    def __init__(self, sharded: ShardedModel, offload: HostOffload | None) -> None:
        self.sharded, self.offload = sharded, offload

    def state_dict(self) -> dict | None:
        return full_model_state(self.sharded)

    def load_state_dict(self, state: dict) -> None:
        load_model_state(self.sharded.model, local_model_state(self.sharded, state), source="")
        if self.offload:
            self.offload.pull_masters()


class OptimizerState:
    """The optimizer's moments, layout-free and indexed by parameter name."""

    def __init__(self, sharded: ShardedModel, optimizer: torch.optim.Optimizer,
                 names: dict[int, str] | None) -> None:
        self.sharded, self.optimizer, self.names = sharded, optimizer, names

    def state_dict(self) -> dict | None:
        return full_optimizer_state(self.sharded, self.optimizer, self.names)

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(local_optimizer_state(self.sharded, self.optimizer, state, self.names))


class TrainingState:
    """Named Stateful pieces plus fixed metadata (config, world size): what one checkpoint holds."""

    def __init__(self, pieces: dict[str, Stateful], metadata: dict) -> None:
        self.pieces, self.metadata = pieces, metadata

    def state_dict(self) -> dict:
        """Every piece's state, collected in the same order on every rank (collectives inside)."""
        return {**{name: piece.state_dict() for name, piece in self.pieces.items()}, **self.metadata}

    def load_state_dict(self, state: dict, source: str) -> None:
        """Load every piece from a checkpoint read from ``source`` (named in errors)."""
        missing = [name for name in self.pieces if name not in state]
        if missing:
            raise CheckpointError(f"checkpoint {source} lacks {', '.join(missing)}: not a checkpoint of this "
                                  f"version of m6")
        for name, piece in self.pieces.items():
            try:
                piece.load_state_dict(state[name])
            except CheckpointError as e:
                raise CheckpointError(f"{source}: {e}") from None
