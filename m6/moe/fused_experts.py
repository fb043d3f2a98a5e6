"""The fused expert FFN (``model.moe.expert_kernel: fused``): m6's Triton kernels beside a plain
PyTorch reference of the same math.

Shape legend: S source rows, T tokens, N routed rows grouped by expert, D d_model, F ffn_dim,
E experts.

The math, per routed row r of expert e (rows of one expert contiguous; ``src[r]`` its token):

    h = x[src[r]] @ w_in[e],  g = x[src[r]] @ w_gate[e]     (GELU: h only)
    a = silu(g) * h                                          (GELU: gelu(h))
    routed:  y[t] = sum over the rows r of token t of  p[r] * (a @ w_out[e])     -> [T, D]
    grouped: y[r] = a @ w_out[e]                                                 -> [N, D]

What is fused (forward, two kernels):
1. gather + GEMM 1 + activation: the rows of x are read through ``src`` inside the GEMM's operand
   load (no permuted [N, D] copy); h and g come out of one pass over D (two accumulators), and the
   epilogue writes h, g and a = act(h, g).
2. GEMM 2 + router weight + combine: a @ w_out[e] is multiplied by the router weight p[r] in the
   epilogue and added atomically (fp32) into the token's output row: no [N, D] expert output, no
   separate combine. (Atomic adds make the order of a token's top-k sum vary from run to run: the
   output is reproducible to fp32 rounding, not bitwise.)
In the ``grouped`` form (rows already dispatched, e.g. after the expert-parallel all-to-all; no
router weight), the same kernels run without the gather and with a plain store.

What backward stores and what it recomputes:
- Saved for backward: x (the layer's input, held anyway), the int64 row -> token index, the
  router weights [N], and the pre-activations h and g ([N, F] each, compute dtype). Not saved:
  the gathered x rows, a, the expert outputs [N, D] (SonicMoE's rule: nothing [N, D] is cached).
- Recomputed: a = act(h, g), elementwise, inside the backward kernel (never a GEMM).
- Backward kernels: (1) da' = dy[src] @ w_out[e].T with dy gathered in the load; its epilogue
  recomputes a, forms the router-weight gradient dp[r] = <a, da'> (per-column-tile partial sums,
  added up deterministically), da = p * da', and writes dh, dg IN PLACE over the saved h, g, plus
  a*p for dW_out; (2) dW_out[e] = (a*p)[rows_e].T @ dy[src] (dy gathered in the load); (3) dW_in,
  dW_gate = x[src].T @ (dh, dg) in one pass (x gathered in the load, two accumulators); (4) dx =
  dh @ w_in[e].T + dg @ w_gate[e].T in one accumulator, added atomically into the token rows.
  Because dh, dg overwrite h, g, a second backward through the same graph is refused.

Weights may be wider than the tokens (cast-on-use): the kernels cast weight tiles on load and write
weight gradients in the weights' own dtype. Needs Triton: on a GPU, or on CPU tensors under
``TRITON_INTERPRET=1`` (set before triton is imported), which is how CPU CI tests this code.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from m6.config import ConfigError


def _kernels():
    """m6.moe.triton_expert_kernels, imported at first use: importing triton takes seconds, and it
    builds its kernels interpreted or compiled from TRITON_INTERPRET at that moment."""
    import m6.moe.triton_expert_kernels as tk

    return tk


def triton_available() -> bool:
    """Whether Triton can be imported (without importing it: the import is slow and fixes the
    interpreter mode for the process)."""
    return importlib.util.find_spec("triton") is not None


def fused_runs_on(device: torch.device) -> bool:
    """Whether the fused kernels can run on tensors of ``device``: CUDA with Triton installed, or
    any device under Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    if not triton_available():
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return device.type == "cpu"
    return device.type == "cuda"


def require_fused(device: torch.device) -> None:
    """A clear error where ``expert_kernel=fused`` cannot run (never a crash inside Triton)."""
    if not triton_available():
        raise ConfigError("model.moe.expert_kernel=fused needs the 'triton' package, which is not installed "
                          "(pip install triton, or use model.moe.expert_kernel=auto, grouped_mm or loop)")
    if not fused_runs_on(device):
        raise ConfigError(f"model.moe.expert_kernel=fused runs Triton kernels on CUDA (or on CPU under "
                          f"TRITON_INTERPRET=1, a slow correctness mode); the experts' tokens are on {device.type}: "
                          f"use model.moe.expert_kernel=auto or loop")


