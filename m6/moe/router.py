"""Top-k router: token features -> expert ids, combine weights and routing statistics.

Shape legend: T tokens, D d_model, E experts, P prototypes (expert groups), K assignments per
token (= P * top_k).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Literal, Optional

import torch
from torch import nn

ScoreFunction = Literal["softmax", "sigmoid"]
# The router GEMM's precision; its logits are fp32 in every case. fp32: exact fp32 (on a GPU the
# CUDA cores' rate: 67 TFLOP/s on an H100 SXM against 989 for bf16); tf32: fp32 inputs and output,
# products on TF32 tensor cores (10-bit mantissa, fp32 accumulation; 495 TFLOP/s on an H100 SXM);
# bf16: inputs and weight cast to bf16, fp32 accumulation, output upcast (Megatron-Core's default
# and torchtitan's under bf16 training); auto: tf32 on CUDA, fp32 elsewhere (no TF32 on a CPU).
RouterDtype = Literal["auto", "fp32", "tf32", "bf16"]
ROUTER_DTYPES = ("auto", "fp32", "tf32", "bf16")


def router_gemm_precision(setting: RouterDtype, device_type: str) -> str:
    """The precision ``model.moe.router_dtype`` = ``setting`` gives the router GEMM on ``device_type``."""
    if setting not in ROUTER_DTYPES:
        raise ValueError(f"router_dtype must be one of {ROUTER_DTYPES}, got {setting!r}")
    if setting == "auto":
        return "tf32" if device_type == "cuda" else "fp32"
    return setting


@contextmanager
def _tf32_matmuls() -> Iterator[None]:
    """CUDA fp32 matmuls on TF32 tensor cores inside the block, whatever the process setting is
    (restored after; torch's new fp32_precision API only: mixing it with allow_tf32 is an error)."""
    matmul = torch.backends.cuda.matmul
    previous = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision = previous


class _TF32Logits(torch.autograd.Function):
    """x [T, D] @ w [E, D]^T with TF32 products in forward AND backward (a context around the forward
    alone would leave the backward's two GEMMs, which run later, in full fp32)."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_TD, w_ED)
        with _tf32_matmuls():
            return x_TD @ w_ED.t()

    @staticmethod
    def backward(ctx, grad_TE: torch.Tensor):
        x_TD, w_ED = ctx.saved_tensors
        with _tf32_matmuls():
            grad_x = grad_TE @ w_ED if ctx.needs_input_grad[0] else None
            grad_w = grad_TE.t() @ x_TD if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def node_limited_choice(choice_TE: torch.Tensor, num_groups: int, max_groups: int, top_k: int) -> torch.Tensor:
    """DeepSeek-V3's node-limited routing: [T, E] selection scores with every expert outside each
    token's ``max_groups`` best expert groups set to -inf, so a top-k over them stays inside those groups.

    The E experts form ``num_groups`` contiguous groups (model.moe.node_groups, mapped onto nodes
    by m6.parallel); a group's score is the sum of its best ceil(top_k / max_groups) scores.
    """
    T, E = choice_TE.shape
    per_group = E // num_groups
    best_in_group = min(per_group, -(-top_k // max_groups))
    group_score_TG = choice_TE.view(T, num_groups, per_group).topk(best_in_group, dim=-1).values.sum(dim=-1)
    kept_TM = group_score_TG.topk(max_groups, dim=-1).indices
    kept_TG = torch.zeros(T, num_groups, dtype=torch.bool, device=choice_TE.device).scatter_(1, kept_TM, True)
    return choice_TE.masked_fill(~kept_TG.repeat_interleave(per_group, dim=1), float("-inf"))


@dataclass
class Routing:
    """What the router decided for one batch of tokens.

    expert_ids_TK: int64 [T, K] global expert id of each assignment.
    weights_TK:    [T, K] combine weight of each assignment (fp32, differentiable).
    logits_TE:     [T, E] fp32 router logits (for the z-loss).
    probs_TE:      [T, E] fp32 scores normalised to sum 1 per token (for the balance loss).
    """

    expert_ids_TK: torch.Tensor
    weights_TK: torch.Tensor
    logits_TE: torch.Tensor
    probs_TE: torch.Tensor


def check_node_limit(num_experts: int, top_k: int, num_prototypes: int, node_groups: int, max_nodes_per_token: int,
                     force_balance: bool = False) -> None:
    """The rules node-limited routing needs (ValueError naming the model.moe keys)."""
    if node_groups < 1 or num_experts % node_groups:
        raise ValueError(f"model.moe.node_groups ({node_groups}) must be >= 1 and divide model.moe.num_experts "
                         f"({num_experts})")
    if not 1 <= max_nodes_per_token <= node_groups:
        raise ValueError(f"model.moe.max_nodes_per_token ({max_nodes_per_token}) must be 0 (off) or 1.."
                         f"model.moe.node_groups ({node_groups})")
    if top_k > max_nodes_per_token * (num_experts // node_groups):
        raise ValueError(f"model.moe.top_k ({top_k}) must not exceed model.moe.max_nodes_per_token "
                         f"({max_nodes_per_token}) x the {num_experts // node_groups} experts of a node group")
    if num_prototypes != 1:
        raise ValueError(f"model.moe.max_nodes_per_token needs model.moe.num_prototypes 1, got {num_prototypes}")
    if force_balance:
        raise ValueError("model.moe.max_nodes_per_token and model.moe.force_balance exclude each other: forced "
                         "routing ignores the scores")


class TopKRouter(nn.Module):
    """Linear gate (fp32 weight, fp32 logits; the GEMM at ``router_dtype``) with top-k (optionally
    per-prototype) expert selection.

    With ``num_prototypes = P`` (M6-T expert prototyping) the E experts form P contiguous groups of
    E/P and each token picks ``top_k`` experts inside every group, so K = P * top_k assignments.

    ``max_nodes_per_token = M > 0`` (node-limited routing, one prototype only): the E experts form
    ``node_groups`` contiguous groups and each token's top-k is chosen among the experts of its M
    best groups (``node_limited_choice``); the weights are the chosen experts' scores as without it.
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int = 2,
        num_prototypes: int = 1,
        score_function: ScoreFunction = "softmax",
        normalize_weights: bool = True,
        jitter_eps: float = 0.0,
        force_balance: bool = False,
        router_dtype: RouterDtype = "auto",
        node_groups: int = 1,
        max_nodes_per_token: int = 0,
    ) -> None:
        super().__init__()
        router_gemm_precision(router_dtype, "cpu")  # checks the name
        if max_nodes_per_token:
            check_node_limit(num_experts, top_k, num_prototypes, node_groups, max_nodes_per_token, force_balance)
        if score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"score_function must be 'softmax' or 'sigmoid', got {score_function!r}")
        if jitter_eps < 0:
            raise ValueError(f"jitter_eps (MoELayer router_jitter) must be >= 0, got {jitter_eps}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.num_prototypes = num_prototypes
        self.score_function = score_function
        self.normalize_weights = normalize_weights
        self.jitter_eps = jitter_eps
        self.force_balance = force_balance
        self.router_dtype = router_dtype
        self.node_groups, self.max_nodes_per_token = node_groups, max_nodes_per_token
        # The gate's weight and logits are always fp32: routing decisions are sensitive to rounding
        # (ties flip under bf16); only the GEMM's products follow router_dtype.
        self.weight = nn.Parameter(torch.empty(num_experts, d_model, dtype=torch.float32))
        self.reset_parameters()

    @property
    def num_assignments(self) -> int:
        """K: expert slots each token is sent to."""
        return self.num_prototypes * self.top_k

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x_TD: torch.Tensor, selection_bias_E: Optional[torch.Tensor] = None) -> Routing:
        """Route [T, D] tokens; fp32 logits whatever the surrounding autocast says.

        ``selection_bias_E`` [E] (auxiliary-loss-free balancing): added to the scores for choosing
        the top-k only; the combine weights and the balance probabilities stay the unbiased scores.
        """
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            # At least fp32 (float64 stays float64, for reference checks).
            compute_dtype = torch.promote_types(self.weight.dtype, torch.float32)
            x_TD = x_TD.to(compute_dtype)
            if self.training and self.jitter_eps > 0:
                # Switch-Transformer multiplicative jitter: explores routings early in training.
                noise = torch.empty_like(x_TD).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
                x_TD = x_TD * noise
            return self._select(self._logits(x_TD, self.weight.to(compute_dtype)), selection_bias_E)

    def _logits(self, x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
        """[T, E] logits in x's dtype (fp32, or float64 for reference checks: always exact)."""
        precision = router_gemm_precision(self.router_dtype, x_TD.device.type)
        if x_TD.dtype != torch.float32 or precision == "fp32":
            return x_TD @ w_ED.t()
        if precision == "bf16":
            return (x_TD.to(torch.bfloat16) @ w_ED.to(torch.bfloat16).t()).float()
        return _TF32Logits.apply(x_TD, w_ED)

    def _select(self, logits_TE: torch.Tensor, selection_bias_E: Optional[torch.Tensor] = None) -> Routing:
        T, E = logits_TE.shape
        P = self.num_prototypes
        logits_TPG = logits_TE.view(T, P, E // P)
        if self.score_function == "softmax":
            # One softmax per prototype group: each group is an independent top-k gate (M6-T).
            scores_TPG = torch.softmax(logits_TPG, dim=-1)
        else:
            scores_TPG = torch.sigmoid(logits_TPG)
        if self.force_balance:
            # Slot j of token t goes to expert (t * top_k + j) mod E/P of every group: top_k distinct
            # experts per token, and each expert receives the same count (+-1) of the T rows of
            # this call (padding rows included). The weights are still the router's scores there,
            # so gradients reach the gate and backward costs what it does in training, but what
            # the gate learns is meaningless, and the balance loss (counts fixed) gives no signal.
            slots_T1k = torch.arange(T, device=logits_TE.device).view(T, 1, 1) * self.top_k + \
                torch.arange(self.top_k, device=logits_TE.device).view(1, 1, self.top_k)
            top_local_TPk = (slots_T1k % (E // P)).expand(T, P, self.top_k)
            top_scores_TPk = scores_TPG.gather(-1, top_local_TPk)
        elif selection_bias_E is not None or self.max_nodes_per_token:
            # DeepSeek-V3: the bias steers which experts (and nodes) are chosen, never how much they weigh.
            choice_TPG = scores_TPG
            if selection_bias_E is not None:
                choice_TPG = scores_TPG + selection_bias_E.to(scores_TPG.dtype).view(P, E // P)
            if self.max_nodes_per_token:  # P == 1 (checked at construction)
                choice_TPG = node_limited_choice(choice_TPG.view(T, E), self.node_groups, self.max_nodes_per_token,
                                                 self.top_k).view(T, P, E)
            top_local_TPk = torch.topk(choice_TPG, self.top_k, dim=-1).indices
            top_scores_TPk = scores_TPG.gather(-1, top_local_TPk)
        else:
            top_scores_TPk, top_local_TPk = torch.topk(scores_TPG, self.top_k, dim=-1)
        group_offset_P1 = torch.arange(P, device=logits_TE.device).view(P, 1) * (E // P)
        expert_ids_TK = (top_local_TPk + group_offset_P1).reshape(T, P * self.top_k)
        weights_TK = top_scores_TPk.reshape(T, P * self.top_k)
        if self.normalize_weights:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        scores_TE = scores_TPG.reshape(T, E)
        probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        return Routing(expert_ids_TK, weights_TK, logits_TE, probs_TE)
