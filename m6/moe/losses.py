"""Router auxiliary losses: load balancing (Switch / GShard form) and z-loss (ST-MoE).

How their statistics are totalled (this process, or all data-parallel ranks) is routing_stats.py.

Shape legend: T tokens, E experts.
"""

from __future__ import annotations

import torch


def balance_fractions(routed_counts_E: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """f_E: fraction of all routed assignments that went to each expert (no gradient), in ``dtype``."""
    counts = routed_counts_E.to(dtype)
    return counts / counts.sum().clamp_min(1.0)


def load_balancing_loss(f_E: torch.Tensor, P_E: torch.Tensor) -> torch.Tensor:
    """E * sum_e f_e * P_e; equals 1 for a perfectly uniform router, grows with imbalance.

    f_E: fraction of assignments per expert; P_E: mean router probability per expert (the
    differentiable part, since f_E comes from a discrete top-k).
    """
    num_experts = f_E.shape[0]
    return num_experts * torch.sum(f_E.detach() * P_E)


def router_z_terms(logits_TE: torch.Tensor) -> torch.Tensor:
    """[T] logsumexp(logits_t)^2 per token, in at least fp32; their mean is the z-loss."""
    logits_TE = logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32))
    return torch.logsumexp(logits_TE, dim=-1).pow(2)


def router_entropy(probs_TE: torch.Tensor) -> torch.Tensor:
    """[T] per-token entropy (nats) of the normalised router scores, detached, in fp32; log(E) =
    an undecided router. The layer averages it over the routed tokens."""
    p = probs_TE.detach().float()
    return -(p * torch.log(p.clamp_min(1e-20))).sum(dim=-1)
