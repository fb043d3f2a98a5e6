"""Expert-parallel token dispatch: uneven all-to-all of expert-sorted tokens and back.

Shape legend: T tokens, D d_model, E global experts, R ranks in the expert-parallel group, L this
rank's local experts (E / R in the even layout; uneven layouts give rank r counts[r]), N kept
assignments sent by this rank, M rows received for local experts.

The process group is an argument (installed by m6.parallel), never looked up here. Every rank
issues the same collectives in the same order whatever the routing: one counts exchange and one
token exchange in dispatch, one token exchange in combine (zero-row splits are legal); with an
overlap degree C > 1 the token exchanges are cut into C chunks each (m6.moe.chunked_all_to_all).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Literal, Optional, Union

import torch
import torch.distributed as dist

from m6.moe.chunked_all_to_all import auto_overlap_degree, chunk_major_order, exchange_compute_exchange, plan_chunks
from m6.moe.dispatch import (Dispatcher, DispatchPlan, KeptAssignments, combine_tokens, group_received, host_ints,
                             permute_tokens, ungroup)

OverlapDegree = Union[int, Literal["auto"]]


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
class Splits:
    """Row counts of one dispatch, known on the host after the counts exchange."""

    recv_counts_RL: torch.Tensor  # int64 [R, L] on the device: rows from source rank r for local expert l
    send: list[int]  # rows this rank sends to each rank
    recv: list[int]  # rows this rank receives from each rank
    local_experts: list[int]  # rows for each local expert (all sources)


@dataclass
class AllToAllHandle:
    """What combine needs to send expert outputs back and weight them."""

    kept: KeptAssignments
    send_splits: list[int]  # rows this rank sent to each rank
    recv_splits: list[int]  # rows this rank received from each rank
    local_order_M: torch.Tensor  # received row -> position in the expert-grouped buffer
    wire_dtype: torch.dtype  # the payload's dtype on the wire, both ways


def wire_dtype(x: torch.Tensor, override: Optional[torch.dtype]) -> torch.dtype:
    """The payload dtype: ``override`` (config a2a_dtype) if set; else, under autocast, the
    compute dtype the experts would cast to anyway (sending fp32 LayerNorm outputs would move
    twice the bytes for nothing); else the tokens' own dtype."""
    if override is not None:
        return override
    if torch.is_autocast_enabled(x.device.type) and x.is_floating_point():
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def received_compute_dtype(x_TD: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype received rows are cast to before the experts: none under autocast (the experts
    cast to its dtype), else the tokens' own dtype (a compressed fp32 run computes in fp32 again)."""
    return None if torch.is_autocast_enabled(x_TD.device.type) else x_TD.dtype


class AllToAllDispatcher(Dispatcher):
    """Sends each kept assignment to the rank that owns its expert and brings the result back
    (the expert-parallel implementation of the Dispatcher protocol; M plays the protocol's N).

    Experts are laid out contiguously: rank r of the group owns ``counts[r]`` global experts from
    ``first[r] = counts[0] + ... + counts[r-1]`` on (even layout: counts[r] = E / R; parallel.balance
    gives slower ranks fewer, m6.parallel.expert_ranges).
    The payload travels in ``wire_dtype``: the autocast compute dtype by default, ``a2a_dtype``
    (e.g. torch.bfloat16) to compress an fp32 run's payload; the combine still accumulates in fp32.
    One host sync per forward: the split sizes, after the counts exchange.

    ``overlap_degree`` (model.moe.a2a_overlap_degree): 1 = one blocking exchange each way; C > 1 =
    the exchanges in C chunks overlapped with the expert compute (``dispatch_compute_combine``);
    "auto" = C from the sizes (``m6.moe.chunked_all_to_all.auto_overlap_degree`` of the largest
    row count any rank of the group sends, which rides along in the counts exchange so every rank
    picks the same C).
    """

    def __init__(self, group, num_experts: int, a2a_dtype: Optional[torch.dtype] = None,
                 overlap_degree: OverlapDegree = 1, rank_nodes: Optional[list[int]] = None,
                 counts: Optional[list[int]] = None) -> None:
        self.group = group
        self.group_size = dist.get_world_size(group)
        self.group_rank = dist.get_rank(group)
        # Node of each rank of the group (from m6.parallel's layout): what the inter-node count needs.
        self.rank_nodes = rank_nodes
        self.inter_node_bytes = 0  # payload bytes this rank has put on inter-node links (forward + backward)
        if counts is None:
            if num_experts % self.group_size:
                raise ValueError(f"num_experts ({num_experts}) must be divisible by the expert-parallel size "
                                 f"({self.group_size})")
            counts = [num_experts // self.group_size] * self.group_size
        if len(counts) != self.group_size or sum(counts) != num_experts or min(counts) < 1:
            raise ValueError(f"expert counts {counts} do not lay out {num_experts} experts over {self.group_size} "
                             f"expert-parallel ranks, at least one each")
        if overlap_degree != "auto" and (not isinstance(overlap_degree, int) or isinstance(overlap_degree, bool)
                                         or overlap_degree < 1):
            raise ValueError(f"overlap_degree (model.moe.a2a_overlap_degree) must be 'auto' or an integer >= 1, "
                             f"got {overlap_degree!r}")
        if overlap_degree != 1 and len(set(counts)) > 1:
            # The chunk plan cuts each destination's segment by the same L experts on every rank.
            raise ValueError(f"overlap_degree (model.moe.a2a_overlap_degree) {overlap_degree!r} needs the same number "
                             f"of experts on every expert-parallel rank, got {counts}")
        self.num_experts, self.counts = num_experts, list(counts)
        self.num_local = self.counts[self.group_rank]
        self.a2a_dtype = a2a_dtype
        self.overlap_degree = overlap_degree
        self.last_degree: Optional[int] = None  # the degree the last forward ran (auto resolves per call)

    def exchange_counts(self, plan: DispatchPlan, with_totals: bool = False
                        ) -> tuple[Splits, list[int], list[int], list[int]]:
        """The counts exchange and the layer's one host sync: how many rows go where. Rank r's
        experts are counts[r] consecutive entries of counts_E, so the per-expert counts travel as an
        uneven all-to-all of counts[r] values to rank r, L from each source back. Returns the splits
        and the host counts sent ([E], expert order: row-major [R, L] when every rank holds L) and
        received (row-major [R, L]); ``with_totals`` (even layouts: the overlap's auto degree): also
        the largest number of rows any rank of the group sends (one more column in the same exchange)."""
        R, L = self.group_size, self.num_local
        if with_totals:
            total = plan.counts_E.sum().view(1, 1).expand(R, 1)
            send_counts_RL = torch.cat([plan.counts_E.view(R, L), total], dim=1)
            recv_counts_RL = torch.empty_like(send_counts_RL)
            dist.all_to_all_single(recv_counts_RL, send_counts_RL.contiguous(), group=self.group)
            send_counts_RL, recv_counts_RL, totals_R = send_counts_RL[:, :L], recv_counts_RL[:, :L], recv_counts_RL[:, L]
            send, recv, totals = host_ints(send_counts_RL, recv_counts_RL, totals_R)
        else:
            recv_counts = plan.counts_E.new_empty(R * L)  # flat: the splits count entries of dim 0
            dist.all_to_all_single(recv_counts, plan.counts_E.contiguous(), [L] * R, self.counts, group=self.group)
            recv_counts_RL = recv_counts.view(R, L)
            (send, recv), totals = host_ints(plan.counts_E, recv_counts_RL), []
        bounds = [0, *accumulate(self.counts)]
        splits = Splits(
            recv_counts_RL=recv_counts_RL,
            send=[sum(send[bounds[r]:bounds[r + 1]]) for r in range(R)],
            recv=[sum(recv[r * L:(r + 1) * L]) for r in range(R)],
            local_experts=[sum(recv[r * L + e] for r in range(R)) for e in range(L)],
        )
        return splits, send, recv, totals

    def count_inter_node(self, splits: Splits, row_bytes: int) -> None:
        """Add one layer call's inter-node payload to ``inter_node_bytes``, counted from the split
        sizes: the dispatch rows sent to and the combine rows sent back to ranks of other nodes,
        and each again as gradients in backward (the reverse exchanges move the same rows)."""
        if self.rank_nodes is None:
            return
        me = self.rank_nodes[self.group_rank]
        rows = sum(s + r for s, r, node in zip(splits.send, splits.recv, self.rank_nodes) if node != me)
        self.inter_node_bytes += 2 * rows * row_bytes

    def dispatch(self, x_TD: torch.Tensor, plan: DispatchPlan) -> tuple[torch.Tensor, list[int], AllToAllHandle]:
        """Rows for this rank's local experts, grouped by local expert, and their counts."""
        return self.send_rows(x_TD, plan, self.exchange_counts(plan)[0])

    def send_rows(self, x_TD: torch.Tensor, plan: DispatchPlan, splits: Splits
                  ) -> tuple[torch.Tensor, list[int], AllToAllHandle]:
        """``dispatch`` once the counts are exchanged: the blocking token exchange."""
        kept = plan.kept(sum(splits.send))
        dtype = wire_dtype(x_TD, self.a2a_dtype)
        self.count_inter_node(splits, x_TD.shape[-1] * dtype.itemsize)
        x_ND = permute_tokens(x_TD, kept).to(dtype)  # grouped by global expert = by destination rank
        x_recv = all_to_all(x_ND, splits.recv, splits.send, self.group)
        x_local, local_order_M = group_received(x_recv, splits.recv_counts_RL, received_compute_dtype(x_TD))
        return x_local, splits.local_experts, AllToAllHandle(kept, splits.send, splits.recv, local_order_M, dtype)

    def send_back(self, y_local: torch.Tensor, handle: AllToAllHandle) -> torch.Tensor:
        """Expert outputs back to the ranks (and row order) they came from: [M, D] -> [N, D]."""
        y_recv = ungroup(y_local, handle.local_order_M, handle.wire_dtype)
        return all_to_all(y_recv, handle.send_splits, handle.recv_splits, self.group)

    def combine(self, y_local: torch.Tensor, handle: AllToAllHandle, out_dtype: torch.dtype) -> torch.Tensor:
        """Expert outputs back to their source ranks and token order, weighted by the router."""
        return combine_tokens(self.send_back(y_local, handle), handle.kept, out_dtype)

    def dispatch_compute_combine(self, x_TD: torch.Tensor, plan: DispatchPlan,
                                 experts: Callable[[torch.Tensor, list[int]], torch.Tensor],
                                 out_dtype: torch.dtype) -> torch.Tensor:
        """dispatch -> experts -> combine; with an overlap degree > 1 in chunks, each chunk's
        exchanges overlapping the expert compute of its neighbours (m6.moe.chunked_all_to_all)."""
        if self.overlap_degree == 1:
            self.last_degree = 1
            return super().dispatch_compute_combine(x_TD, plan, experts, out_dtype)
        auto = self.overlap_degree == "auto"
        splits, send_RL, recv_RL, totals = self.exchange_counts(plan, with_totals=auto)
        dtype = wire_dtype(x_TD, self.a2a_dtype)
        degree = auto_overlap_degree(max(totals), x_TD.shape[-1] * dtype.itemsize) if auto else self.overlap_degree
        self.last_degree = degree
        if degree == 1:
            # auto chose the blocking path: dispatch and combine, the counts already exchanged.
            x_ND, rows, handle = self.send_rows(x_TD, plan, splits)
            return self.combine(experts(x_ND, rows), handle, out_dtype)
        self.count_inter_node(splits, x_TD.shape[-1] * dtype.itemsize)
        chunks = plan_chunks(send_RL, recv_RL, self.group_size, self.num_local, degree)
        kept = plan.kept(sum(splits.send))
        # Rows in chunk-major order, so each chunk is one contiguous slice to send, and the
        # outputs that come back (in the same order) combine with the same reordered assignments.
        order = chunk_major_order(plan.counts_E.view(self.group_size, self.num_local), degree, len(kept.token_idx_N))
        kept = KeptAssignments(kept.token_idx_N.index_select(0, order), kept.weights_N.index_select(0, order),
                               kept.num_tokens)
        x_send = permute_tokens(x_TD, kept).to(dtype)
        y_send = exchange_compute_exchange(x_send, chunks, splits.recv_counts_RL, experts,
                                           received_compute_dtype(x_TD), self.group)
        return combine_tokens(y_send, kept, out_dtype)
