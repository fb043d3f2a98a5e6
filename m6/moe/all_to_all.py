"""Expert-parallel token dispatch: uneven all-to-all of expert-sorted tokens and back.

Shape legend: T tokens, D d_model, E global experts, L = E / R local experts, R ranks in the
expert-parallel group, N kept assignments sent by this rank, M rows received for local experts.

The process group is an argument (installed by m6.parallel), never looked up here. Every rank
issues the same collectives in the same order whatever the routing: one counts exchange and one
token exchange in dispatch, one token exchange in combine (zero-row splits are legal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from m6.moe.dispatch import Dispatcher, DispatchPlan, combine_tokens, permute_tokens


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its gradient is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Send rows ``in_splits[r]`` to rank r, receive ``out_splits[r]`` rows from rank r (autograd-aware)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


@dataclass
class AllToAllHandle:
    """What combine needs to send expert outputs back and weight them."""

    plan: DispatchPlan
    send_splits: list[int]  # rows this rank sent to each rank
    recv_splits: list[int]  # rows this rank received from each rank
    local_order_M: torch.Tensor  # received row -> position in the expert-grouped buffer
    payload_dtype: torch.dtype


class AllToAllDispatcher(Dispatcher):
    """Sends each kept assignment to the rank that owns its expert and brings the result back
    (the expert-parallel implementation of the Dispatcher protocol; M plays the protocol's N).

    Experts are laid out contiguously: rank r of the group owns global experts [r*L, (r+1)*L).
    ``a2a_dtype`` (e.g. torch.bfloat16) compresses the payload on the wire; the combine still
    accumulates in fp32.
    """

    def __init__(self, group, num_experts: int, a2a_dtype: Optional[torch.dtype] = None) -> None:
        self.group = group
        self.group_size = dist.get_world_size(group)
        if num_experts % self.group_size:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the expert-parallel size ({self.group_size})")
        self.num_experts = num_experts
        self.num_local = num_experts // self.group_size
        self.a2a_dtype = a2a_dtype

    def exchange_counts(self, plan: DispatchPlan) -> tuple[list[int], list[list[int]]]:
        """Rows this rank sends to each rank, and recv_counts[source rank][local expert]."""
        R, L = self.group_size, self.num_local
        send_counts_RL = plan.counts_E.view(R, L)
        recv_counts_RL = torch.empty_like(send_counts_RL)
        dist.all_to_all_single(recv_counts_RL, send_counts_RL.contiguous(), group=self.group)
        # One host copy of the split sizes: all_to_all_single needs them as Python ints.
        return send_counts_RL.sum(1).tolist(), recv_counts_RL.tolist()

    def local_order(self, recv_counts: list[list[int]], device) -> tuple[torch.Tensor, list[int]]:
        """Received rows arrive [source rank][local expert]: the permutation that groups them by
        local expert, and the rows per local expert."""
        R, L = self.group_size, self.num_local
        local_expert_M = torch.repeat_interleave(
            torch.arange(L, device=device).repeat(R),
            torch.tensor([c for row in recv_counts for c in row], device=device, dtype=torch.long),
        )
        splits = [sum(recv_counts[r][e] for r in range(R)) for e in range(L)]
        return torch.argsort(local_expert_M, stable=True), splits

    def dispatch(self, x_TD: torch.Tensor, plan: DispatchPlan) -> tuple[torch.Tensor, list[int], AllToAllHandle]:
        """Rows for this rank's local experts, grouped by local expert, and their counts."""
        send_splits, recv_counts = self.exchange_counts(plan)
        recv_splits = [sum(row) for row in recv_counts]
        payload_dtype = x_TD.dtype
        x_ND = permute_tokens(x_TD, plan)  # grouped by global expert = by destination rank
        if self.a2a_dtype is not None:
            x_ND = x_ND.to(self.a2a_dtype)
        x_recv = all_to_all(x_ND, recv_splits, send_splits, self.group)
        local_order_M, splits = self.local_order(recv_counts, x_TD.device)
        x_local = x_recv.index_select(0, local_order_M).to(payload_dtype)
        return x_local, splits, AllToAllHandle(plan, send_splits, recv_splits, local_order_M, payload_dtype)

    def send_back(self, y_local: torch.Tensor, handle: AllToAllHandle) -> torch.Tensor:
        """Expert outputs back to the ranks (and row order) they came from: [M, D] -> [N, D]."""
        y_recv = torch.empty_like(y_local).index_copy(0, handle.local_order_M, y_local)
        if self.a2a_dtype is not None:
            y_recv = y_recv.to(self.a2a_dtype)
        return all_to_all(y_recv, handle.send_splits, handle.recv_splits, self.group).to(handle.payload_dtype)

    def combine(self, y_local: torch.Tensor, handle: AllToAllHandle, out_dtype: torch.dtype) -> torch.Tensor:
        """Expert outputs back to their source ranks and token order, weighted by the router."""
        return combine_tokens(self.send_back(y_local, handle), handle.plan, out_dtype)
