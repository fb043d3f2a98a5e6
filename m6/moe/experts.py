"""Expert FFNs with stacked weights, computed per expert on contiguous token slices.

Shape legend: N tokens routed to this process's experts (grouped by expert), D d_model,
F ffn_dim, E local experts.

Why a hand-written autograd function rather than `x[s:e] @ w[e]` under autograd: indexing a
stacked parameter makes autograd build a full [E, D, F] zero gradient per expert and sum them
(O(E^2) memory traffic), and keeps E small graphs alive. Here each weight gradient is written
once, straight into its slice of one stacked buffer, with the GEMMs writing into preallocated
outputs; the elementwise activation runs once over all N rows.

Weights may arrive in a wider dtype than the tokens (cast-on-use mixed precision): each expert's
slice is then cast right where its GEMM runs, in forward and again in backward, so at most one
expert's low-precision copy exists at a time and none is kept for backward.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from torch import nn

Activation = Literal["gelu", "swiglu"]


def _segments(splits: Sequence[int]) -> list[tuple[int, int, int]]:
    """(expert, start, end) for experts that received tokens."""
    out, start = [], 0
    for e, n in enumerate(splits):
        if n:
            out.append((e, start, start + n))
        start += n
    return out


def _grouped_mm(a_NK: torch.Tensor, w_EKM: torch.Tensor, segs, transpose_w: bool = False,
                out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """out[s:e] (+)= a[s:e] @ w[e] (or @ w[e].T) for each expert segment, in a's dtype."""
    M = w_EKM.shape[1] if transpose_w else w_EKM.shape[2]
    if out is None:
        out = a_NK.new_empty(a_NK.shape[0], M)
    for e, s, t in segs:
        w = w_EKM[e].to(a_NK.dtype)  # cast on use (a no-op when the dtypes agree)
        w = w.t() if transpose_w else w
        if accumulate:
            out[s:t].addmm_(a_NK[s:t], w)
        else:
            torch.mm(a_NK[s:t], w, out=out[s:t])
    return out


def _grouped_weight_grad(a_NK: torch.Tensor, g_NM: torch.Tensor, segs, num_experts: int) -> torch.Tensor:
    """grad_w[e] = a[s:e].T @ g[s:e] in a's dtype; experts with no tokens get exact zeros (not a
    missing grad)."""
    grad = a_NK.new_empty(num_experts, a_NK.shape[1], g_NM.shape[1])
    seen = set()
    for e, s, t in segs:
        torch.mm(a_NK[s:t].t(), g_NM[s:t], out=grad[e])
        seen.add(e)
    for e in range(num_experts):
        if e not in seen:
            grad[e].zero_()
    return grad


class _GroupedFFN(torch.autograd.Function):
    """y = act(x @ w_in [, x @ w_gate]) @ w_out, per expert segment, with an explicit backward.

    Computes in x's dtype; weight gradients are returned in the weights' own dtype.
    """

    @staticmethod
    def forward(ctx, x_ND, splits, activation, w_in_EDF, w_out_EFD, w_gate_EDF):
        segs = _segments(splits)
        h_NF = _grouped_mm(x_ND, w_in_EDF, segs)
        if activation == "swiglu":
            g_NF = _grouped_mm(x_ND, w_gate_EDF, segs)
            a_NF = F.silu(g_NF) * h_NF
        else:
            g_NF = None
            a_NF = F.gelu(h_NF)
        y_ND = _grouped_mm(a_NF, w_out_EFD, segs)
        ctx.segs, ctx.activation = segs, activation
        ctx.save_for_backward(x_ND, h_NF, g_NF, a_NF, w_in_EDF, w_out_EFD, w_gate_EDF)
        return y_ND

    @staticmethod
    def backward(ctx, dy_ND):
        x_ND, h_NF, g_NF, a_NF, w_in, w_out, w_gate = ctx.saved_tensors
        segs, E = ctx.segs, w_in.shape[0]
        need_x, need_w_in, need_w_out, need_w_gate = (
            ctx.needs_input_grad[0], ctx.needs_input_grad[3], ctx.needs_input_grad[4],
            ctx.needs_input_grad[5],
        )
        dy_ND = dy_ND.contiguous()
        grad_w_out = _grouped_weight_grad(a_NF, dy_ND, segs, E).to(w_out.dtype) if need_w_out else None
        da_NF = _grouped_mm(dy_ND, w_out, segs, transpose_w=True)
        grad_w_gate = dx_ND = None
        if ctx.activation == "swiglu":
            dh_NF = da_NF * F.silu(g_NF)
            dg_NF = torch.ops.aten.silu_backward(da_NF * h_NF, g_NF)
            if need_w_gate:
                grad_w_gate = _grouped_weight_grad(x_ND, dg_NF, segs, E).to(w_gate.dtype)
        else:
            # In place into da: saves one [N, F] buffer at the backward peak.
            dh_NF = torch.ops.aten.gelu_backward.grad_input(da_NF, h_NF, grad_input=da_NF)
        grad_w_in = _grouped_weight_grad(x_ND, dh_NF, segs, E).to(w_in.dtype) if need_w_in else None
        if need_x:
            dx_ND = _grouped_mm(dh_NF, w_in, segs, transpose_w=True)
            if ctx.activation == "swiglu":
                _grouped_mm(dg_NF, w_gate, segs, transpose_w=True, out=dx_ND, accumulate=True)
        return dx_ND, None, None, grad_w_in, grad_w_out, grad_w_gate


