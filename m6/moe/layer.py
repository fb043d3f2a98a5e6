"""The MoE feed-forward layer: route -> dispatch -> experts -> combine -> losses, each a named phase.

Shape legend: T tokens (all leading dims flattened), D d_model, E experts, K assignments/token,
G routing groups (capacity is decided per group), S tokens per group.

The router scores every row (padding too: picking the real rows out would be a host sync); the
token mask then keeps padding out of the experts' work, capacity and the balance statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import nn

from m6.moe.dispatch import (Dispatcher, DispatchPlan, LocalDispatcher, expert_capacity, group_capacity,
                             plan_dispatch)
from m6.moe.expert_gemm import ExpertKernel
from m6.moe.experts import Activation, GroupedExperts
from m6.moe.losses import balance_fractions, load_balancing_loss, router_entropy, router_z_terms
from m6.moe.router import RouterDtype, Routing, ScoreFunction, TopKRouter
from m6.moe.routing_stats import LocalRoutingStats, RoutingStatsReducer


@dataclass
class MoEStats:
    """Detached per-step routing statistics, kept as tensors so reading them costs no host sync
    inside the forward; the logger converts them when it logs.

    tokens_per_expert: int64 [E] assignments routed to each expert (before capacity), summed over
        the data-parallel ranks when a global stats reducer is installed.
    dropped: int64 [] assignments dropped by the capacity limit.
    kept: int64 [] assignments of this process's tokens that reached an expert (routed minus
        dropped; this process only, whatever the reducer): the expert work actually done for them.
    dropped_fraction: fp32 [] dropped / all assignments.
    router_entropy: fp32 [] mean per-token entropy of the router scores (nats).
    aux_loss, z_loss: fp32 [] the unweighted load-balancing and z losses.
    routed_local: int64 [E] assignments of this process's tokens routed to each expert (before
        capacity), never reduced: what the expert-bias update sums over micro-batches and ranks.
    """

    tokens_per_expert: torch.Tensor
    dropped: torch.Tensor
    kept: torch.Tensor
    dropped_fraction: torch.Tensor
    router_entropy: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    routed_local: torch.Tensor


def _require_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


class MoELayer(nn.Module):
    """Top-k gated mixture of expert FFNs.

    ``y, aux_loss = layer(x)`` with x [..., d_model] -> y of the same shape; ``aux_loss`` is
    ``aux_loss_coef * balance_loss + z_loss_coef * z_loss`` (a scalar tensor to add to the loss).
    ``capacity_factor=None`` is dropless; otherwise capacity is decided per routing group: in a
    group of S real tokens each expert takes at most ``max(min_capacity, ceil(capacity_factor * S *
    K / E))`` of the group's assignments and the lowest-weight ones over that are dropped (their
    share of the MoE output is zero; the residual carries them).

    ``capacity_group="sequence"`` (default): a group is one sequence, x's second-to-last dim (an
    input [T, D] is one sequence). The same sequence keeps the same assignments whichever process
    and micro-batch it lands in, so capacity runs match across world sizes, micro-batch sizes
    and accumulation like dropless ones. ``"batch"``: one group of all the tokens in this call
    (Switch/DeepSpeed semantics: it changes with how the global batch is split).

    ``expert_bias_update_rate > 0``: auxiliary-loss-free balancing (DeepSeek-V3). The buffer
    ``expert_bias`` [E] is added to the router scores for choosing the top-k only, and
    ``update_expert_bias(counts_E)`` moves it after each optimizer step; the caller totals the
    step's counts (all micro-batches, all ranks), so the layer never communicates for it.

    Shared experts (DeepSeek-MoE, Qwen2-MoE): ``shared_experts`` is a module x [..., D] -> [..., D]
    that every token goes through beside the routed experts (m6 passes a ``DenseMLP`` of
    num_shared_experts * shared_expert_ffn_dim hidden units with the experts' activation and no
    biases: ``shared_experts.fc_in`` / ``fc_gate`` / ``fc_out``, Hugging Face's up / gate / down
    projections); ``shared_expert_gate`` an optional module D -> 1 (a Linear without bias) whose
    sigmoid scales the shared output per token (Qwen2-MoE). It is replicated like any dense weight
    (expert parallelism splits the routed experts only). ``routed_scaling_factor`` multiplies the
    routed experts' combined output (DeepSeek-V2/V3):
        y = routed_scaling_factor * sum_k w_k expert_k(x) + [sigmoid(gate(x)) *] shared_experts(x)
    Padding rows get the shared experts' output too (the dense MLPs run on padding alike; nothing
    reads it).
    """

    # Swappable from outside (m6.parallel installs the expert-parallel dispatcher and the cross-rank
    # reducer, each holding its own process group); never looked up here.
    dispatcher: Dispatcher
    stats_reducer: RoutingStatsReducer

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        num_experts: int,
        top_k: int = 2,
        capacity_factor: Optional[float] = 1.25,
        min_capacity: int = 4,
        capacity_group: Literal["sequence", "batch"] = "sequence",
        num_prototypes: int = 1,
        activation: Activation = "gelu",
        score_function: ScoreFunction = "softmax",
        normalize_weights: bool = True,
        router_jitter: float = 0.0,
        force_balance: bool = False,
        aux_loss_coef: float = 1e-2,
        z_loss_coef: float = 1e-3,
        init_std: float = 0.02,
        init_seed: Optional[int] = None,
        expert_kernel: ExpertKernel = "auto",
        router_dtype: RouterDtype = "auto",
        expert_bias_update_rate: float = 0.0,
        node_groups: int = 1,
        max_nodes_per_token: int = 0,
        shared_experts: Optional[nn.Module] = None,
        shared_expert_gate: Optional[nn.Module] = None,
        routed_scaling_factor: float = 1.0,
    ) -> None:
        super().__init__()
        # Each argument rule is checked in one place: here the sizes that router, experts and
        # dispatch share, the capacity and the loss weights; TopKRouter checks score_function and
        # router_jitter, GroupedExperts the activation, AllToAllDispatcher the experts' split.
        for name, value in (("d_model", d_model), ("ffn_dim", ffn_dim), ("num_experts", num_experts),
                            ("top_k", top_k), ("num_prototypes", num_prototypes)):
            _require_positive(name, value)
        if num_experts % num_prototypes:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by num_prototypes ({num_prototypes})")
        experts_per_group = num_experts // num_prototypes
        if top_k > experts_per_group:
            where = f"the {experts_per_group} experts of each prototype" if num_prototypes > 1 else f"num_experts ({num_experts})"
            raise ValueError(f"top_k ({top_k}) must not exceed {where}")
        if capacity_factor is not None and not (capacity_factor > 0 and math.isfinite(capacity_factor)):
            raise ValueError(f"capacity_factor must be a finite number > 0 or None (dropless), got {capacity_factor!r}")
        if min_capacity < 0:
            raise ValueError(f"min_capacity must be >= 0, got {min_capacity}")
        if capacity_group not in ("sequence", "batch"):
            raise ValueError(f"capacity_group must be 'sequence' or 'batch', got {capacity_group!r}")
        if aux_loss_coef < 0 or z_loss_coef < 0:
            raise ValueError(f"aux_loss_coef and z_loss_coef must be >= 0, got {aux_loss_coef}, {z_loss_coef}")
        if not (expert_bias_update_rate >= 0 and math.isfinite(expert_bias_update_rate)):
            raise ValueError(f"expert_bias_update_rate must be a finite number >= 0, got {expert_bias_update_rate!r}")
        if expert_bias_update_rate > 0 and force_balance:
            raise ValueError("expert_bias_update_rate and force_balance exclude each other: forced routing ignores "
                             "the scores the bias steers")
        if not (routed_scaling_factor > 0 and math.isfinite(routed_scaling_factor)):
            raise ValueError(f"routed_scaling_factor must be a finite number > 0, got {routed_scaling_factor!r}")
        if shared_expert_gate is not None and shared_experts is None:
            raise ValueError("shared_expert_gate needs shared_experts")
        self.d_model, self.num_experts = d_model, num_experts
        self.capacity_factor, self.min_capacity, self.capacity_group = capacity_factor, min_capacity, capacity_group
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.router = TopKRouter(d_model, num_experts, top_k, num_prototypes, score_function,
                                 normalize_weights, router_jitter, force_balance, router_dtype,
                                 node_groups, max_nodes_per_token)
        if init_seed is None:
            # One draw from the global RNG, the same whatever the expert count: the layers that
            # follow initialise identically on every rank of any expert-parallel layout.
            init_seed = int(torch.randint(0, 2**31 - 1, (1,), device="cpu"))
        self.experts = GroupedExperts(num_experts, d_model, ffn_dim, activation, init_std, init_seed,
                                      expert_kernel=expert_kernel)
        self.shared_experts = shared_experts
        self.shared_expert_gate = shared_expert_gate
        self.routed_scaling_factor = routed_scaling_factor
        self.dispatcher = LocalDispatcher()
        self.stats_reducer = LocalRoutingStats()
        self.stats: Optional[MoEStats] = None
        self.expert_bias_update_rate = expert_bias_update_rate
        if expert_bias_update_rate > 0:
            # A buffer, not a parameter: no gradient, no optimizer; checkpointed with the weights,
            # the same on every rank (each applies the same update to the same global counts).
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def capacity(self, num_tokens: int) -> Optional[int]:
        """Per-expert slot count for a routing group of ``num_tokens`` real tokens (None when dropless)."""
        if self.capacity_factor is None:
            return None
        return expert_capacity(num_tokens, self.router.num_assignments, self.num_experts,
                               self.capacity_factor, self.min_capacity)

    def forward(self, x: torch.Tensor, token_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., D] -> (y [..., D], aux_loss []); also sets ``self.stats``.

        ``token_mask`` (bool, x.shape[:-1], True = real token) keeps padding out of the experts:
        masked tokens are not dispatched, take no capacity, do not count in the balance statistics
        and get a zero output.
        """
        x_TD, token_mask_T = self._flatten(x, token_mask)
        routing = self.router(x_TD, self.expert_bias)
        plan = self.dispatch_plan(routing, token_mask_T, self._group_size(x))
        # dispatch -> experts -> combine (one call: an overlapping dispatcher interleaves them by chunk)
        y_TD = self.dispatcher.dispatch_compute_combine(x_TD, plan, self.experts, x.dtype)
        if self.routed_scaling_factor != 1.0:
            y_TD = y_TD * self.routed_scaling_factor
        if self.shared_experts is not None:
            y_TD = y_TD + self.shared_output(x_TD)
        aux_loss, self.stats = self.aux_loss_and_stats(routing, plan, token_mask_T)
        return y_TD.view(x.shape), aux_loss

    def shared_output(self, x_TD: torch.Tensor) -> torch.Tensor:
        """The shared experts' output [T, D], scaled by the sigmoid of the shared-expert gate if any."""
        y_TD = self.shared_experts(x_TD)
        if self.shared_expert_gate is not None:
            y_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * y_TD
        return y_TD

    def reset_parameters(self) -> None:
        """The expert bias starts at zero (also after materialising a model built on ``meta``)."""
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    @torch.no_grad()
    def update_expert_bias(self, counts_E: torch.Tensor) -> None:
        """One aux-free balancing update from ``counts_E`` [E], the assignments routed to each
        expert in the whole step (all micro-batches and ranks): each expert's bias moves by the rate
        toward the mean load of its prototype group, up when under-loaded, down when over-loaded
        (0 when exactly at it)."""
        assert self.expert_bias is not None, "update_expert_bias needs expert_bias_update_rate > 0"
        P = self.router.num_prototypes
        load_PG = counts_E.to(torch.float64).view(P, self.num_experts // P)
        step_PG = torch.sign(load_PG.mean(dim=1, keepdim=True) - load_PG)
        self.expert_bias += (self.expert_bias_update_rate * step_PG).reshape(-1).to(self.expert_bias.dtype)

    def _flatten(self, x: torch.Tensor, token_mask: Optional[torch.Tensor]
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x [..., D] -> x_TD [T, D], and the token mask [...] -> [T] (after checking both shapes)."""
        if x.shape[-1] != self.d_model:
            raise ValueError(f"MoELayer expects last dim d_model={self.d_model}, got input shape {tuple(x.shape)}")
        x_TD = x.reshape(-1, self.d_model)
        if token_mask is None:
            return x_TD, None
        if token_mask.shape != x.shape[:-1]:
            raise ValueError(f"token_mask shape {tuple(token_mask.shape)} must equal x.shape[:-1] {tuple(x.shape[:-1])}")
        return x_TD, token_mask.reshape(-1)

    def _group_size(self, x: torch.Tensor) -> int:
        """S: tokens per routing group (one sequence, or the whole call)."""
        if self.capacity_group == "sequence" and x.dim() >= 3:
            return x.shape[-2]
        return max(x.numel() // self.d_model, 1)

    def dispatch_plan(self, routing: Routing, token_mask_T: Optional[torch.Tensor], group_size: int) -> DispatchPlan:
        """Dispatch phase, first half: which rows go to which expert, each routing group of
        ``group_size`` rows with the capacity of its own real tokens (the dispatcher then moves them)."""
        T = routing.expert_ids_TK.shape[0]
        capacity_G = None
        if self.capacity_factor is not None and T > 0:
            if token_mask_T is None:
                capacity_G = self.capacity(group_size)
            else:
                tokens_G = token_mask_T.view(T // group_size, group_size).sum(dim=1)
                capacity_G = group_capacity(tokens_G, self.router.num_assignments, self.num_experts,
                                            self.capacity_factor, self.min_capacity)
        return plan_dispatch(routing.expert_ids_TK, routing.weights_TK, self.num_experts, capacity_G,
                             routed_T=token_mask_T, group_size=group_size)

    def aux_loss_and_stats(self, routing: Routing, plan: DispatchPlan, token_mask_T: Optional[torch.Tensor]
                           ) -> tuple[torch.Tensor, MoEStats]:
        """Losses phase: the weighted aux loss [] to add to the training loss, and the step's stats."""
        # Balance statistics as sums over the routed tokens, so a data-parallel reducer can add them
        # up across ranks before the losses are formed (aux_loss_scope=global): the loss then does
        # not depend on how the batch is split over processes. Padding rows are zeroed with where,
        # not multiplied by the mask, so whatever they hold cannot turn into NaN.
        probs_TE, z_T, entropy_T = routing.probs_TE, router_z_terms(routing.logits_TE), router_entropy(routing.probs_TE)
        dtype = probs_TE.dtype
        if token_mask_T is None:
            num_routed = probs_TE.new_full((), float(probs_TE.shape[0]))  # a fill, not a host-to-device copy
        else:
            keep_T = token_mask_T.unsqueeze(1)
            probs_TE = torch.where(keep_T, probs_TE, 0.0)
            z_T = torch.where(token_mask_T, z_T, 0.0)
            entropy_T = torch.where(token_mask_T, entropy_T, 0.0)
            num_routed = token_mask_T.sum().to(dtype)
        counts_E, prob_sum_E, z_sum, num_routed_all = self.stats_reducer(
            plan.routed_counts_E, probs_TE.sum(dim=0), z_T.sum(), num_routed)
        balance = load_balancing_loss(balance_fractions(counts_E, dtype), prob_sum_E / num_routed_all.clamp_min(1))
        z = z_sum / num_routed_all.clamp_min(1)
        aux_loss = self.aux_loss_coef * balance + self.z_loss_coef * z

        num_assignments = plan.routed_counts_E.sum()
        stats = MoEStats(
            tokens_per_expert=counts_E.detach(),
            dropped=plan.num_dropped.detach(),
            kept=plan.counts_E.sum().detach(),
            dropped_fraction=plan.num_dropped.float() / num_assignments.clamp_min(1).float(),
            router_entropy=entropy_T.sum() / num_routed.clamp_min(1),
            aux_loss=balance.detach(),
            z_loss=z.detach(),
            routed_local=plan.routed_counts_E.detach(),
        )
        return aux_loss, stats
