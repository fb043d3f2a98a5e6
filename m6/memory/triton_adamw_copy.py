"""The Triton kernel of m6.memory.adamw_copy: one pass of AdamW over an fp32 master that also
writes its compute-dtype copy. Imported at first use (importing triton is slow, and it fixes the
interpreter mode, TRITON_INTERPRET, for the process)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _adamw_copy_kernel(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, n, decay, one_minus_beta1, beta2, one_minus_beta2,
                       neg_step_size, bc2_sqrt, eps, WRITE_COPY: tl.constexpr, BLOCK: tl.constexpr):
    # torch's foreach AdamW, op by op in fp32 (decoupled decay, lerp, mul + addcmul, sqrt / bc2 + eps,
    # addcdiv), with the copy's store added to the same pass.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    p = p * decay
    m = tl.fma(one_minus_beta1, g - m, m)
    v = v * beta2
    v = tl.fma(one_minus_beta2 * g, g, v)
    # sqrt_rn and div_rn: correctly rounded, as torch's (Triton's plain sqrt and / are approximate on GPUs).
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + tl.div_rn(neg_step_size * m, denom)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if WRITE_COPY:
        # fp32 -> bf16 rounded to nearest, ties to even, on the bits (torch's rounding; Triton's CPU
        # interpreter truncates a plain cast): add 0x7FFF plus the kept part's lowest bit, keep the top
        # 16 bits; a NaN stays a quiet NaN.
        bits = p.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(p != p, 0x7FC0, rounded)
        tl.store(c_ptr + offs, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)


def adamw_copy_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                copy: torch.Tensor | None, *, decay: float, beta1: float, beta2: float, step_size: float,
                bc2_sqrt: float, eps: float) -> None:
    """One AdamW update of contiguous fp32 ``param`` (and its moments) in place, writing ``copy``
    (same shape, the compute dtype) from the new value when given. Scalars as torch computes them."""
    assert copy is None or copy.dtype == torch.bfloat16, "the kernel writes bf16 copies"
    n = param.numel()
    if n == 0:
        return
    grid = (triton.cdiv(n, BLOCK),)
    scalars = [_fp32(x) for x in (decay, 1 - beta1, beta2, 1 - beta2, -step_size, bc2_sqrt, eps)]
    _adamw_copy_kernel[grid](param, grad, exp_avg, exp_avg_sq, copy if copy is not None else param, n, *scalars,
                             WRITE_COPY=copy is not None, BLOCK=BLOCK)


def _fp32(x: float) -> float:
    """``x`` rounded to fp32, as torch's fp32 kernels take a Python scalar (a GPU launch passes
    floats as fp32 anyway; Triton's CPU interpreter computes with them as given, in float64, whose
    result then rounds once more: exact for +, *, / and sqrt of fp32 operands, not of a wider scalar)."""
    return float(torch.tensor(x, dtype=torch.float32))
