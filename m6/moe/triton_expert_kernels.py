"""Triton kernels of the fused expert FFN (m6.moe.fused_experts holds the math, the launchers and
the autograd function; this module only the device code). Imported only where Triton is installed.

Shape legend: S source rows (tokens [T, D] when gathering, else the dispatched rows), N routed rows
grouped by expert, D d_model, F ffn_dim, E experts. Row-tiled kernels walk a host-built tile table
(expert, first row, segment end) of BLOCK_M-row tiles that never cross an expert boundary; weight
gradient kernels walk each expert's row segment. Every ``tl.dot`` takes operands in the compute
dtype (the tokens' dtype: bf16 on GPUs) and accumulates in fp32; weights stored in a wider dtype are
cast on load (no low-precision copy of them is ever made).

Activation codes: 0 = SwiGLU (silu(g) * h, h = x @ w_in, g = x @ w_gate), 1 = GELU (exact, erf).
"""

from __future__ import annotations

import triton
import triton.language as tl

SWIGLU, GELU = 0, 1


@triton.jit
def _sigmoid(g):
    return 1.0 / (1.0 + tl.exp(-g))


@triton.jit
def _gelu(h):
    return 0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))


@triton.jit
def _gelu_grad(h):
    cdf = 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476))
    pdf = tl.exp(-0.5 * h * h) * 0.3989422804014327
    return cdf + h * pdf


