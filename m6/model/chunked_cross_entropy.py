"""The LM head and cross-entropy over chunks of target rows, without [targets, vocab] logits.

With a real vocabulary the head's fp32 logits are the largest activation of a step (65,536
targets x 151,936 entries x 4 B = 40 GB) and their gradient as large again. Here the logits of
``chunk_rows`` rows at a time are formed, reduced to a log-sum-exp and the target's logit, and
dropped; backward forms each chunk's logits again from the saved hidden rows and the weight (one
more head GEMM per chunk: the cost of not storing them), turns them into softmax - one-hot in
place, and accumulates the weight's gradient over chunks in fp32. Saved for backward: the hidden
rows, the labels and one fp32 log-sum-exp per row.

Precision follows the unchunked head: under a compute dtype the GEMMs take the hidden rows and the
weight in that dtype (the weight cast per use, cast-on-use style) and the logits are promoted to
fp32 before the softmax, as ``linear(...).float()`` then ``F.cross_entropy`` do; the loss is
the same to fp32 rounding of the sum.

Shape legend: T target rows, D d_model, V vocabulary.
"""

from __future__ import annotations

from typing import Optional

import torch

# auto: chunks of about this many fp32 logits (256 MiB), so a byte vocabulary never chunks and a
# 152k one takes ~440 rows at a time.
AUTO_CHUNK_ELEMENTS = 1 << 26


def chunk_rows_for(setting: int | str, vocab_size: int) -> int:
    """Rows per chunk for ``model.loss_chunk_rows`` (0 = one chunk of every row, "auto" = from V)."""
    if setting == "auto":
        return max(1, AUTO_CHUNK_ELEMENTS // vocab_size)
    return int(setting)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TD, weight_VD, labels_T, chunk_rows, dtype):
        T = hidden_TD.shape[0]
        w = weight_VD if dtype is None else weight_VD.to(dtype)
        acc = torch.promote_types(hidden_TD.dtype if dtype is None else dtype, torch.float32)
        lse_T = torch.empty(T, dtype=acc, device=hidden_TD.device)
        total = torch.zeros((), dtype=acc, device=hidden_TD.device)
        for s in range(0, T, chunk_rows):
            h = hidden_TD[s:s + chunk_rows]
            logits = (h if dtype is None else h.to(dtype)).mm(w.t())
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            lse = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, labels_T[s:s + chunk_rows].unsqueeze(1)).squeeze(1)
            total += (lse - target).sum()
            lse_T[s:s + chunk_rows] = lse
        ctx.save_for_backward(hidden_TD, weight_VD, labels_T, lse_T)
        ctx.chunk_rows, ctx.dtype = chunk_rows, dtype
        return total

    @staticmethod
    def backward(ctx, dloss):
        hidden_TD, weight_VD, labels_T, lse_T = ctx.saved_tensors
        dtype, chunk_rows = ctx.dtype, ctx.chunk_rows
        w = weight_VD if dtype is None else weight_VD.to(dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh_TD = torch.empty_like(hidden_TD) if need_h else None
        dw_VD = torch.zeros(weight_VD.shape, dtype=torch.promote_types(weight_VD.dtype, torch.float32),
                            device=weight_VD.device) if need_w else None
        for s in range(0, hidden_TD.shape[0], chunk_rows):
            h = hidden_TD[s:s + chunk_rows]
            h_c = h if dtype is None else h.to(dtype)
            logits = h_c.mm(w.t())
            probs = logits.to(torch.promote_types(logits.dtype, torch.float32))
            probs.sub_(lse_T[s:s + chunk_rows].unsqueeze(1)).exp_()  # softmax, in place
            rows = torch.arange(probs.shape[0], device=probs.device)
            probs[rows, labels_T[s:s + chunk_rows]] -= 1.0
            g = (probs * dloss).to(h_c.dtype)  # d loss / d logits, in the GEMMs' dtype
            if need_h:
                dh_TD[s:s + chunk_rows] = g.mm(w).to(hidden_TD.dtype)
            if need_w:
                dw_VD += g.t().mm(h_c)
        return dh_TD, None if dw_VD is None else dw_VD.to(weight_VD.dtype), None, None, None


def linear_cross_entropy_sum(hidden_TD: torch.Tensor, weight_VD: torch.Tensor, labels_T: torch.Tensor,
                             chunk_rows: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """sum over rows of cross_entropy(hidden @ weight.T, labels) in chunks of ``chunk_rows`` rows
    (every label a real target); ``dtype``: the GEMMs' compute dtype (None: the tensors' own)."""
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be > 0, got {chunk_rows}")
    return _ChunkedLinearCrossEntropy.apply(hidden_TD, weight_VD, labels_T, chunk_rows, dtype)
