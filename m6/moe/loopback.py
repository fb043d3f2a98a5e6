"""A stand-in for the expert-parallel dispatcher when one rank's compute is timed without its
peers: the planner on this host (``--gpu cpu``, m6.plan.timing) and ``parallel.balance: auto`` at
expert parallelism (m6.parallel.speed_probe). The all-to-all is skipped, everything the rank
computes around it is kept.

Under the planner's balance assumption a rank receives as many rows as it sends, so the rows it
sends stand in for the rows it receives: they are cast to the wire dtype, regrouped by local
expert as m6.moe.all_to_all.AllToAllDispatcher regroups received rows, run through this rank's
experts (E / EP of them) and sent back the same way. Shapes: T tokens, N kept assignments, D
d_model, R expert-parallel ranks, L local experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from m6.moe.dispatch import (Dispatcher, DispatchPlan, KeptAssignments, combine_tokens, group_received, host_ints,
                             permute_tokens, ungroup)


Sync = Callable[[], None]


class _SyncInBackward(torch.autograd.Function):
    """Identity whose backward waits at ``sync`` first: an exchange of the backward pass."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sync: Sync) -> torch.Tensor:
        ctx.sync = sync
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.sync()
        return grad, None


def sync_in_backward(x: torch.Tensor, sync: Optional[Sync]) -> torch.Tensor:
    return x if sync is None or not x.requires_grad else _SyncInBackward.apply(x, sync)


@dataclass
class LoopbackHandle:
    kept: KeptAssignments
    local_order_N: torch.Tensor
    wire_dtype: torch.dtype


class LoopbackDispatcher(Dispatcher):
    """AllToAllDispatcher's local work (permute, wire cast, regroup, send back, combine) with the
    exchange replaced by the identity: for timing one rank, never for training."""

    def __init__(self, num_experts: int, expert_parallel_size: int, a2a_dtype: Optional[torch.dtype],
                 sync: Optional[Sync] = None) -> None:
        """``sync``: called where the real dispatcher's exchanges make the ranks wait for each
        other (counts and payload in dispatch, payload in combine, and both payloads again in
        backward), so ranks profiled together keep the run's lockstep (m6.plan.timing)."""
        self.R, self.L = expert_parallel_size, num_experts // expert_parallel_size
        self.a2a_dtype = a2a_dtype
        self.sync = sync

    def dispatch(self, x_TD: torch.Tensor, plan: DispatchPlan) -> tuple[torch.Tensor, list[int], LoopbackHandle]:
        """[T, D] -> [N, D] rows grouped by local expert, rows per local expert, handle."""
        (counts,) = host_ints(plan.counts_E)  # the counts exchange's host sync
        kept = plan.kept(sum(counts))
        wire = self.a2a_dtype or x_TD.dtype
        x_ND = permute_tokens(x_TD, kept).to(wire)
        if self.sync is not None:
            self.sync()  # the counts exchange
            self.sync()  # the payload exchange
            x_ND = sync_in_backward(x_ND, self.sync)  # its backward: the gradients' exchange
        counts_RL = plan.counts_E.view(self.R, self.L)  # what this rank sends is what it receives
        x_local, order_N = group_received(x_ND, counts_RL, x_TD.dtype)
        splits = [sum(counts[r * self.L + e] for r in range(self.R)) for e in range(self.L)]
        return x_local, splits, LoopbackHandle(kept, order_N, wire)

    def combine(self, y_ND: torch.Tensor, handle: LoopbackHandle, out_dtype: torch.dtype) -> torch.Tensor:
        """Rows back to their order (and through the wire dtype), weighted and summed per token."""
        y_sent = ungroup(y_ND, handle.local_order_N, handle.wire_dtype)
        if self.sync is not None:
            self.sync()  # the payload's way back
            y_sent = sync_in_backward(y_sent, self.sync)
        return combine_tokens(y_sent, handle.kept, out_dtype)
