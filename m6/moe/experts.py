"""Expert FFNs with stacked weights, computed per expert on contiguous token slices.

Shape legend: N tokens routed to this process's experts (grouped by expert), D d_model,
F ffn_dim, E local experts.

Why a hand-written autograd function rather than `x[s:e] @ w[e]` under autograd: indexing a
stacked parameter makes autograd build a full [E, D, F] zero gradient per expert and sum them
(O(E^2) memory traffic), and keeps E small graphs alive. Here each weight gradient is written
once, straight into its slice of one stacked buffer, with the GEMMs writing into preallocated
outputs; the elementwise activation runs once over all N rows.

Weights may arrive in a wider dtype than the tokens (cast-on-use mixed precision): they are then
cast right where a GEMM runs, in forward and again in backward, and no low-precision copy is kept
for backward (the loop casts one expert's slice at a time, the grouped kernel the whole stack once
per GEMM call; see m6.moe.expert_gemm).

The GEMMs themselves run either as a Python loop of torch.mm per expert or as one torch grouped
GEMM per product (``expert_kernel``; m6.moe.expert_gemm), chosen once per layer call; or, with
``fused``, the whole FFN runs in m6's Triton kernels (m6.moe.fused_experts), which also take the
token gather and the router-weighted combine when the local dispatcher hands them the routing
(``forward_routed``). The fused kernels cast weight tiles on load, so they never make a
low-precision weight copy, whatever ``cast_on_use`` says.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from m6.config import ConfigError

from m6.moe.dispatch import host_ints
from m6.moe.expert_gemm import (EXPERT_KERNELS, ExpertKernel, build_gemms, choose_kernel, grouped_mm_op, kernel_for,
                                uses_fused)
from m6.moe.fused_experts import fused_expert_ffn, triton_available

Activation = Literal["gelu", "swiglu"]


class _GroupedFFN(torch.autograd.Function):
    """y = act(x @ w_in [, x @ w_gate]) @ w_out, per expert segment, with an explicit backward.

    Computes in x's dtype; weight gradients are returned in the weights' own dtype. With splits on
    the device (grouped_mm), rows past the last segment (padding) get zero output and gradient.
    """

    @staticmethod
    def forward(ctx, x_ND, splits, activation, kernel, w_in_EDF, w_out_EFD, w_gate_EDF):
        gemms = build_gemms(kernel, splits, x_ND.device)
        h_NF = gemms.mm(x_ND, w_in_EDF)
        if activation == "swiglu":
            g_NF = gemms.mm(x_ND, w_gate_EDF)
            a_NF = F.silu(g_NF) * h_NF
        else:
            g_NF = None
            a_NF = F.gelu(h_NF)
        y_ND = gemms.zero_tail(gemms.mm(a_NF, w_out_EFD))
        ctx.gemms, ctx.activation = gemms, activation
        ctx.save_for_backward(x_ND, h_NF, g_NF, a_NF, w_in_EDF, w_out_EFD, w_gate_EDF)
        return y_ND

    @staticmethod
    def backward(ctx, dy_ND):
        x_ND, h_NF, g_NF, a_NF, w_in, w_out, w_gate = ctx.saved_tensors
        gemms = ctx.gemms
        need_x, need_w_in, need_w_out, need_w_gate = (
            ctx.needs_input_grad[0], ctx.needs_input_grad[4], ctx.needs_input_grad[5],
            ctx.needs_input_grad[6],
        )
        dy_ND = dy_ND.contiguous()
        grad_w_out = gemms.weight_grad(a_NF, dy_ND).to(w_out.dtype) if need_w_out else None
        da_NF = gemms.mm(dy_ND, w_out, transpose_w=True)
        grad_w_gate = dx_ND = None
        if ctx.activation == "swiglu":
            dh_NF = da_NF * F.silu(g_NF)
            dg_NF = torch.ops.aten.silu_backward(da_NF * h_NF, g_NF)
            if need_w_gate:
                grad_w_gate = gemms.weight_grad(x_ND, dg_NF).to(w_gate.dtype)
        else:
            # In place into da: saves one [N, F] buffer at the backward peak.
            dh_NF = torch.ops.aten.gelu_backward.grad_input(da_NF, h_NF, grad_input=da_NF)
        grad_w_in = gemms.weight_grad(x_ND, dh_NF).to(w_in.dtype) if need_w_in else None
        if need_x:
            dx_ND = gemms.mm(dh_NF, w_in, transpose_w=True)
            if ctx.activation == "swiglu":
                gemms.mm(dg_NF, w_gate, transpose_w=True, out=dx_ND, accumulate=True)
            gemms.zero_tail(dx_ND)
        return dx_ND, None, None, None, grad_w_in, grad_w_out, grad_w_gate


class GroupedExperts(nn.Module):
    """E expert FFNs with weights stacked as [E, D, F] and [E, F, D] (plus [E, D, F] gate for SwiGLU).

    ``forward(x_ND, splits)`` takes tokens already grouped by expert and the number of rows per
    expert (host ints summing to N; or, for the grouped_mm and fused kernels, an int64 [E] device
    tensor, which spares the dispatcher its host sync: it may then sum to less than N, and the rows
    past the experts' segments are computed by no GEMM and come out as zeros). No biases: as in most large MoE models, and it keeps
    every expert's work a pure GEMM.
    """

    draws_on_host = True  # reset_parameters draws from CPU generators (M6Model.materialize)

    cast_on_use: bool = False  # under autocast: keep no low-precision weight copy (m6.model.cast_on_use)

    def __init__(self, num_experts: int, d_model: int, ffn_dim: int, activation: Activation = "gelu",
                 init_std: float = 0.02, init_seed: int = 0, first_expert: int = 0,
                 expert_kernel: ExpertKernel = "auto") -> None:
        super().__init__()
        if activation not in ("gelu", "swiglu"):
            raise ValueError(f"activation must be 'gelu' or 'swiglu', got {activation!r}")
        if expert_kernel not in EXPERT_KERNELS:
            raise ValueError(f"expert_kernel must be one of {EXPERT_KERNELS}, got {expert_kernel!r}")
        if expert_kernel == "grouped_mm" and grouped_mm_op() is None:
            raise ValueError(f"expert_kernel='grouped_mm' needs torch.nn.functional.grouped_mm or "
                             f"torch._grouped_mm; torch {torch.__version__} has neither (use 'auto' or 'loop')")
        if expert_kernel == "fused" and not triton_available():
            raise ConfigError("model.moe.expert_kernel=fused needs the 'triton' package, which is not installed "
                              "(pip install triton, or use model.moe.expert_kernel=auto, grouped_mm or loop)")
        self.expert_kernel = expert_kernel
        self.last_kernel: str | None = None  # what the last forward ran ('loop', 'grouped_mm' or 'fused')
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
                    # device="cpu": under a default-device context (torch.device("cuda")) the
                    # draw would otherwise go to that device and refuse the CPU generator.
                    sample = torch.randn(w.shape[1:], generator=g, dtype=torch.float32, device="cpu") * self.init_std
                    with torch.no_grad():
                        w[e].copy_(sample)

    def forward(self, x_ND: torch.Tensor, splits: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """[N, D] tokens grouped by expert -> [N, D] expert outputs. ``splits``: rows per expert as
        host ints, or as a device tensor (int64 [E]) when ``takes_device_counts`` said so (at most
        N; checking would read them back)."""
        splits = self._checked_splits(splits, x_ND.shape[0])
        x_ND, weights, kernel = self._inputs(x_ND)
        self.last_kernel = kernel
        if kernel == "loop" and isinstance(splits, torch.Tensor):
            (splits,) = host_ints(splits)  # the loop slices on the host (not reached when takes_device_counts held)
        with torch.autocast(device_type=x_ND.device.type, enabled=False):
            if kernel == "fused":
                return fused_expert_ffn(x_ND, None, None, splits, self.activation, *weights)
            if not isinstance(splits, torch.Tensor):
                splits = tuple(int(n) for n in splits)
            return _GroupedFFN.apply(x_ND, splits, self.activation, kernel, *weights)

    def _checked_splits(self, splits: Sequence[int] | torch.Tensor, num_rows: int) -> Sequence[int] | torch.Tensor:
        if isinstance(splits, torch.Tensor):
            if splits.shape != (self.num_experts,) or splits.dtype != torch.int64:
                raise AssertionError(f"device splits must be int64 [{self.num_experts}], got {splits.dtype} "
                                     f"{tuple(splits.shape)}")
            return splits
        if len(splits) != self.num_experts:
            raise AssertionError(f"got {len(splits)} splits for {self.num_experts} experts")
        if sum(splits) != num_rows:
            # Uncovered rows would be left uninitialised by the out= GEMMs.
            raise AssertionError(f"splits sum to {sum(splits)} but {num_rows} rows were dispatched")
        return splits

    def takes_device_counts(self, x_TD: torch.Tensor, num_rows: int) -> bool:
        """Whether a call on ``num_rows`` rows gathered from ``x_TD`` runs a kernel that takes the rows
        per expert as a device tensor (grouped_mm: device offsets; fused: tile tables built on the
        device), so the dispatcher need not read them back. The loop slices on the host."""
        device_type = x_TD.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x_TD.dtype
        kernel = kernel_for(self.expert_kernel, x_TD.device, dtype, [self.w_in, self.w_out, self.w_gate], num_rows)
        return kernel in ("grouped_mm", "fused") and num_rows > 0

    def fuses_dispatch(self, x_TD: torch.Tensor) -> bool:
        """Whether this call will run the fused kernels, which then also take the token gather and
        the router-weighted combine (``forward_routed``) from a local dispatcher."""
        device_type = x_TD.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x_TD.dtype
        return uses_fused(self.expert_kernel, x_TD.device, dtype, [self.w_in, self.w_out, self.w_gate])

    def forward_routed(self, x_TD: torch.Tensor, token_idx_N: torch.Tensor, weights_N: torch.Tensor,
                       splits: Sequence[int] | torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Dispatch, experts and combine in the fused kernels: [T, D] tokens, the token of each kept
        assignment grouped by expert (int64 [N]), its router weight [N] and the rows per expert
        (host ints or an int64 [E] device tensor, as in ``forward``) -> [T, D] router-weighted sum
        of each token's expert outputs in ``out_dtype`` (what
        ``combine_tokens(experts(permute_tokens(x)))`` gives, without the [N, D] copies)."""
        splits = self._checked_splits(splits, token_idx_N.shape[0])
        x_TD, weights, kernel = self._inputs(x_TD)
        if kernel != "fused":
            raise AssertionError(f"forward_routed runs the fused kernels, but this call chose {kernel!r}")
        self.last_kernel = kernel
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            return fused_expert_ffn(x_TD, token_idx_N, weights_N, splits, self.activation, *weights,
                                    num_out_rows=x_TD.shape[0], out_dtype=out_dtype, num_rows=token_idx_N.shape[0])

    def _inputs(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, list, str]:
        """Tokens and weights in the dtypes the kernel computes in (autocast), and the kernel for them."""
        device_type = x_ND.device.type
        weights = [self.w_in, self.w_out, self.w_gate]
        autocast = torch.is_autocast_enabled(device_type)
        if autocast:
            x_ND = x_ND.to(torch.get_autocast_dtype(device_type))
        x_ND = x_ND.contiguous()
        kernel = choose_kernel(self.expert_kernel, x_ND, weights)  # reads only the weights' shapes
        if autocast and not self.cast_on_use and kernel != "fused":
            # Whole-tensor casts: autograd saves them, so they live until backward. (The fused
            # kernels cast weight tiles on load: no copy.)
            weights = [w.to(x_ND.dtype) if w is not None else None for w in weights]
        return x_ND, weights, kernel
