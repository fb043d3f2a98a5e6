"""MoELayer against a slow, obviously-correct per-token reference (outputs, gradients, losses, stats).

The reference below loops over tokens, experts and assignments in float64 Python, written from the
contract alone (it imports nothing from m6 but the layer it compares with). The layer's parameters
are copied into it, and both sides are differentiated with torch.autograd.grad.

Shape legend: T tokens, D d_model, F ffn_dim, E experts, P prototypes, K = P * top_k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from torch.func import functional_call

from m6.moe import GroupedExperts, MoELayer

# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Reference
@dataclass
class Ref:
    y_TD: torch.Tensor
    balance: torch.Tensor
    z_loss: torch.Tensor
    aux_loss: torch.Tensor
    routed_counts: list[int]
    kept: set = field(default_factory=set)      # {(token, k)}
    dropped: int = 0
    entropy: float = 0.0
    topk_margin: float = math.inf                # smallest gap between the k-th and (k+1)-th score
    capacity_margin: float = math.inf            # smallest non-zero weight gap at a capacity boundary


def _gelu(h):
    return 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))


def _silu(g):
    return g / (1.0 + torch.exp(-g))


def _expert_ffn(x_D, e, w_in, w_out, w_gate, activation):
    h = x_D @ w_in[e]
    a = _silu(x_D @ w_gate[e]) * h if activation == "swiglu" else _gelu(h)
    return a @ w_out[e]


def reference_moe(x_TD, router_w, w_in, w_out, w_gate, *, top_k, num_prototypes=1, score_function="softmax",
                  normalize_weights=True, capacity=None, activation="gelu", aux_loss_coef=1e-2,
                  z_loss_coef=1e-3) -> Ref:
    T, D = x_TD.shape
    E = router_w.shape[0]
    P = num_prototypes
    G = E // P
    K = P * top_k
    logits, probs, assignments = [], [], []  # assignments[t][k] = (expert, weight)
    topk_margin = math.inf
    for t in range(T):
        logit = torch.stack([torch.dot(router_w[e], x_TD[t]) for e in range(E)])
        scores = []
        chosen = []
        for p in range(P):
            group = logit[p * G:(p + 1) * G]
            if score_function == "softmax":
                ex = torch.exp(group - group.max().detach())
                s = ex / ex.sum()
            else:
                s = 1.0 / (1.0 + torch.exp(-group))
            scores.append(s)
            order = sorted(range(G), key=lambda i: -s[i].item())
            if top_k < G:
                topk_margin = min(topk_margin, s[order[top_k - 1]].item() - s[order[top_k]].item())
            chosen += [(p * G + i, s[i]) for i in order[:top_k]]
        if normalize_weights:
            total = sum(w for _, w in chosen)
            chosen = [(e, w / total) for e, w in chosen]
        scores_E = torch.cat(scores)
        logits.append(logit)
        probs.append(scores_E / scores_E.sum())
        assignments.append(chosen)

    routed = [[(t, k) for t in range(T) for k in range(K) if assignments[t][k][0] == e] for e in range(E)]
    kept, capacity_margin = set(), math.inf
    for e in range(E):
        slots = sorted(routed[e], key=lambda tk: (-assignments[tk[0]][tk[1]][1].item(), tk[0] * K + tk[1]))
        if capacity is not None and len(slots) > capacity:
            if capacity > 0:
                gap = (assignments[slots[capacity - 1][0]][slots[capacity - 1][1]][1].item()
                       - assignments[slots[capacity][0]][slots[capacity][1]][1].item())
                if gap > 0:
                    capacity_margin = min(capacity_margin, gap)
            slots = slots[:capacity]
        kept.update(slots)

    rows = []
    for t in range(T):
        acc = torch.zeros(D, dtype=x_TD.dtype)
        for k, (e, w) in enumerate(assignments[t]):
            if (t, k) in kept:
                acc = acc + w * _expert_ffn(x_TD[t], e, w_in, w_out, w_gate, activation)
        rows.append(acc)
    y_TD = torch.stack(rows) if rows else x_TD.new_zeros(0, D)

    counts = [len(r) for r in routed]
    balance = E * sum((counts[e] / (T * K)) * (sum(probs[t][e] for t in range(T)) / T) for e in range(E))
    z = 0.0
    for t in range(T):
        m = logits[t].max().detach()
        z = z + (m + torch.log(torch.exp(logits[t] - m).sum())) ** 2
    z = z / T
    entropy = sum(-sum(p * math.log(p) for p in probs[t].tolist()) for t in range(T)) / T
    return Ref(y_TD, balance, z, aux_loss_coef * balance + z_loss_coef * z, counts, kept,
               T * K - len(kept), entropy, topk_margin, capacity_margin)


# ---------------------------------------------------------------------------------------------
# Helpers
def _make_layer(d_model, ffn_dim, num_experts, seed=0, router_std=1.0, expert_std=0.5, **kwargs) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(d_model, ffn_dim, num_experts, **kwargs)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, router_std)
        for w in _expert_weights(layer):
            w.normal_(0.0, expert_std)
    return layer


def _expert_weights(layer: MoELayer) -> list[torch.Tensor]:
    ex = layer.experts
    return [ex.w_in, ex.w_out] + ([ex.w_gate] if ex.w_gate is not None else [])


def _run_reference(layer: MoELayer, x: torch.Tensor, cfg: dict, requires_grad=True):
    """Float64 leaf copies of x and every parameter, and the reference on them."""
    x64 = x.detach().cpu().double().requires_grad_(requires_grad)
    router64 = layer.router.weight.detach().cpu().double().requires_grad_(requires_grad)
    experts64 = [w.detach().cpu().double().requires_grad_(requires_grad) for w in _expert_weights(layer)]
    w_gate = experts64[2] if len(experts64) == 3 else None
    T, E, K = x.shape[0], layer.num_experts, cfg.get("top_k", 2) * cfg.get("num_prototypes", 1)
    cf = layer.capacity_factor
    capacity = None if cf is None else max(layer.min_capacity, math.ceil(cf * T * K / E))
    assert layer.capacity(T) == capacity
    ref = reference_moe(x64, router64, experts64[0], experts64[1], w_gate, capacity=capacity,
                        aux_loss_coef=layer.aux_loss_coef, z_loss_coef=layer.z_loss_coef, **cfg)
    return ref, [x64, router64] + experts64


def _assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str):
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def _ref_cfg(layer_kwargs: dict) -> dict:
    keys = ("top_k", "num_prototypes", "score_function", "normalize_weights", "activation")
    return {k: layer_kwargs[k] for k in keys if k in layer_kwargs}


# ---------------------------------------------------------------------------------------------
# 1. Outputs and gradients against the reference
CASES = {
    # name: (E, T, layer kwargs); capacity cases pick capacity_factor so that tokens drop
    "top1_dropless_gelu_softmax": (4, 12, dict(top_k=1, capacity_factor=None)),
    "top1_capacity_ties_swiglu": (4, 16, dict(top_k=1, capacity_factor=0.5, min_capacity=1, activation="swiglu")),
    "top1_capacity_sigmoid_unnorm": (4, 16, dict(top_k=1, capacity_factor=0.5, min_capacity=1,
                                                 score_function="sigmoid", normalize_weights=False)),
    "top2_dropless_swiglu": (4, 12, dict(top_k=2, capacity_factor=None, activation="swiglu")),
    "top2_capacity_gelu": (4, 16, dict(top_k=2, capacity_factor=0.5, min_capacity=1)),
    "top2_dropless_softmax_unnorm": (6, 12, dict(top_k=2, capacity_factor=None, normalize_weights=False)),
    "top2_capacity_sigmoid_swiglu": (6, 16, dict(top_k=2, capacity_factor=0.6, min_capacity=1,
                                                 score_function="sigmoid", activation="swiglu")),
    "top4_dropless_sigmoid": (8, 12, dict(top_k=4, capacity_factor=None, score_function="sigmoid")),
    "top4_capacity_swiglu_unnorm": (8, 12, dict(top_k=4, capacity_factor=0.5, min_capacity=1,
                                                activation="swiglu", normalize_weights=False)),
    "proto2_top1_capacity": (8, 16, dict(top_k=1, num_prototypes=2, capacity_factor=0.5, min_capacity=1)),
    "proto4_top1_dropless_swiglu_sigmoid": (8, 12, dict(top_k=1, num_prototypes=4, capacity_factor=None,
                                                        activation="swiglu", score_function="sigmoid")),
    "proto4_top1_capacity_unnorm": (8, 16, dict(top_k=1, num_prototypes=4, capacity_factor=0.5, min_capacity=1,
                                                normalize_weights=False)),
    "proto2_top2_dropless_gelu": (8, 12, dict(top_k=2, num_prototypes=2, capacity_factor=None)),
}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float64, id="fp64")]
DTYPES_LOSS = DTYPES
TOL = {torch.float32: 2e-5, torch.float64: 1e-10}


def _case(name: str, dtype: torch.dtype, seed: int = 0, device: torch.device = torch.device("cpu")):
    E, T, kwargs = CASES[name]
    D, F = 6, 5
    # router_dtype fp32: the reference is exact fp32/fp64 math; auto would take TF32 on CUDA (~1e-3).
    layer = _make_layer(D, F, E, seed=seed, router_dtype="fp32", **kwargs).to(device, dtype)
    x = torch.randn(T, D, dtype=dtype, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    return layer, x, kwargs


def _check_routing_margins(ref: Ref):
    # fp32 vs fp64 must make the same discrete choices; a failure here means "pick another seed".
    assert ref.topk_margin > 1e-5, f"top-k near-tie ({ref.topk_margin})"
    assert ref.capacity_margin > 1e-5, f"capacity near-tie ({ref.capacity_margin})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_output_and_grads_match_reference(name, dtype, device):
    layer, x, kwargs = _case(name, dtype, device=device)
    x.requires_grad_(True)
    params = [x, layer.router.weight] + _expert_weights(layer)
    y, _ = layer(x)
    ref, ref_params = _run_reference(layer, x, _ref_cfg(kwargs))
    _check_routing_margins(ref)
    if kwargs.get("capacity_factor") is not None:
        assert ref.dropped > 0, "capacity case drops nothing: lower capacity_factor"
    assert layer.stats.tokens_per_expert.tolist() == ref.routed_counts
    assert int(layer.stats.dropped) == ref.dropped

    _assert_close(y, ref.y_TD, TOL[dtype], "output")
    g_y = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    grads = torch.autograd.grad((y * g_y.to(device, dtype)).sum(), params)
    ref_grads = torch.autograd.grad((ref.y_TD * g_y).sum(), ref_params)
    names = ["x", "router.weight", "w_in", "w_out", "w_gate"]
    for n, got, want in zip(names, grads, ref_grads):
        _assert_close(got, want, TOL[dtype], f"grad {n}")


@pytest.mark.parametrize("dtype", DTYPES_LOSS)
@pytest.mark.parametrize("name", ["top2_capacity_gelu", "top4_dropless_sigmoid", "proto2_top1_capacity",
                                  "proto4_top1_dropless_swiglu_sigmoid", "top2_dropless_softmax_unnorm"])
def test_aux_loss_and_grads_match_reference(name, dtype):
    layer, x, kwargs = _case(name, dtype)
    layer.aux_loss_coef, layer.z_loss_coef = 0.3, 0.05  # large enough that both terms matter
    x.requires_grad_(True)
    _, aux = layer(x)
    ref, ref_params = _run_reference(layer, x, _ref_cfg(kwargs))
    _check_routing_margins(ref)
    _assert_close(aux, ref.aux_loss, TOL[dtype], "aux_loss")
    _assert_close(layer.stats.aux_loss, ref.balance, TOL[dtype], "stats.aux_loss")
    _assert_close(layer.stats.z_loss, ref.z_loss, TOL[dtype], "stats.z_loss")
    grads = torch.autograd.grad(aux, [x, layer.router.weight])
    ref_grads = torch.autograd.grad(ref.aux_loss, ref_params[:2])
    for n, got, want in zip(["x", "router.weight"], grads, ref_grads):
        _assert_close(got, want, TOL[dtype], f"aux grad {n}")


def test_reference_capacity_cases_really_drop_and_tie():
    """Guards the parametrisation: top-1 with renormalised weights ties every weight at 1, so the
    capacity rule falls back to flat order; the reference must agree with the layer there too."""
    layer, x, kwargs = _case("top1_capacity_ties_swiglu", torch.float32)
    ref, _ = _run_reference(layer, x, _ref_cfg(kwargs), requires_grad=False)
    assert ref.dropped > 0
    assert ref.capacity_margin == math.inf  # every boundary was an exact tie


# ---------------------------------------------------------------------------------------------
# 4. gradcheck
def _gradcheck_layer(activation, score_function, num_prototypes, which):
    torch.manual_seed(0)
    layer = MoELayer(3, 4, 4, top_k=1 if num_prototypes > 1 else 2, capacity_factor=None,
                     num_prototypes=num_prototypes, activation=activation, score_function=score_function,
                     aux_loss_coef=0.3, z_loss_coef=0.05).double()
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 2.0)
        for w in _expert_weights(layer):
            w.normal_(0.0, 0.7)
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ref, _ = _run_reference(layer, x, dict(top_k=layer.router.top_k, num_prototypes=num_prototypes,
                                           score_function=score_function, activation=activation),
                            requires_grad=False)
    assert ref.topk_margin > 1e-3  # finite differences cannot flip the routing
    names = [n for n, _ in layer.named_parameters()]
    inputs = (x.requires_grad_(True),) + tuple(p.detach().clone().requires_grad_(True) for p in layer.parameters())

    def fn(x_, *ps):
        y, aux = functional_call(layer, dict(zip(names, ps)), (x_,))
        return y if which == "y" else aux

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("activation, score_function, num_prototypes",
                         [("swiglu", "softmax", 1), ("gelu", "sigmoid", 2)])
def test_gradcheck_layer_output(activation, score_function, num_prototypes):
    _gradcheck_layer(activation, score_function, num_prototypes, "y")


@pytest.mark.parametrize("activation, score_function, num_prototypes",
                         [("swiglu", "softmax", 1), ("gelu", "sigmoid", 2)])
def test_gradcheck_layer_aux_loss(activation, score_function, num_prototypes):
    _gradcheck_layer(activation, score_function, num_prototypes, "aux")


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_gradcheck_grouped_experts(activation):
    """The hand-written expert backward in float64, with an expert that receives no tokens."""
    torch.manual_seed(0)
    experts = GroupedExperts(3, 3, 4, activation).double()
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.7)
    names = [n for n, _ in experts.named_parameters()]
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    inputs = (x,) + tuple(p.detach().clone().requires_grad_(True) for p in experts.parameters())
    splits = (2, 0, 3)

    def fn(x_, *ps):
        return functional_call(experts, dict(zip(names, ps)), (x_, splits))

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# 6. Experts that receive no tokens
@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_all_tokens_to_one_expert(capacity_factor, device):
    E, D, T, hot = 4, 5, 10, 2
    layer = _make_layer(D, 3, E, top_k=1, capacity_factor=capacity_factor, min_capacity=1, activation="swiglu")
    layer.to(device)
    with torch.no_grad():
        layer.router.weight.mul_(0.1)
        layer.router.weight[hot, 0] = 20.0
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(2))
    x[:, 0] = 1.0  # a constant feature acts as the router bias toward expert `hot`
    x = x.to(device).requires_grad_(True)
    params = [x, layer.router.weight] + _expert_weights(layer)
    y, _ = layer(x)
    ref, ref_params = _run_reference(layer, x, dict(top_k=1, activation="swiglu"))
    assert ref.routed_counts == [0, 0, T, 0]
    assert layer.stats.tokens_per_expert.tolist() == [0, 0, T, 0]
    if capacity_factor is not None:
        assert ref.dropped == T - layer.capacity(T) > 0
        # all weights tie at 1.0: the first `capacity` tokens are the kept ones
        assert ref.kept == {(t, 0) for t in range(layer.capacity(T))}
        assert torch.equal(y[layer.capacity(T):].cpu(), torch.zeros(T - layer.capacity(T), D))
    _assert_close(y, ref.y_TD, 2e-5, "output")

    g_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(4))
    grads = torch.autograd.grad((y * g_y.to(device)).sum(), params)
    ref_grads = torch.autograd.grad((ref.y_TD * g_y.double()).sum(), ref_params)
    for n, got, want in zip(["x", "router", "w_in", "w_out", "w_gate"], grads, ref_grads):
        _assert_close(got, want, 2e-5, f"grad {n}")
    for n, g in zip(["w_in", "w_out", "w_gate"], grads[2:]):
        for e in range(E):
            if e != hot:
                assert torch.equal(g[e], torch.zeros_like(g[e])), f"{n}[{e}] grad not exactly zero"
        assert g[hot].abs().sum() > 0

    # through .backward(): the .grad fields exist (not None) and are exact zeros for idle experts
    layer.zero_grad(set_to_none=True)
    y, aux = layer(x.detach())
    (y.square().sum() + aux).backward()
    for w in _expert_weights(layer):
        assert w.grad is not None
        assert torch.equal(w.grad[[0, 1, 3]], torch.zeros_like(w.grad[[0, 1, 3]]))


# ---------------------------------------------------------------------------------------------
# 8. Stats
def test_stats_match_reference():
    E, T, K = 4, 20, 2
    layer = _make_layer(6, 5, E, top_k=K, capacity_factor=0.5, min_capacity=1)
    x = torch.randn(T, 6, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        layer(x)
    ref, _ = _run_reference(layer, x, dict(top_k=K), requires_grad=False)
    st = layer.stats
    assert st.tokens_per_expert.dtype == torch.int64
    assert st.tokens_per_expert.tolist() == ref.routed_counts
    assert int(st.tokens_per_expert.sum()) == T * K
    assert ref.dropped > 0 and int(st.dropped) == ref.dropped
    assert float(st.dropped_fraction) == pytest.approx(ref.dropped / (T * K), rel=1e-6)
    assert float(st.router_entropy) == pytest.approx(ref.entropy, rel=1e-5)
    assert 0.0 <= float(st.router_entropy) <= math.log(E)
