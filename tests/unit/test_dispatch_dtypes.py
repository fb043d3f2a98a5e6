"""The local dispatch's gather and combine in low precision: the rows are gathered in the compute
dtype (cast on the T token rows, not the N = T*K gathered ones) and the combine promotes the expert
outputs as it reads them; both give bitwise the values and gradients of casting the [N, D] rows."""

from __future__ import annotations

import torch

from m6.moe import MoELayer
from m6.moe.dispatch import KeptAssignments, combine_tokens, permute_tokens


def _kept(T: int, K: int, seed: int = 0) -> KeptAssignments:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(T * K, generator=g) % T  # each token K times, in a shuffled (expert) order
    idx[:3] = 0  # a token used more than K times, as uneven routing can't but a gather must allow
    weights = torch.rand(T * K, generator=g, requires_grad=True)
    return KeptAssignments(idx, weights, T)


def test_gather_in_compute_dtype_equals_gather_then_cast():
    T, K, D = 37, 4, 24
    kept = _kept(T, K)
    x = torch.randn(T, D, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    dy = torch.randn(T * K, D).to(torch.bfloat16)
    out = permute_tokens(x, kept, torch.bfloat16)
    ref = x_ref.index_select(0, kept.token_idx_N).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    out.backward(dy)
    ref.backward(dy)
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, x_ref.grad)


def test_combine_promotes_on_read_with_the_same_values_and_gradients():
    T, K, D = 29, 3, 16
    kept = _kept(T, K, seed=1)
    y = torch.randn(T * K, D).to(torch.bfloat16).requires_grad_()
    y_ref = y.detach().clone().requires_grad_()
    w_ref = kept.weights_N.detach().clone().requires_grad_()
    out = combine_tokens(y, kept, torch.float32)
    ref = torch.zeros(T, D).index_add(0, kept.token_idx_N, y_ref.to(torch.float32) * w_ref.unsqueeze(-1))
    assert torch.equal(out, ref)
    dout = torch.randn(T, D)
    out.backward(dout)
    ref.backward(dout)
    assert torch.equal(y.grad, y_ref.grad) and torch.equal(kept.weights_N.grad, w_ref.grad)


def test_moe_layer_under_autocast_gathers_rows_in_the_compute_dtype():
    torch.manual_seed(0)
    layer = MoELayer(16, 32, 4, top_k=2, capacity_factor=None, activation="swiglu")
    x = torch.randn(2, 9, 16, requires_grad=True)
    seen = []
    original = layer.experts.forward
    layer.experts.forward = lambda x_ND, splits: (seen.append(x_ND.dtype), original(x_ND, splits))[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, aux = layer(x)
    (y.float().sum() + aux).backward()
    assert seen == [torch.bfloat16] and x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()
