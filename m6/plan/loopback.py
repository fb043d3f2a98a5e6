"""A stand-in for the expert-parallel dispatcher when the planner times one rank's compute on
this host (``--gpu cpu``) without a process group: the all-to-all is skipped, everything the rank
computes around it is kept.

Under the planner's balance assumption a rank receives as many rows as it sends, so the rows it
sends stand in for the rows it receives: they are cast to the wire dtype, regrouped by local
expert as m6.moe.all_to_all.AllToAllDispatcher regroups received rows, run through this rank's
experts (E / EP of them) and sent back the same way. Shapes: T tokens, N kept assignments, D
d_model, R expert-parallel ranks, L local experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from m6.moe.dispatch import Dispatcher, DispatchPlan, KeptAssignments, combine_tokens, host_ints, permute_tokens


@dataclass
class LoopbackHandle:
    kept: KeptAssignments
    local_order_N: torch.Tensor
    wire_dtype: torch.dtype


class LoopbackDispatcher(Dispatcher):
    """AllToAllDispatcher's local work (permute, wire cast, regroup, send back, combine) with the
    exchange replaced by the identity: for timing one rank, never for training."""

    def __init__(self, num_experts: int, expert_parallel_size: int, a2a_dtype: Optional[torch.dtype]) -> None:
        self.R, self.L = expert_parallel_size, num_experts // expert_parallel_size
        self.a2a_dtype = a2a_dtype

    def dispatch(self, x_TD: torch.Tensor, plan: DispatchPlan) -> tuple[torch.Tensor, list[int], LoopbackHandle]:
        """[T, D] -> [N, D] rows grouped by local expert, rows per local expert, handle."""
        (counts,) = host_ints(plan.counts_E)  # the counts exchange's host sync
        kept = plan.kept(sum(counts))
        wire = self.a2a_dtype or x_TD.dtype
        x_ND = permute_tokens(x_TD, kept).to(wire)
        counts_RL = plan.counts_E.view(self.R, self.L)  # what this rank sends is what it receives
        local_expert_N = torch.repeat_interleave(torch.arange(self.L, device=x_TD.device).repeat(self.R),
                                                 counts_RL.reshape(-1), output_size=x_ND.shape[0])
        order_N = torch.argsort(local_expert_N, stable=True)
        x_local = x_ND.index_select(0, order_N).to(x_TD.dtype)
        splits = [sum(counts[r * self.L + e] for r in range(self.R)) for e in range(self.L)]
        return x_local, splits, LoopbackHandle(kept, order_N, wire)

    def combine(self, y_ND: torch.Tensor, handle: LoopbackHandle, out_dtype: torch.dtype) -> torch.Tensor:
        """Rows back to their order (and through the wire dtype), weighted and summed per token."""
        y_sent = torch.empty_like(y_ND).index_copy(0, handle.local_order_N, y_ND).to(handle.wire_dtype)
        return combine_tokens(y_sent, handle.kept, out_dtype)