# ----------------------------------------------------------------------------------------------
# The plain PyTorch reference (autograd does the backward): what the kernels must equal.
def reference_expert_ffn(x_SD: torch.Tensor, src_N: Optional[torch.Tensor], probs_N: Optional[torch.Tensor],
                         splits: Sequence[int], activation: str, w_in_EDF: torch.Tensor, w_out_EFD: torch.Tensor,
                         w_gate_EDF: Optional[torch.Tensor], num_out_rows: Optional[int] = None) -> torch.Tensor:
    """The fused path's math, one expert at a time: routed ([T, D], with ``src_N`` and ``probs_N``)
    or grouped ([N, D], both None). Computes in x's dtype."""
    rows_ND = x_SD if src_N is None else x_SD.index_select(0, src_N)
    outs, start = [], 0
    for e, n in enumerate(splits):
        xe = rows_ND[start:start + n]
        h = xe @ w_in_EDF[e].to(x_SD.dtype)
        if activation == "swiglu":
            a = F.silu(xe @ w_gate_EDF[e].to(x_SD.dtype)) * h
        else:
            a = F.gelu(h)
        outs.append(a @ w_out_EFD[e].to(x_SD.dtype))
        start += n
    y_ND = torch.cat(outs) if outs else x_SD.new_zeros(0, w_out_EFD.shape[2])
    if probs_N is None:
        return y_ND
    acc = torch.promote_types(y_ND.dtype, probs_N.dtype)
    out = y_ND.new_zeros(num_out_rows, y_ND.shape[1], dtype=acc)
    return out.index_add(0, src_N, y_ND.to(acc) * probs_N.to(acc).unsqueeze(1))


# ----------------------------------------------------------------------------------------------
# Launch configuration
@dataclass(frozen=True)
class Blocks:
    """Tile sizes of the row-tiled GEMMs (m, n, k) and of the weight-gradient GEMMs (k, n over rows r)."""

    m: int
    n: int
    k: int
    warps: int
    stages: int
    wg_k: int
    wg_n: int
    wg_r: int
    wg_warps: int


# Hopper-sized tiles on CUDA (wgmma: 128x128 tiles, 64-deep K, 8 warps); tiny tiles under the CPU
# interpreter, where every tile is a numpy call and the test shapes are 16-32 wide.
CUDA_BLOCKS = Blocks(m=128, n=128, k=64, warps=8, stages=3, wg_k=128, wg_n=128, wg_r=64, wg_warps=8)
INTERPRETER_BLOCKS = Blocks(m=16, n=16, k=16, warps=1, stages=1, wg_k=16, wg_n=16, wg_r=16, wg_warps=1)


def blocks_for(device: torch.device) -> Blocks:
    return CUDA_BLOCKS if device.type == "cuda" else INTERPRETER_BLOCKS


