"""The chunked LM head + cross-entropy: the unchunked loss and gradients at every chunking, in
float64 exactly-ish and under bf16 autocast as the unchunked head computes it; the model picks it
from model.loss_chunk_rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from m6.config import ConfigError, load
from m6.model import build_meta_model
from m6.model.chunked_cross_entropy import chunk_rows_for, linear_cross_entropy_sum


def _case(T=37, D=16, V=53, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g, dtype=dtype, requires_grad=True)
    w = (torch.randn(V, D, generator=g, dtype=dtype) * 0.5).requires_grad_()
    labels = torch.randint(0, V, (T,), generator=g)
    return h, w, labels


@pytest.mark.parametrize("chunk_rows", [1, 5, 36, 37, 100])
def test_equals_unchunked_in_float64(chunk_rows):
    h, w, labels = _case()
    loss = linear_cross_entropy_sum(h, w, labels, chunk_rows)
    (dh, dw) = torch.autograd.grad(loss * 1.7, (h, w))
    ref = F.cross_entropy(h @ w.t(), labels, reduction="sum")
    (rh, rw) = torch.autograd.grad(ref * 1.7, (h, w))
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dh, rh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dw, rw, rtol=1e-10, atol=1e-12)


def test_bf16_compute_is_as_accurate_as_the_unchunked_head_under_autocast():
    """Both against float64 math on the same bf16-rounded operands: the chunked head's error is
    bf16's (GEMM outputs rounded per chunk), no larger than the unchunked head's."""
    h, w, labels = _case(T=64, D=32, V=96, dtype=torch.float32, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy_sum(h, w, labels, 10, torch.bfloat16)
        ref = F.cross_entropy(F.linear(h, w).float(), labels, reduction="sum")
    grads = torch.autograd.grad(loss, (h, w))
    ref_grads = torch.autograd.grad(ref, (h, w))
    h64, w64 = (t.detach().to(torch.bfloat16).double().requires_grad_() for t in (h, w))
    exact = F.cross_entropy(h64 @ w64.t(), labels, reduction="sum")
    exact_grads = torch.autograd.grad(exact, (h64, w64))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-4)  # the same bf16 logits, summed in another order
    for g, r, e in zip(grads, ref_grads, exact_grads):
        assert g.dtype == torch.float32
        err, ref_err = ((x.double() - e).norm() / e.norm() for x in (g, r))
        assert err < 1e-2 and err <= 1.5 * ref_err + 1e-3, (err, ref_err)


def test_auto_chunks_real_vocabularies_only():
    assert chunk_rows_for("auto", 261) > 200_000  # a byte vocabulary: one pass
    assert chunk_rows_for("auto", 151_936) == (1 << 26) // 151_936
    assert chunk_rows_for(0, 32_000) == 0 and chunk_rows_for(128, 32_000) == 128


def test_model_loss_is_the_same_chunked_and_not():
    torch.manual_seed(0)
    cfg = load("configs/tiny.yaml", ["model.loss_chunk_rows=0"])
    model = build_meta_model(cfg.model)
    model.materialize(torch.device("cpu"), seed=0)
    h = torch.randn(3, 9, cfg.model.d_model, requires_grad=True)
    labels = torch.randint(0, cfg.model.vocab_size, (3, 9))
    labels[0, :4] = -100
    whole = model.target_loss_sum(h, labels)
    (g_whole,) = torch.autograd.grad(whole, h)
    model.cfg.loss_chunk_rows = 4
    chunked = model.target_loss_sum(h, labels)
    (g_chunked,) = torch.autograd.grad(chunked, h)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(g_chunked, g_whole, rtol=1e-5, atol=1e-6)


def test_negative_chunk_rows_is_a_config_error():
    with pytest.raises(ConfigError, match="model.loss_chunk_rows"):
        load("configs/tiny.yaml", ["model.loss_chunk_rows=-1"])


def test_the_activation_formula_keeps_no_logits_when_chunked():
    from m6.model.activation_bytes import ActivationShape, activation_bytes

    cfg = load("configs/tiny.yaml", ["model.vocab_size=151936", "model.loss_chunk_rows=0"]).model
    shape = ActivationShape(micro_batch=64, seq_len=cfg.max_text_len, compute_bytes=2)
    whole = activation_bytes(cfg, shape)
    cfg.loss_chunk_rows = "auto"
    chunked = activation_bytes(cfg, shape)
    targets = 64 * (cfg.max_text_len - 1)
    # The fp32 logits and log-sum-exp: V - 1 floats a row; the target rows are kept in bf16 by the
    # unchunked head's GEMM, in fp32 by the chunked loss.
    assert whole.outside_by_unit["head"] - chunked.outside_by_unit["head"] == targets * (4 * (151936 - 1) - 2 * cfg.d_model)
    assert chunked.backward_transient < whole.backward_transient
