"""Token permutation for expert computation: sort assignments by expert, drop over capacity, combine;
and the Dispatcher protocol that every dispatcher (local or expert-parallel) implements.

No one-hot [tokens, experts, capacity] tensors: everything is argsort + gather + index_add, so the
cost grows with the number of assignments, not with the number of experts.

Shape legend: T tokens, D d_model, E experts, K assignments per token, N kept assignments (in the
Dispatcher protocol: the rows handed to this process's experts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


def expert_capacity(
    num_tokens: int, num_assignments: int, num_experts: int, capacity_factor: float, min_capacity: int
) -> int:
    """Slots per expert: ceil(capacity_factor * T * K / E), at least min_capacity."""
    slots = capacity_factor * num_tokens * num_assignments / num_experts
    # Round away float noise first: 1.1 * 50 is 55.000000000000007 in binary, and must give 55.
    return max(min_capacity, math.ceil(round(slots, 6)))


@dataclass(frozen=True)
class DispatchPlan:
    """Where every kept assignment comes from and how it is combined back (built once by
    ``plan_dispatch``, never edited afterwards).

    token_idx_N:       int64 [N] row of the input (and of the combined output) that each kept
                       assignment comes from, grouped by expert.
    weights_N:         [N] combine weight of each kept assignment (differentiable).
    counts_E:          int64 [E] kept assignments per expert (the slice sizes for the experts).
    routed_counts_E:   int64 [E] assignments routed per expert before capacity was applied.
    num_tokens:        the number of rows of the input and of the combined output.
    """

    token_idx_N: torch.Tensor
    weights_N: torch.Tensor
    counts_E: torch.Tensor
    routed_counts_E: torch.Tensor
    num_tokens: int

    @property
    def num_dropped(self) -> torch.Tensor:
        """Assignments removed by the capacity limit (0-dim int64 tensor, no host sync)."""
        return self.routed_counts_E.sum() - self.counts_E.sum()


def plan_dispatch(
    expert_ids_TK: torch.Tensor, weights_TK: torch.Tensor, num_experts: int, capacity: int | None,
    *, token_rows: torch.Tensor | None = None, num_tokens: int | None = None,
) -> DispatchPlan:
    """Group assignments by expert; with a capacity, keep each expert's highest-weight ones.

    Over-capacity assignments are dropped lowest router weight first (ties: earlier token first),
    not by position in the batch, so a token late in the sequence is not penalised for its place.
    ``capacity=None`` is dropless.

    ``num_tokens`` is the number of input rows (default T). When only some of them were routed (a
    token mask), ``token_rows`` (int64, one per routed token, i.e. per row of expert_ids_TK) gives
    the input row of each; the plan then points at input rows, so unrouted rows are never gathered
    and get zeros in the combine. Without it routed token t is input row t.
    """
    T, K = expert_ids_TK.shape
    if token_rows is None and num_tokens not in (None, T):
        raise ValueError(f"plan_dispatch: num_tokens ({num_tokens}) differs from the {T} routed tokens: "
                         "pass token_rows, the input row of each routed token")
    if token_rows is not None and num_tokens is None:
        raise ValueError("plan_dispatch: token_rows needs num_tokens, the number of input rows")
    flat_ids = expert_ids_TK.reshape(-1)
    flat_weights = weights_TK.reshape(-1)
    routed_counts_E = torch.bincount(flat_ids, minlength=num_experts)
    if capacity is None:
        order = torch.argsort(flat_ids, stable=True)
        counts_E = routed_counts_E
    else:
        # Two stable sorts: by weight (descending), then by expert. Within each expert the
        # assignments now run from the highest weight down, so "rank < capacity" keeps the best.
        by_weight = torch.argsort(flat_weights.detach(), descending=True, stable=True)
        order = by_weight[torch.argsort(flat_ids[by_weight], stable=True)]
        starts_E = torch.cumsum(routed_counts_E, 0) - routed_counts_E
        rank_in_expert = torch.arange(order.numel(), device=order.device) - starts_E[flat_ids[order]]
        order = order[rank_in_expert < capacity]
        counts_E = routed_counts_E.clamp(max=capacity)
    token_idx_N = order // K
    if token_rows is not None:
        token_idx_N = token_rows[token_idx_N]
    return DispatchPlan(
        token_idx_N=token_idx_N,
        weights_N=flat_weights[order],
        counts_E=counts_E,
        routed_counts_E=routed_counts_E,
        num_tokens=T if num_tokens is None else num_tokens,
    )


def permute_tokens(x_TD: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """[T, D] -> [N, D] rows in expert order (backward is a scatter-add into the token rows)."""
    return x_TD.index_select(0, plan.token_idx_N)


def combine_tokens(y_ND: torch.Tensor, plan: DispatchPlan, out_dtype: torch.dtype) -> torch.Tensor:
    """Weighted sum of expert outputs back into token order: [N, D] -> [T, D].

    Accumulates in at least fp32 (router weights are fp32) so low-precision expert outputs of a
    token's K experts are summed without extra rounding; tokens with every assignment dropped get 0.
    """
    acc_dtype = torch.promote_types(y_ND.dtype, plan.weights_N.dtype)
    weighted_ND = y_ND.to(acc_dtype) * plan.weights_N.to(acc_dtype).unsqueeze(-1)
    out_TD = weighted_ND.new_zeros(plan.num_tokens, y_ND.shape[-1])
    out_TD = out_TD.index_add(0, plan.token_idx_N, weighted_ND)
    return out_TD.to(out_dtype)


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


class LocalDispatcher(Dispatcher):
    """Dispatcher for experts that all live in this process (expert-parallel size 1).

    The expert-parallel dispatcher (m6.moe.all_to_all) implements the same protocol and adds the
    all-to-all in between, so the MoE layer reads route -> dispatch -> experts -> combine whichever
    is installed. The handle is the plan itself.
    """

    def dispatch(
        self, x_TD: torch.Tensor, plan: DispatchPlan
    ) -> tuple[torch.Tensor, list[int], DispatchPlan]:
        """Tokens for the local experts, grouped by expert, with their per-expert counts on host."""
        return permute_tokens(x_TD, plan), plan.counts_E.tolist(), plan

    def combine(self, y_ND: torch.Tensor, handle: DispatchPlan, out_dtype: torch.dtype) -> torch.Tensor:
        """Expert outputs back to token order, weighted by the router."""
        return combine_tokens(y_ND, handle, out_dtype)