def _to_device(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small int32 host table on the device: pinned and asynchronous on CUDA (no host sync)."""
    t = torch.from_numpy(np.ascontiguousarray(host, dtype=np.int32))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


class RowTiles:
    """Host-built tables for one call, from the per-expert row counts the host already holds:
    ``tiles`` int32 [3, num_tiles] (expert, first row, segment end) of ``block_m``-row tiles that
    never straddle two experts, and ``segs`` int32 [2, E] (segment start, end) per expert."""

    def __init__(self, splits: Sequence[int], block_m: int, device: torch.device) -> None:
        counts = np.asarray(splits, dtype=np.int64)
        ends = np.cumsum(counts)
        starts = ends - counts
        per_expert = -(-counts // block_m)
        self.num_tiles = int(per_expert.sum())
        expert = np.repeat(np.arange(len(counts)), per_expert)
        first = np.repeat(starts, per_expert) + block_m * (np.arange(self.num_tiles)
                                                           - np.repeat(np.cumsum(per_expert) - per_expert, per_expert))
        self.tiles = _to_device(np.stack([expert, first, np.repeat(ends, per_expert)]), device)
        self.segs = _to_device(np.stack([starts, ends]), device)
        self.num_experts = len(counts)
        self.num_rows = int(counts.sum())
        self.device_built = False

    @classmethod
    def from_device_counts(cls, counts_E: torch.Tensor, num_rows: int, block_m: int) -> "RowTiles":
        """The same tables built on the device from int64 [E] rows per expert (nothing is read
        back), for ``num_rows`` rows, which may be more than the counts' sum (a dropless plan's
        padding tail: those rows are in no tile). The host cannot know how many tiles there are,
        so the table has the most there can be, cdiv(num_rows, block_m) + E (each expert adds at
        most one partial tile), and the tiles past the real ones are empty (first row = end =
        num_rows): each kernel program of an empty tile returns at once."""
        self = cls.__new__(cls)
        E, device = counts_E.numel(), counts_E.device
        self.num_experts, self.num_rows, self.device_built = E, num_rows, True
        self.num_tiles = -(-num_rows // block_m) + E
        ends = torch.cumsum(counts_E, 0)
        starts = ends - counts_E
        per_expert = (counts_E + block_m - 1) // block_m
        tile_ends = torch.cumsum(per_expert, 0)
        t = torch.arange(self.num_tiles, device=device)
        expert = torch.searchsorted(tile_ends, t, right=True)  # E for the tiles past the real ones
        real = expert < E
        e = expert.clamp_max(E - 1)
        first = starts[e] + block_m * (t - (tile_ends - per_expert)[e])
        empty = torch.full_like(t, num_rows)
        self.tiles = torch.stack([torch.where(real, e, 0), torch.where(real, first, empty),
                                  torch.where(real, ends[e], empty)]).to(torch.int32)
        self.segs = torch.stack([starts, ends]).to(torch.int32)
        return self


# ----------------------------------------------------------------------------------------------
# Launchers (each one kernel)
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _precision(dtype: torch.dtype) -> str:
    # fp32 tokens (tests, CPU): exact fp32 products; bf16/fp16 ignore it.
    return "ieee" if dtype == torch.float32 else "tf32"


def _gemm_act(x_SD, src_N, w_in, w_gate, tiles: RowTiles, act: int, blocks: Blocks):
    tk = _kernels()

    D, Fd = w_in.shape[1], w_in.shape[2]
    N = tiles.num_rows
    h = x_SD.new_empty(N, Fd)
    g = x_SD.new_empty(N, Fd) if act == tk.SWIGLU else h
    a = x_SD.new_empty(N, Fd)
    grid = (_cdiv(Fd, blocks.n) * tiles.num_tiles,)
    tk.gather_gemm_act_kernel[grid](
        x_SD, src_N if src_N is not None else x_SD, w_in, w_gate if w_gate is not None else w_in, h, g, a,
        tiles.tiles, tiles.num_tiles, D, Fd, w_in.stride(0), w_in.stride(1), w_in.stride(2),
        GATHER=src_N is not None, ACT=act, EVEN_K=D % blocks.k == 0, PRECISION=_precision(x_SD.dtype),
        BLOCK_M=blocks.m, BLOCK_N=blocks.n, BLOCK_K=blocks.k, num_warps=blocks.warps, num_stages=blocks.stages)
    return h, (g if act == tk.SWIGLU else None), a


def _gemm_scatter(a1, w1, a2, w2, transpose: bool, scale_N, dst_N, out, tiles: RowTiles, blocks: Blocks) -> None:
    """out (+)= a1 @ w1[e] (+ a2 @ w2[e]) [* scale], over the rows; w [E, K, N] or, transposed,
    [E, N, K] read as its transpose."""
    tk = _kernels()

    K = a1.shape[1]
    Nout = out.shape[1]
    s0, s1, s2 = w1.stride()
    sk, sn = (s2, s1) if transpose else (s1, s2)
    grid = (_cdiv(Nout, blocks.n) * tiles.num_tiles,)
    tk.grouped_gemm_scatter_kernel[grid](
        a1, w1, a2 if a2 is not None else a1, w2 if w2 is not None else w1,
        scale_N if scale_N is not None else a1, dst_N if dst_N is not None else a1, out,
        tiles.tiles, tiles.num_tiles, K, Nout, s0, sk, sn,
        TWO=a2 is not None, SCALE=scale_N is not None, SCATTER=dst_N is not None, EVEN_K=K % blocks.k == 0,
        PRECISION=_precision(a1.dtype), BLOCK_M=blocks.m, BLOCK_N=blocks.n, BLOCK_K=blocks.k,
        num_warps=blocks.warps, num_stages=blocks.stages)


def _gemm_act_backward(dy, src_N, w_out, h, g, probs_N, tiles: RowTiles, act: int, blocks: Blocks):
    """(aw [N, F], dprobs partials [N, F tiles] fp32 or None); dh, dg overwrite h, g."""
    tk = _kernels()

    D = dy.shape[1]
    N, Fd = h.shape
    n_tiles = _cdiv(Fd, blocks.n)
    aw = torch.empty_like(h)
    # zeros: rows in no tile (a dropless plan's padding tail) get no partials written.
    dprobs = torch.zeros(N, n_tiles, dtype=torch.float32, device=h.device) if probs_N is not None else None
    s0, s1, s2 = w_out.stride()  # w_out [E, F, D] read as [E, D, F]
    tk.gather_gemm_act_backward_kernel[(n_tiles * tiles.num_tiles,)](
        dy, src_N if src_N is not None else dy, w_out, h, g if g is not None else h,
        probs_N if probs_N is not None else h, aw, dprobs if dprobs is not None else h,
        tiles.tiles, tiles.num_tiles, D, Fd, s0, s2, s1,
        GATHER=src_N is not None, ACT=act, SCALE=probs_N is not None, EVEN_K=D % blocks.k == 0,
        PRECISION=_precision(h.dtype), BLOCK_M=blocks.m, BLOCK_N=blocks.n, BLOCK_K=blocks.k,
        num_warps=blocks.warps, num_stages=blocks.stages)
    return aw, dprobs


def _weight_grad(a, a_src, b1, b2, b_src, out_dtype, tiles: RowTiles, blocks: Blocks):
    """[E, K, M] a[rows_e].T @ b[rows_e] (and for b2), rows optionally gathered."""
    tk = _kernels()

    E, K, M = tiles.num_experts, a.shape[1], b1.shape[1]
    out1 = torch.empty(E, K, M, dtype=out_dtype, device=a.device)
    out2 = torch.empty_like(out1) if b2 is not None else None
    grid = (_cdiv(K, blocks.wg_k) * _cdiv(M, blocks.wg_n), E)
    tk.grouped_weight_grad_kernel[grid](
        a, a_src if a_src is not None else a, b1, b2 if b2 is not None else b1, b_src if b_src is not None else a,
        out1, out2 if out2 is not None else out1, tiles.segs, E, K, M,
        GATHER_A=a_src is not None, GATHER_B=b_src is not None, TWO=b2 is not None, PRECISION=_precision(a.dtype),
        BLOCK_K=blocks.wg_k, BLOCK_N=blocks.wg_n, BLOCK_R=blocks.wg_r, num_warps=blocks.wg_warps,
        num_stages=blocks.stages)
    return out1, out2


# ----------------------------------------------------------------------------------------------
class FusedExpertFFN(torch.autograd.Function):
    """The fused forward and backward (see the module docstring for what is fused, saved and
    recomputed). Inputs: x_SD, src_N (int64 or None), probs_N (or None), splits (host ints, or
    int64 [E] on the device), num_rows (their sum, known on the host), activation, num_out_rows,
    out_dtype, w_in, w_out, w_gate."""

    @staticmethod
    def forward(ctx, x_SD, src_N, probs_N, splits, num_rows, activation, num_out_rows, out_dtype, w_in, w_out, w_gate):
        tk = _kernels()

        act = tk.SWIGLU if activation == "swiglu" else tk.GELU
        blocks = blocks_for(x_SD.device)
        tiles = (RowTiles.from_device_counts(splits, num_rows, blocks.m) if isinstance(splits, torch.Tensor)
                 else RowTiles(splits, blocks.m, x_SD.device))
        D = w_out.shape[2]
        routed = probs_N is not None
        if tiles.num_rows == 0:
            h = g = None
            y = (x_SD.new_zeros(num_out_rows, D, dtype=out_dtype) if routed else x_SD.new_zeros(0, D))
        else:
            h, g, a = _gemm_act(x_SD, src_N, w_in, w_gate, tiles, act, blocks)
            if routed:
                acc = torch.zeros(num_out_rows, D, dtype=torch.float32, device=x_SD.device)
                _gemm_scatter(a, w_out, None, None, False, probs_N, src_N, acc, tiles, blocks)
                y = acc.to(out_dtype)
            else:
                y = (x_SD.new_zeros if tiles.device_built else x_SD.new_empty)(tiles.num_rows, D)
                _gemm_scatter(a, w_out, None, None, False, None, None, y, tiles, blocks)
            del a
        ctx.act, ctx.blocks, ctx.tiles, ctx.routed, ctx.consumed = act, blocks, tiles, routed, False
        ctx.save_for_backward(x_SD, src_N, probs_N, h, g, w_in, w_out, w_gate)
        return y

    @staticmethod
    def backward(ctx, dy):
        if ctx.consumed:
            raise RuntimeError("the fused expert FFN's backward overwrites its saved pre-activations; it cannot run "
                               "twice through one graph (retain_graph): use model.moe.expert_kernel=grouped_mm or loop")
        ctx.consumed = True
        x_SD, src_N, probs_N, h, g, w_in, w_out, w_gate = ctx.saved_tensors
        tiles, blocks, act = ctx.tiles, ctx.blocks, ctx.act
        need = ctx.needs_input_grad
        if tiles.num_rows == 0:
            zeros = [torch.zeros_like(w) if w is not None else None for w in (w_in, w_out, w_gate)]
            dx = torch.zeros_like(x_SD) if need[0] else None
            dp = torch.zeros_like(probs_N) if probs_N is not None and need[2] else None
            return dx, None, dp, None, None, None, None, None, *zeros
        dy = dy.contiguous()
        aw, dprobs = _gemm_act_backward(dy, src_N, w_out, h, g, probs_N, tiles, act, blocks)
        dh, dg = h, g  # overwritten in place by the kernel above
        dp = dprobs.sum(dim=1).to(probs_N.dtype) if probs_N is not None and need[2] else None
        dw_out = _weight_grad(aw, None, dy, None, src_N, w_out.dtype, tiles, blocks)[0] if need[9] else None
        del aw
        dw_in = dw_gate = None
        if need[8] or (w_gate is not None and need[10]):
            dw_in, dw_gate = _weight_grad(x_SD, src_N, dh, dg, None, w_in.dtype, tiles, blocks)
            if dw_gate is not None:
                dw_gate = dw_gate.to(w_gate.dtype)
        dx = None
        if need[0]:
            if ctx.routed:
                acc = torch.zeros(x_SD.shape, dtype=torch.float32, device=x_SD.device)
                _gemm_scatter(dh, w_in, dg, w_gate, True, None, src_N, acc, tiles, blocks)
                dx = acc.to(x_SD.dtype)
            else:
                dx = (torch.zeros_like if tiles.device_built else torch.empty_like)(x_SD)
                _gemm_scatter(dh, w_in, dg, w_gate, True, None, None, dx, tiles, blocks)
        return dx, None, dp, None, None, None, None, None, dw_in, dw_out, dw_gate


def fused_expert_ffn(x_SD: torch.Tensor, src_N: Optional[torch.Tensor], probs_N: Optional[torch.Tensor],
                     splits: Sequence[int], activation: str, w_in_EDF: torch.Tensor, w_out_EFD: torch.Tensor,
                     w_gate_EDF: Optional[torch.Tensor], num_out_rows: Optional[int] = None,
                     out_dtype: Optional[torch.dtype] = None, num_rows: Optional[int] = None) -> torch.Tensor:
    """The fused expert FFN: routed (``src_N`` int64 [N] token of each routed row, ``probs_N`` [N]
    router weights -> [num_out_rows, D] in ``out_dtype``) or grouped (both None: x_SD is [N, D]
    already grouped by expert -> [N, D] in x's dtype). Rows of expert e are the e-th ``splits``
    segment: ``splits`` host ints, or int64 [E] on the device with ``num_rows`` their sum (the
    routed rows, or x's rows in the grouped form; the tile tables are then built on the device,
    with no host sync). Needs Triton (see ``require_fused``)."""
    if (src_N is None) != (probs_N is None):
        raise ValueError("fused_expert_ffn: give both src_N and probs_N (routed) or neither (grouped)")
    if probs_N is not None and num_out_rows is None:
        raise ValueError("fused_expert_ffn: routed form needs num_out_rows")
    out_dtype = out_dtype or x_SD.dtype
    w = [t.contiguous() if t is not None else None for t in (w_in_EDF, w_out_EFD, w_gate_EDF)]
    for t in (*w, src_N, probs_N):
        if t is not None and t.device != x_SD.device:
            raise ValueError(f"fused_expert_ffn: tokens on {x_SD.device} but an operand on {t.device}")
    if isinstance(splits, torch.Tensor):
        num_rows = (src_N if src_N is not None else x_SD).shape[0] if num_rows is None else num_rows
    else:
        splits, num_rows = tuple(int(n) for n in splits), sum(int(n) for n in splits)
    return FusedExpertFFN.apply(x_SD.contiguous(), src_N, probs_N.contiguous() if probs_N is not None else None,
                                splits, num_rows, activation, num_out_rows, out_dtype, *w)