@triton.jit
def _tile_and_column(N, BLOCK_N: tl.constexpr):
    """(column block, row tile) of this program in a 1D grid of num_tiles * cdiv(N, BLOCK_N): the
    column blocks of one row tile are neighbours, so they share its gathered rows in L2 (and a 1D
    grid has no 65,535 limit on the row tiles)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    return pid % num_n, pid // num_n


@triton.jit
def _tile_rows(tiles_ptr, num_tiles, tile, BLOCK_M: tl.constexpr):
    """(expert, rows [BLOCK_M] int64, row mask) of one tile of the table [3, num_tiles]."""
    e = tl.load(tiles_ptr + tile).to(tl.int64)
    start = tl.load(tiles_ptr + num_tiles + tile)
    end = tl.load(tiles_ptr + 2 * num_tiles + tile)
    rows = start + tl.arange(0, BLOCK_M)
    return e, rows.to(tl.int64), rows < end


@triton.jit
def _tile_is_empty(tiles_ptr, num_tiles, tile):
    """Whether a tile has no rows: the padding entries of a table built on the device
    (m6.moe.fused_experts.RowTiles.from_device_counts), whose programs return at once."""
    return tl.load(tiles_ptr + num_tiles + tile) >= tl.load(tiles_ptr + 2 * num_tiles + tile)


@triton.jit(do_not_specialize=["num_tiles"])  # one compile whatever the routing
def gather_gemm_act_kernel(
    x_ptr, src_ptr, w1_ptr, w2_ptr, h_ptr, g_ptr, a_ptr, tiles_ptr, num_tiles, K, N,
    stride_we, stride_wk, stride_wn,
    GATHER: tl.constexpr, ACT: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Forward GEMM 1: h = x[src] @ w1[e], g = x[src] @ w2[e] (SwiGLU) in one pass over K; writes the
    pre-activations h (and g) and the activation a = act(h, g), all [N, F] in the compute dtype.

    The routed rows are gathered in the operand load (``x[src[r]]``), never copied to a permuted
    buffer. a is computed from the rounded h and g, exactly as backward recomputes it."""
    pid_n, tile = _tile_and_column(N, BLOCK_N)
    if _tile_is_empty(tiles_ptr, num_tiles, tile):
        return
    e, rows, row_ok = _tile_rows(tiles_ptr, num_tiles, tile, BLOCK_M)
    if GATHER:
        src = tl.load(src_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        src = rows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    cdt = x_ptr.dtype.element_ty
    a_ptrs = x_ptr + src[:, None] * K + ks[None, :]
    w_off = e * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            xa = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b1 = tl.load(w1_ptr + w_off, mask=col_ok[None, :], other=0.0).to(cdt)
        else:
            k_ok = (k0 + ks) < K
            xa = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b1 = tl.load(w1_ptr + w_off, mask=k_ok[:, None] & col_ok[None, :], other=0.0).to(cdt)
        acc1 = tl.dot(xa, b1, acc1, input_precision=PRECISION)
        if ACT == 0:
            if EVEN_K:
                b2 = tl.load(w2_ptr + w_off, mask=col_ok[None, :], other=0.0).to(cdt)
            else:
                b2 = tl.load(w2_ptr + w_off, mask=k_ok[:, None] & col_ok[None, :], other=0.0).to(cdt)
            acc2 = tl.dot(xa, b2, acc2, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_off += BLOCK_K * stride_wk
    out_off = rows[:, None] * N + cols[None, :]
    out_ok = row_ok[:, None] & col_ok[None, :]
    h = acc1.to(cdt)
    tl.store(h_ptr + out_off, h, mask=out_ok)
    h = h.to(tl.float32)
    if ACT == 0:
        g = acc2.to(cdt)
        tl.store(g_ptr + out_off, g, mask=out_ok)
        g = g.to(tl.float32)
        act = h * g * _sigmoid(g)
    else:
        act = _gelu(h)
    tl.store(a_ptr + out_off, act.to(cdt), mask=out_ok)


@triton.jit(do_not_specialize=["num_tiles"])  # one compile whatever the routing
def grouped_gemm_scatter_kernel(
    a1_ptr, w1_ptr, a2_ptr, w2_ptr, scale_ptr, dst_ptr, out_ptr, tiles_ptr, num_tiles, K, N,
    stride_we, stride_wk, stride_wn,
    TWO: tl.constexpr, SCALE: tl.constexpr, SCATTER: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out = (a1 @ w1[e] [+ a2 @ w2[e]]) [* scale[r]], rows [N, K] grouped by expert.

    SCATTER: added atomically (fp32) into out[dst[r]] (the router-weighted combine of forward GEMM 2,
    and dx's sum over a token's assignments in backward); else stored to out[r]. ``w`` strides give
    either w[e] [K, N] or a transposed view of it."""
    pid_n, tile = _tile_and_column(N, BLOCK_N)
    if _tile_is_empty(tiles_ptr, num_tiles, tile):
        return
    e, rows, row_ok = _tile_rows(tiles_ptr, num_tiles, tile, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    cdt = a1_ptr.dtype.element_ty
    a_off = rows[:, None] * K + ks[None, :]
    w_off = e * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a_mask = row_ok[:, None]
            w_mask = col_ok[None, :]
        else:
            k_ok = (k0 + ks) < K
            a_mask = row_ok[:, None] & k_ok[None, :]
            w_mask = k_ok[:, None] & col_ok[None, :]
        xa = tl.load(a1_ptr + a_off, mask=a_mask, other=0.0)
        b = tl.load(w1_ptr + w_off, mask=w_mask, other=0.0).to(cdt)
        acc = tl.dot(xa, b, acc, input_precision=PRECISION)
        if TWO:
            xa2 = tl.load(a2_ptr + a_off, mask=a_mask, other=0.0)
            b2 = tl.load(w2_ptr + w_off, mask=w_mask, other=0.0).to(cdt)
            acc = tl.dot(xa2, b2, acc, input_precision=PRECISION)
        a_off += BLOCK_K
        w_off += BLOCK_K * stride_wk
    if SCALE:
        acc = acc * tl.load(scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_ok = row_ok[:, None] & col_ok[None, :]
    if SCATTER:
        dst = tl.load(dst_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        tl.atomic_add(out_ptr + dst[:, None] * N + cols[None, :], acc, mask=out_ok, sem="relaxed")
    else:
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_ok)


@triton.jit(do_not_specialize=["num_tiles"])  # one compile whatever the routing
def gather_gemm_act_backward_kernel(
    dy_ptr, src_ptr, w_ptr, h_ptr, g_ptr, scale_ptr, aw_ptr, dscale_ptr, tiles_ptr, num_tiles, K, N,
    stride_we, stride_wk, stride_wn,
    GATHER: tl.constexpr, ACT: tl.constexpr, SCALE: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Backward through GEMM 2, the router weight and the activation, in one pass:

    da' = dy[src] @ w_out[e].T  (dy gathered in the load; [N, F] tile, never stored)
    a   = act(h, g)             (recomputed from the saved pre-activations)
    dscale[r, pid_n] = sum over this tile's columns of a * da'  (partial router-weight gradient)
    da  = scale[r] * da';  dh, dg = act'(da)  -> written IN PLACE over h and g
    aw  = scale[r] * a      (the operand of dW_out = aw.T @ dy[src])."""
    pid_n, tile = _tile_and_column(N, BLOCK_N)
    if _tile_is_empty(tiles_ptr, num_tiles, tile):
        return
    e, rows, row_ok = _tile_rows(tiles_ptr, num_tiles, tile, BLOCK_M)
    if GATHER:
        src = tl.load(src_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        src = rows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    cdt = h_ptr.dtype.element_ty
    a_ptrs = dy_ptr + src[:, None] * K + ks[None, :]
    w_off = e * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            dya = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0).to(cdt)
            b = tl.load(w_ptr + w_off, mask=col_ok[None, :], other=0.0).to(cdt)
        else:
            k_ok = (k0 + ks) < K
            dya = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(cdt)
            b = tl.load(w_ptr + w_off, mask=k_ok[:, None] & col_ok[None, :], other=0.0).to(cdt)
        acc = tl.dot(dya, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_off += BLOCK_K * stride_wk
    out_off = rows[:, None] * N + cols[None, :]
    out_ok = row_ok[:, None] & col_ok[None, :]
    h = tl.load(h_ptr + out_off, mask=out_ok, other=0.0).to(tl.float32)
    if ACT == 0:
        g = tl.load(g_ptr + out_off, mask=out_ok, other=0.0).to(tl.float32)
        sig = _sigmoid(g)
        silu = g * sig
        act = (h * silu).to(cdt).to(tl.float32)  # the rounded a that forward's GEMM 2 read
    else:
        act = _gelu(h).to(cdt).to(tl.float32)
    if SCALE:
        s = tl.load(scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        part = tl.sum(act * acc, axis=1)
        tl.store(dscale_ptr + rows * tl.cdiv(N, BLOCK_N) + pid_n, part, mask=row_ok)
        da = acc * s[:, None]
        aw = act * s[:, None]
    else:
        da = acc
        aw = act
    tl.store(aw_ptr + out_off, aw.to(cdt), mask=out_ok)
    if ACT == 0:
        dh = da * silu
        dg = da * h * sig * (1.0 + g * (1.0 - sig))
        tl.store(h_ptr + out_off, dh.to(cdt), mask=out_ok)
        tl.store(g_ptr + out_off, dg.to(cdt), mask=out_ok)
    else:
        tl.store(h_ptr + out_off, (da * _gelu_grad(h)).to(cdt), mask=out_ok)


@triton.jit
def grouped_weight_grad_kernel(
    a_ptr, a_src_ptr, b1_ptr, b2_ptr, b_src_ptr, out1_ptr, out2_ptr, segs_ptr, E, K, M,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, TWO: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """dW[e] = a[rows_e].T @ b[rows_e] (and a second b sharing a's loads), [E, K, M], for the rows of
    expert e (segment table [2, E]); a and b rows optionally gathered (``a[a_src[r]]``). Experts
    with no rows get exact zeros. Stored in the out tensor's dtype (the weights' own)."""
    pid = tl.program_id(0)
    e = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_N)
    pk = pid // num_m
    pm = pid % num_m
    start = tl.load(segs_ptr + e)
    end = tl.load(segs_ptr + E + e)
    ks = pk * BLOCK_K + tl.arange(0, BLOCK_K)
    ms = pm * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = ks < K
    m_ok = ms < M
    cdt = a_ptr.dtype.element_ty
    acc1 = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        ok = rows < end
        if GATHER_A:
            sa = tl.load(a_src_ptr + rows, mask=ok, other=0).to(tl.int64)
        else:
            sa = rows.to(tl.int64)
        if GATHER_B:
            sb = tl.load(b_src_ptr + rows, mask=ok, other=0).to(tl.int64)
        else:
            sb = rows.to(tl.int64)
        at = tl.load(a_ptr + sa[None, :] * K + ks[:, None], mask=ok[None, :] & k_ok[:, None], other=0.0).to(cdt)
        b = tl.load(b1_ptr + sb[:, None] * M + ms[None, :], mask=ok[:, None] & m_ok[None, :], other=0.0).to(cdt)
        acc1 = tl.dot(at, b, acc1, input_precision=PRECISION)
        if TWO:
            b2 = tl.load(b2_ptr + sb[:, None] * M + ms[None, :], mask=ok[:, None] & m_ok[None, :], other=0.0).to(cdt)
            acc2 = tl.dot(at, b2, acc2, input_precision=PRECISION)
    out_off = e.to(tl.int64) * K * M + ks[:, None] * M + ms[None, :]
    out_ok = k_ok[:, None] & m_ok[None, :]
    tl.store(out1_ptr + out_off, acc1.to(out1_ptr.dtype.element_ty), mask=out_ok)
    if TWO:
        tl.store(out2_ptr + out_off, acc2.to(out2_ptr.dtype.element_ty), mask=out_ok)
