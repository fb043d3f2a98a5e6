"""A step's scalars: its loss terms, read from the device once, and the one all-reduce that sums
over ranks what every rank must agree on or the logs report for the whole job.

    losses = StepLosses(model)
    for each micro-batch: losses.add(lm_sum, aux)          # kept on the device
    local = losses.read(accum, aux_ranks, all_reduce_sum)  # the step's one host sync
    totals = reduction.reduce(all_reduce_sum, loaded, local, new_skips, grad_norm, timer.rank_slots())

What rides on the all-reduce: the LM loss sum, the model FLOPs, the real tokens and the skipped
records (summed for the logs); whether each rank's gradient norm is finite (every rank then skips,
and under fp16 backs off, together, even where their norms could differ); the inter-node bytes the
expert-parallel dispatchers counted this step; each rank's compute seconds in its own slot.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import torch

from m6.data.record_dataset import LoadedItem
from m6.model import M6Model
from m6.model.flops import ForwardFlopRates, TokenCounts, count_tokens, step_flops
from m6.moe import MoELayer
from m6.moe.all_to_all import AllToAllDispatcher
from m6.train.loss import moe_loss_terms

AllReduceSum = Callable[[list[float]], list[float]]


@dataclass(frozen=True)
class LocalLosses:
    """This rank's loss terms of the step: the LM loss sum over its target tokens, the aux loss
    (weighted) and its balance and z parts (unweighted), each a mean over the micro-batches (and
    the ranks with aux_loss_scope=local), and the expert assignments kept (for the FLOPs)."""

    lm_sum: float
    aux: float
    balance: float
    z: float
    kept: float


def kept_assignments(model: M6Model, like: torch.Tensor) -> torch.Tensor:
    """float64 [1]: assignments of this micro-batch's tokens that reached an expert, summed over
    the MoE layers (MoEStats.kept of the last forward), on ``like``'s device: no host sync.
    float64 holds the count exactly (below 2**53)."""
    kept = like.new_zeros(1, dtype=torch.float64)
    for layer in model.moe_layers().values():
        kept = kept + layer.stats.kept
    return kept


class StepLosses:
    """The loss terms of a step's micro-batches, kept on the device and read in one host sync."""

    def __init__(self, model: M6Model) -> None:
        self.model = model
        self._parts: list[torch.Tensor] = []  # per micro-batch: lm sum, aux, balance, z, kept

    def add(self, lm_sum: torch.Tensor, aux: torch.Tensor) -> None:
        self._parts.append(torch.cat([moe_loss_terms(self.model, lm_sum, aux), kept_assignments(self.model, lm_sum)]))

    def read(self, accumulation: int, aux_ranks: int, all_reduce_sum: AllReduceSum) -> LocalLosses:
        """The step's one host sync; aux_loss_scope=local (``aux_ranks`` > 1): the aux terms'
        mean over ranks, as trained (one more all-reduce)."""
        return local_losses(torch.stack(self._parts).sum(0).tolist(), accumulation, aux_ranks, all_reduce_sum)


def local_losses(sums: list[float], accumulation: int, aux_ranks: int, all_reduce_sum: AllReduceSum) -> LocalLosses:
    """LocalLosses from the step's [lm sum, aux, balance, z, kept] summed over its micro-batches;
    aux_loss_scope=local (``aux_ranks`` > 1): the aux terms' mean over ranks (one more all-reduce)."""
    lm_sum, aux_sum, balance_sum, z_sum, kept = sums
    aux, balance, z = aux_sum / accumulation, balance_sum / accumulation, z_sum / accumulation
    if aux_ranks > 1:
        aux, balance, z = (v / aux_ranks for v in all_reduce_sum([aux, balance, z]))
    return LocalLosses(lm_sum, aux, balance, z, kept)


@dataclass(frozen=True)
class StepTotals:
    """The step's scalars summed over all ranks."""

    lm_sum: float
    flops: float  # model FLOPs (m6.model.flops.step_flops)
    tokens: float  # real (non-padding) tokens
    new_skips: int  # records the loader skipped this step
    # ranks whose gradient norm is not finite, over the tp x pp copies the sum divides by (a tp
    # rank alone with an inf in its own shard still counts 1: a share of a copy is rounded up)
    overflow_ranks: int
    inter_node_bytes: float  # this step's, forward and backward; 0 inside one node
    rank_compute_s: list[float]  # per rank (m6.train.compute_timer); [] where not measured


class StepReduction:
    """The step's one scalar all-reduce, and the running count of inter-node bytes it takes this
    step's share of (the dispatchers count from the start of the run)."""

    def __init__(self, model: M6Model, flop_rates: ForwardFlopRates, patches_per_image: int) -> None:
        self.model, self.flop_rates, self.patches = model, flop_rates, patches_per_image
        self._inter_node_last = 0.0  # the dispatchers' count at the last step's end

    def _dispatchers(self) -> list[AllToAllDispatcher]:
        return [m.dispatcher for m in self.model.modules()
                if isinstance(m, MoELayer) and isinstance(m.dispatcher, AllToAllDispatcher)]

    @property
    def has_expert_exchange(self) -> bool:
        """Whether any MoE layer exchanges tokens across ranks (inter_node_mb is then logged)."""
        return bool(self._dispatchers())

    def reduce(self, all_reduce_sum: AllReduceSum, loaded: Sequence[LoadedItem], local: LocalLosses, new_skips: int,
               grad_norm: float, rank_compute_s: list[float]) -> StepTotals:
        """Sum the step's scalars over ranks (``all_reduce_sum``: one collective) from this rank's
        ``loaded`` micro-batches, losses, skipped records, gradient norm and compute seconds."""
        # Counted from the host copies of the batches: no device sync inside the micro-batch loop.
        counts = sum((count_tokens(lb.batch.segment_ids, lb.batch.has_image, self.patches, lb.batch.num_target_tokens)
                      for lb in loaded), TokenCounts())
        tokens = sum(lb.real_tokens for lb in loaded)
        inter_node = float(sum(d.inter_node_bytes for d in self._dispatchers()))
        lm_sum, flops, tokens, skips, overflow, inter_node_step, *compute_s = all_reduce_sum(
            [local.lm_sum, step_flops(self.flop_rates, counts, local.kept), float(tokens), float(new_skips),
             float(not math.isfinite(grad_norm)), inter_node - self._inter_node_last, *rank_compute_s])
        self._inter_node_last = inter_node
        return StepTotals(lm_sum, flops, tokens, int(skips), math.ceil(overflow), inter_node_step, compute_s)
