"""Token permutation for expert computation: sort assignments by expert, drop over capacity, combine;
and the Dispatcher protocol that every dispatcher (local or expert-parallel) implements.

No one-hot [tokens, experts, capacity] tensors: everything is argsort + gather + index_add, so the
cost grows with the number of assignments, not with the number of experts. The combine and the
expert-parallel reordering are autograd Functions that keep only what their backward reads (the
index, the expert outputs once, the weights), not the [N, D] rows autograd's index_add and
index_copy would keep.

Host syncs: planning is all on the device; the only copy to the host is the split sizes
(``host_ints``, at most once per layer forward), which the loop of expert GEMMs, the capacity
limit's kept count and the all-to-all need as ints. A dropless plan has a row count the host knows,
T*K: the kept assignments, then those of padding tokens with combine weight 0. The local dispatcher
moves all of them, and the grouped_mm and fused kernels take the rows per expert as a device tensor
and compute only the kept rows (the padding tail costs a gather and a zero, no GEMM work): that
layer forward has no host sync at all.

Shape legend: T tokens, D d_model, E experts, K assignments per token, A = T*K assignments, G routing
groups, N kept assignments (in the Dispatcher protocol: the rows handed to this process's experts); for a
receiver of an expert-parallel exchange: M rows received, S source ranks, L local experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, runtime_checkable

import torch


def expert_capacity(
    num_tokens: int, num_assignments: int, num_experts: int, capacity_factor: float, min_capacity: int
) -> int:
    """Slots per expert for a routing group of ``num_tokens`` real tokens:
    ceil(capacity_factor * T * K / E), at least min_capacity."""
    slots = capacity_factor * num_tokens * num_assignments / num_experts
    # Round away float noise first: 1.1 * 50 is 55.000000000000007 in binary, and must give 55.
    return max(min_capacity, math.ceil(round(slots, 6)))


def group_capacity(tokens_G: torch.Tensor, num_assignments: int, num_experts: int, capacity_factor: float,
                   min_capacity: int) -> torch.Tensor:
    """``expert_capacity`` for every routing group at once, on the device (no host sync):
    tokens_G int64 [G] real tokens per group -> int64 [G] slots per expert in that group."""
    slots = tokens_G.to(torch.float64) * (capacity_factor * num_assignments / num_experts)
    return torch.round(slots, decimals=6).ceil().to(torch.int64).clamp_min(min_capacity)


def host_ints(*tensors: torch.Tensor) -> list[list[int]]:
    """THE host sync of a MoE layer: copies small integer tensors (split sizes) to the host in one
    transfer. Every value the host must know (how many rows each expert and each rank get) goes
    through here once per layer forward; the rest of routing and dispatch stays on the device."""
    flat = torch.cat([t.reshape(-1) for t in tensors]).tolist()
    out, start = [], 0
    for t in tensors:
        out.append(flat[start:start + t.numel()])
        start += t.numel()
    return out


def _count(keys_A: torch.Tensor, num_keys: int) -> torch.Tensor:
    """int64 [num_keys] occurrences of each key in keys_A. scatter_add, not bincount: bincount on
    CUDA reads the maximum back to the host to size its output."""
    return torch.zeros(num_keys, dtype=torch.int64, device=keys_A.device).scatter_add_(
        0, keys_A, torch.ones_like(keys_A))


@dataclass(frozen=True)
class KeptAssignments:
    """The kept assignments of a plan, once the host knows how many there are (N).

    token_idx_N: int64 [N] input row of each kept assignment, grouped by expert.
    weights_N:   [N] its combine weight (differentiable).
    num_tokens:  rows of the input and of the combined output.
    """

    token_idx_N: torch.Tensor
    weights_N: torch.Tensor
    num_tokens: int


@dataclass(frozen=True)
class DispatchPlan:
    """Which assignments reach which expert (built once by ``plan_dispatch``, on the device, with
    no host sync; never edited afterwards).

    order_A:           int64 [A = T*K] flat assignment indices: the kept ones first, grouped by
                       expert; after them those dropped by capacity and those of unrouted tokens.
    weights_A:         [A] combine weight of every assignment (differentiable), in flat order.
    counts_E:          int64 [E] kept assignments per expert (N = counts_E.sum()).
    routed_counts_E:   int64 [E] assignments of routed tokens per expert before capacity.
    num_tokens:        T, the number of rows of the input and of the combined output.
    num_assignments:   K, assignments per token.
    num_rows:          A when the host may dispatch every assignment without reading the counts
                       (dropless): the kept ones grouped by expert, then the unrouted ones, whose
                       weights_A entries are 0; None where the kept count must be read (capacity).
    """

    order_A: torch.Tensor
    weights_A: torch.Tensor
    counts_E: torch.Tensor
    routed_counts_E: torch.Tensor
    num_tokens: int
    num_assignments: int
    num_rows: Optional[int] = None

    @property
    def num_dropped(self) -> torch.Tensor:
        """Assignments removed by the capacity limit (0-dim int64 tensor, no host sync)."""
        return self.routed_counts_E.sum() - self.counts_E.sum()

    def kept(self, num_kept: int) -> KeptAssignments:
        """The first ``num_kept`` (= N, known on the host from the counts) assignments of the order."""
        order_N = self.order_A[:num_kept]
        return KeptAssignments(order_N // self.num_assignments, self.weights_A.index_select(0, order_N),
                               self.num_tokens)


def plan_dispatch(
    expert_ids_TK: torch.Tensor, weights_TK: torch.Tensor, num_experts: int,
    capacity: torch.Tensor | int | None, *, routed_T: torch.Tensor | None = None, group_size: int | None = None,
) -> DispatchPlan:
    """Group assignments by expert; with a capacity, keep each expert's highest-weight ones in
    every routing group.

    Routing groups (GShard) are runs of ``group_size`` consecutive tokens (default: all T tokens,
    one group); ``capacity`` is an int (every group) or int64 [G] slots per expert in each group,
    None for dropless. Capacity decided per group does not depend on how many groups one process
    holds, so it does not change with the world size or the micro-batch size.

    Over-capacity assignments are dropped lowest router weight first (ties: earlier token first),
    not by position in the batch, so a token late in the sequence is not penalised for its place.

    ``routed_T`` (bool [T], True = route this token) leaves the other tokens' assignments out:
    they take no capacity, are not counted, and their rows get zeros in the combine.
    """
    T, K = expert_ids_TK.shape
    E, A = num_experts, T * K
    flat_ids = expert_ids_TK.reshape(-1)
    weights_A = weights_TK.reshape(-1)
    if routed_T is not None:
        # Unrouted tokens' assignments get key E: past every expert, they sort to the end. Their
        # combine weight is an exact 0 (where, not a multiply: whatever the router gave), so a
        # dispatcher may move them too (num_rows) and their rows add nothing.
        routed_A = routed_T.reshape(T, 1).expand(T, K).reshape(-1)
        flat_ids = torch.where(routed_A, flat_ids, torch.full_like(flat_ids, E))
        weights_A = torch.where(routed_A, weights_A, 0.0)
    routed_counts_E = _count(flat_ids, E + 1)[:E]
    if capacity is None:
        order_A = torch.argsort(flat_ids, stable=True)
        counts_E = routed_counts_E
    else:
        group_size = T if group_size is None else group_size
        if group_size <= 0 or T % group_size:
            raise ValueError(f"plan_dispatch: {T} tokens do not split into routing groups of {group_size}")
        G = T // group_size
        group_A = torch.arange(A, device=flat_ids.device) // (group_size * K)
        # Segments (expert, group), unrouted last. Two stable sorts, by weight (descending) then by
        # segment: inside each segment the assignments run from the highest weight down, so
        # "rank in segment < capacity" keeps the best.
        segment_A = flat_ids * G + group_A
        by_weight = torch.argsort(weights_TK.detach().reshape(-1), descending=True, stable=True)
        by_segment = by_weight[torch.argsort(segment_A[by_weight], stable=True)]
        seg_counts = _count(segment_A, (E + 1) * G)
        seg_starts = torch.cumsum(seg_counts, 0) - seg_counts
        rank_in_segment = torch.arange(A, device=flat_ids.device) - seg_starts[segment_A[by_segment]]
        capacity_A = (capacity if isinstance(capacity, int)
                      else capacity.index_select(0, group_A[by_segment]))
        kept = (rank_in_segment < capacity_A) & (flat_ids[by_segment] < E)
        # Compact: kept ones first (already in expert order), then the rest; a scatter, not a sort.
        kept_rank = torch.cumsum(kept, 0) - 1
        rest_rank = torch.cumsum(~kept, 0) - 1 + kept.sum()
        order_A = torch.empty_like(by_segment).scatter_(0, torch.where(kept, kept_rank, rest_rank), by_segment)
        counts_E = _count(torch.where(kept, flat_ids[by_segment], torch.full_like(flat_ids, E)), E + 1)[:E]
    return DispatchPlan(order_A=order_A, weights_A=weights_A, counts_E=counts_E, routed_counts_E=routed_counts_E,
                        num_tokens=T, num_assignments=K, num_rows=A if capacity is None else None)


class _GatherRowsCast(torch.autograd.Function):
    """x_TD [T, D] -> x_TD.to(dtype)[idx_N] [N, D]: the cast on the T token rows before the gather
    (N = T*K rows written in ``dtype`` only, instead of N rows in x's dtype and then N casts); the
    backward sums each token's K row gradients in x's dtype, as the gather-then-cast did."""

    @staticmethod
    def forward(ctx, x_TD, idx_N, dtype):
        ctx.save_for_backward(idx_N)
        ctx.num_tokens, ctx.x_dtype = x_TD.shape[0], x_TD.dtype
        return x_TD.to(dtype).index_select(0, idx_N)

    @staticmethod
    def backward(ctx, dx_ND):
        (idx_N,) = ctx.saved_tensors
        dx_TD = dx_ND.new_zeros((ctx.num_tokens, dx_ND.shape[-1]), dtype=ctx.x_dtype)
        return dx_TD.index_add_(0, idx_N, dx_ND.to(ctx.x_dtype)), None, None


def permute_tokens(x_TD: torch.Tensor, kept: KeptAssignments, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """[T, D] -> [N, D] rows in expert order, in ``dtype`` (default x's); backward is a scatter-add
    into the token rows in x's dtype."""
    if dtype is None or dtype == x_TD.dtype:
        return x_TD.index_select(0, kept.token_idx_N)
    return _GatherRowsCast.apply(x_TD, kept.token_idx_N, dtype)


class _WeightedRowSum(torch.autograd.Function):
    """out[r] = sum of w_n * y_n (w_n = 1 without weights) over the rows n with idx_N[n] = r,
    accumulated in ``acc_dtype``, returned in ``out_dtype``. Autograd of the plain
    ``zeros.index_add(idx, y * w)`` would keep the weighted [N, D] copy in ``acc_dtype`` (index_add
    saves its source) beside y (the multiply's); this keeps y as given only where the weights need
    a gradient, the weights and the index. The backward computes what that autograd graph computes,
    op for op, so the gradients are bitwise the same: g = dout.to(acc); dweighted = g[idx];
    dy = (dweighted * w).to(y's dtype); dw = (dweighted * y).sum(-1) (as autograd reduces a
    broadcast operand's gradient)."""

    @staticmethod
    def forward(ctx, y_ND, weights_N, idx_N, num_rows, acc_dtype, out_dtype):
        if weights_N is None:
            weighted_ND = y_ND.to(acc_dtype)
        else:
            weighted_ND = y_ND * weights_N.to(acc_dtype).unsqueeze(-1)
        out = weighted_ND.new_zeros(num_rows, y_ND.shape[-1]).index_add(0, idx_N, weighted_ND)
        keep_y = weights_N is not None and ctx.needs_input_grad[1]
        ctx.save_for_backward(y_ND if keep_y else None, weights_N, idx_N)
        ctx.acc_dtype, ctx.y_dtype = acc_dtype, y_ND.dtype
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx, dout):
        y_ND, weights_N, idx_N = ctx.saved_tensors
        dweighted_ND = dout.to(ctx.acc_dtype).index_select(0, idx_N)
        dy = dw = None
        if ctx.needs_input_grad[0]:
            dy = dweighted_ND if weights_N is None else dweighted_ND * weights_N.to(ctx.acc_dtype).unsqueeze(-1)
            dy = dy.to(ctx.y_dtype)
        if ctx.needs_input_grad[1]:
            dw = (dweighted_ND * y_ND).sum(-1, keepdim=True).squeeze(-1).to(weights_N.dtype)
        return dy, dw, None, None, None, None


def sum_rows(y_ND: torch.Tensor, idx_N: torch.Tensor, num_rows: int, acc_dtype: torch.dtype,
             out_dtype: torch.dtype, weights_N: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[N, D] -> [num_rows, D]: row n (times ``weights_N[n]``, where given) added into row
    ``idx_N[n]``, in ``acc_dtype``, returned in ``out_dtype``. For the backward it keeps the index,
    the weights and (where the weights need a gradient) y itself: never the [N, D] rows in
    ``acc_dtype`` that a plain ``index_add`` would keep. Gradients bitwise as that plain graph's."""
    return _WeightedRowSum.apply(y_ND, weights_N, idx_N, num_rows, acc_dtype, out_dtype)


def combine_tokens(y_ND: torch.Tensor, kept: KeptAssignments, out_dtype: torch.dtype) -> torch.Tensor:
    """Weighted sum of expert outputs back into token order: [N, D] -> [T, D].

    Accumulates in at least fp32 (router weights are fp32) so low-precision expert outputs of a
    token's K experts are summed without extra rounding; tokens with every assignment dropped get 0.
    The multiply promotes y as it reads it (no [N, D] copy of y in the accumulation dtype), and
    for the backward only y itself (its dtype), the weights and the index are kept: not the
    weighted [N, D] rows in the accumulation dtype (``sum_rows``).
    """
    acc_dtype = torch.promote_types(y_ND.dtype, kept.weights_N.dtype)
    return sum_rows(y_ND, kept.token_idx_N, kept.num_tokens, acc_dtype, out_dtype, kept.weights_N)


def local_expert_order(counts_SL: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int64 [M]: rows that arrive grouped [source][local expert], ``counts_SL`` [S, L] of them
    (on the device), reordered by local expert (stable: source order inside an expert).
    ``num_rows`` (= counts_SL.sum(), known on the host) spares repeat_interleave a host sync."""
    S, L = counts_SL.shape
    local_expert_M = torch.repeat_interleave(torch.arange(L, device=counts_SL.device).repeat(S),
                                             counts_SL.reshape(-1), output_size=num_rows)
    return torch.argsort(local_expert_M, stable=True)


def group_received(x_MD: torch.Tensor, counts_SL: torch.Tensor, compute_dtype: torch.dtype | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """What a receiver does with the rows of an exchange (every expert-parallel dispatcher, and
    the loopback stand-in): [M, D] rows in arrival order [source][local expert] -> (the rows
    grouped by local expert and cast to ``compute_dtype`` (None: kept as received), the
    permutation used, for ``ungroup``)."""
    order_M = local_expert_order(counts_SL, x_MD.shape[0])
    x_local = x_MD.index_select(0, order_M)
    return (x_local if compute_dtype is None else x_local.to(compute_dtype)), order_M


class _ScatterRows(torch.autograd.Function):
    """out[order_M[m]] = y_MD[m] for a permutation ``order_M``; the backward gathers the output
    gradient at the same index (as index_copy's does), keeping only the index, not y (autograd's
    index_copy keeps its source for nothing but its shape)."""

    @staticmethod
    def forward(ctx, y_MD, order_M):
        ctx.save_for_backward(order_M)
        return torch.empty_like(y_MD).index_copy(0, order_M, y_MD)

    @staticmethod
    def backward(ctx, dout_MD):
        (order_M,) = ctx.saved_tensors
        return dout_MD.index_select(0, order_M), None


def ungroup(y_MD: torch.Tensor, order_M: torch.Tensor, wire_dtype: torch.dtype) -> torch.Tensor:
    """``group_received`` undone for the experts' outputs: [M, D] grouped by local expert -> arrival
    order, in ``wire_dtype``, ready for the exchange back. Keeps only the order for the backward."""
    return _ScatterRows.apply(y_MD, order_M).to(wire_dtype)


@runtime_checkable
class Dispatcher(Protocol):
    """Moves routed tokens to the experts of this process and their outputs back (the MoE layer's
    dispatch and combine phases), whatever the experts' placement.

    Contract:
    - ``dispatch(x_TD, plan) -> (x_ND, splits, handle)``: ``x_ND`` holds the rows for this
      process's experts, grouped by local expert (all rows of local expert 0, then of expert 1, ...);
      ``splits[e]`` is the number of rows of local expert e as host ints (one per local expert,
      summing to N), ready for ``GroupedExperts``.
    - ``handle`` is opaque to the layer: it only passes it back to ``combine`` of the same dispatcher.
    - ``combine(y_ND, handle, out_dtype) -> y_TD``: expert outputs (rows as dispatched) back in
      token order, ``plan.num_tokens`` rows, weighted by the router and summed over each token's
      assignments, in ``out_dtype``; a token with no kept assignment gets zeros.
    - Both calls are autograd-aware; a dispatcher that communicates issues the same collectives in
      the same order on every rank whatever the routing.
    """

    def dispatch(self, x_TD: torch.Tensor, plan: DispatchPlan) -> tuple[torch.Tensor, list[int], Any]:
        """[T, D] tokens -> ([N, D] rows grouped by local expert, rows per local expert, handle)."""
        ...

    def combine(self, y_ND: torch.Tensor, handle: Any, out_dtype: torch.dtype) -> torch.Tensor:
        """[N, D] expert outputs -> [T, D] router-weighted sum per token, in ``out_dtype``."""
        ...

    def dispatch_compute_combine(self, x_TD: torch.Tensor, plan: DispatchPlan,
                                 experts: Callable[[torch.Tensor, list[int]], torch.Tensor],
                                 out_dtype: torch.dtype) -> torch.Tensor:
        """The layer's three middle phases: dispatch, ``experts(x_ND, splits)``, combine. A
        dispatcher that overlaps its exchanges with the expert compute (chunked all-to-all)
        overrides this; the result must equal these three calls. (An override may hand the experts
        their rows per expert as a device tensor where they take one: ``LocalDispatcher``.)"""
        x_ND, splits, handle = self.dispatch(x_TD, plan)
        return self.combine(experts(x_ND, splits), handle, out_dtype)


class LocalDispatcher(Dispatcher):
    """Dispatcher for experts that all live in this process (expert-parallel size 1).

    The expert-parallel dispatcher (m6.moe.all_to_all) implements the same protocol and adds the
    all-to-all in between, so the MoE layer reads route -> dispatch -> experts -> combine whichever
    is installed. The handle is the plan's kept assignments.
    """

    def dispatch(
        self, x_TD: torch.Tensor, plan: DispatchPlan
    ) -> tuple[torch.Tensor, list[int], KeptAssignments]:
        """Tokens for the local experts, grouped by expert, with their per-expert counts on host
        (the layer's one host sync)."""
        (splits,) = host_ints(plan.counts_E)
        kept = plan.kept(sum(splits))
        return permute_tokens(x_TD, kept, _autocast_dtype(x_TD)), splits, kept

    def combine(self, y_ND: torch.Tensor, handle: KeptAssignments, out_dtype: torch.dtype) -> torch.Tensor:
        """Expert outputs back to token order, weighted by the router."""
        return combine_tokens(y_ND, handle, out_dtype)

    def dispatch_compute_combine(self, x_TD: torch.Tensor, plan: DispatchPlan,
                                 experts: Callable[[torch.Tensor, list[int]], torch.Tensor],
                                 out_dtype: torch.dtype) -> torch.Tensor:
        """As the protocol's three calls; experts that fuse the gather and the weighted combine into
        their kernels (``fuses_dispatch``/``forward_routed``, m6.moe.experts with expert_kernel
        fused) get the routing instead of a permuted copy, and return the combined [T, D].

        Where the host knows the row count (``plan.num_rows``: dropless) and the experts take the
        rows per expert on the device (``takes_device_counts``: grouped_mm, fused), nothing is read
        back: no host sync in this layer forward. All A assignments are then moved; the padding
        tokens' ones (after the kept, past the experts' segments, weight 0) are computed by no
        GEMM and come back as zeros."""
        if on_device_counts(plan, experts, x_TD):
            splits, kept = plan.counts_E, plan.kept(plan.num_rows)
        else:
            (host_splits,) = host_ints(plan.counts_E)
            splits, kept = host_splits, plan.kept(sum(host_splits))
        fuses = getattr(experts, "fuses_dispatch", None)
        if fuses is not None and fuses(x_TD):
            return experts.forward_routed(x_TD, kept.token_idx_N, kept.weights_N, splits, out_dtype)
        return combine_tokens(experts(permute_tokens(x_TD, kept, _autocast_dtype(x_TD)), splits), kept, out_dtype)


def on_device_counts(plan: DispatchPlan, experts: Any, x_TD: torch.Tensor) -> bool:
    """Whether a local dispatch of ``plan`` to ``experts`` can skip the host sync: the host knows
    the row count, and the experts' kernel takes the rows per expert as a device tensor."""
    takes = getattr(experts, "takes_device_counts", None)
    return plan.num_rows is not None and takes is not None and takes(x_TD, plan.num_rows)


def _autocast_dtype(x_TD: torch.Tensor) -> Optional[torch.dtype]:
    """Under autocast the experts compute in its dtype: the rows are gathered in it already."""
    device_type = x_TD.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
