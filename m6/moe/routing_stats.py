"""Routing-statistics reducers: how the balance statistics of one batch are totalled before the
auxiliary losses are formed, for this process alone or summed over a data-parallel group.

The MoE layer hands its reducer the statistics as sums (not means), so adding them up across ranks
gives the statistics of the global batch, and the aux losses then do not depend on how the batch is
split over processes (aux_loss_scope=global).

Shape legend: E experts.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

RoutingSums = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@runtime_checkable
class RoutingStatsReducer(Protocol):
    """What ``MoELayer.stats_reducer`` must be: a callable that totals one batch's routing sums.

    ``reducer(counts_E, prob_sum_E, z_sum, num_tokens) -> (counts_E, prob_sum_E, z_sum, num_tokens)``
    with counts_E int64 [E] assignments routed per expert, prob_sum_E [E] router probabilities
    summed over tokens (differentiable), z_sum [] summed z-loss terms (differentiable) and
    num_tokens [] routed tokens in the probabilities' dtype; it returns the same four, totalled over
    its scope, in the same dtypes. Gradients must flow only through this process's own
    prob_sum_E and z_sum. A reducer that communicates issues the same collective on every rank.
    """

    def __call__(self, counts_E: torch.Tensor, prob_sum_E: torch.Tensor, z_sum: torch.Tensor,
                 num_tokens: torch.Tensor) -> RoutingSums:
        ...


class LocalRoutingStats(RoutingStatsReducer):
    """Routing statistics of this process only (aux_loss_scope=local, or a single process)."""

    def __call__(self, counts_E: torch.Tensor, prob_sum_E: torch.Tensor, z_sum: torch.Tensor,
                 num_tokens: torch.Tensor) -> RoutingSums:
        return counts_E, prob_sum_E, z_sum, num_tokens


class GlobalRoutingStats(RoutingStatsReducer):
    """Sums the routing statistics over all ranks of ``group`` (the data-parallel ranks) before the
    aux losses are formed.

    Gradients still flow only through this rank's own probabilities: the other ranks' part is a
    constant, so summing gradients over ranks gives exactly the gradient of the global loss.
    """

    def __init__(self, group) -> None:
        self.group = group

    def __call__(self, counts_E: torch.Tensor, prob_sum_E: torch.Tensor, z_sum: torch.Tensor,
                 num_tokens: torch.Tensor) -> RoutingSums:
        E = counts_E.shape[0]
        # One all-reduce for all four: the counts travel in the probabilities' float dtype and are
        # rounded back (exact while a count stays below 2**24 in fp32).
        packed = torch.cat([counts_E.to(prob_sum_E.dtype), prob_sum_E.detach(), z_sum.detach().view(1),
                            num_tokens.to(prob_sum_E.dtype).view(1)])
        dist.all_reduce(packed, group=self.group)
        counts = packed[:E].round().to(counts_E.dtype)
        prob_sum = prob_sum_E + (packed[E:2 * E] - prob_sum_E.detach())
        z = z_sum + (packed[2 * E] - z_sum.detach())
        return counts, prob_sum, z, packed[2 * E + 1]