class GroupedExperts(nn.Module):
    """E expert FFNs with weights stacked as [E, D, F] and [E, F, D] (plus [E, D, F] gate for SwiGLU).

    ``forward(x_ND, splits)`` takes tokens already grouped by expert and the number of rows per
    expert (host ints; they must sum to N). No biases: as in most large MoE models, and it keeps
    every expert's work a pure GEMM.
    """

    cast_on_use: bool = False  # under autocast: keep no low-precision weight copy (m6.model.cast_on_use)

    def __init__(self, num_experts: int, d_model: int, ffn_dim: int, activation: Activation = "gelu",
                 init_std: float = 0.02, init_seed: int = 0, first_expert: int = 0) -> None:
        super().__init__()
        if activation not in ("gelu", "swiglu"):
            raise ValueError(f"activation must be 'gelu' or 'swiglu', got {activation!r}")
        self.num_experts, self.d_model, self.ffn_dim = num_experts, d_model, ffn_dim
        self.activation = activation
        self.init_std, self.init_seed, self.first_expert = init_std, init_seed, first_expert
        self.w_in = nn.Parameter(torch.empty(num_experts, d_model, ffn_dim))
        self.w_out = nn.Parameter(torch.empty(num_experts, ffn_dim, d_model))
        self.w_gate = nn.Parameter(torch.empty(num_experts, d_model, ffn_dim)) if activation == "swiglu" else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Expert ``first_expert + e`` is drawn from its own generator seeded by (init_seed, global id).

        So its initial weights do not depend on how many experts this process holds (expert
        parallelism), and initialising experts does not advance the global RNG that the
        replicated parameters are drawn from.
        """
        if self.w_in.is_meta:
            return
        for e in range(self.num_experts):
            g = torch.Generator(device="cpu").manual_seed(self.init_seed * 1_000_003 + self.first_expert + e)
            for w in (self.w_in, self.w_out, self.w_gate):
                if w is not None:
                    sample = torch.randn(w.shape[1:], generator=g, dtype=torch.float32) * self.init_std
                    with torch.no_grad():
                        w[e].copy_(sample)

    def forward(self, x_ND: torch.Tensor, splits: Sequence[int]) -> torch.Tensor:
        """[N, D] tokens grouped by expert -> [N, D] expert outputs."""
        if len(splits) != self.num_experts:
            raise AssertionError(f"got {len(splits)} splits for {self.num_experts} experts")
        if sum(splits) != x_ND.shape[0]:
            # Uncovered rows would be left uninitialised by the out= GEMMs.
            raise AssertionError(f"splits sum to {sum(splits)} but {x_ND.shape[0]} rows were dispatched")
        device_type = x_ND.device.type
        weights = [self.w_in, self.w_out, self.w_gate]
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            x_ND = x_ND.to(dtype)
            if not self.cast_on_use:
                # Whole-tensor casts: autograd saves them, so they live until backward.
                weights = [w.to(dtype) if w is not None else None for w in weights]
        with torch.autocast(device_type=device_type, enabled=False):
            return _GroupedFFN.apply(x_ND.contiguous(), tuple(int(n) for n in splits), self.activation,
                                     *weights)
