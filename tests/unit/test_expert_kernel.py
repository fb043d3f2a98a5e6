"""The grouped-GEMM expert path (torch grouped_mm) against the per-expert loop and the float64 reference.

On CPU torch's grouped_mm runs in fp32 (and bf16) when every stride is a 16-byte multiple, so the
shapes here keep d_model and ffn_dim multiples of 8. Routing is real: a router scores the tokens,
the layer dispatches them, and at E=128 most experts receive no tokens. The CUDA tests at the end
(bf16, the fused Hopper kernel) are skipped without a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from m6.moe import GroupedExperts, MoELayer
from m6.moe.expert_gemm import choose_kernel, fused_grouped_mm_on, grouped_mm_op

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_moe_host_syncs import SyncRecorder  # noqa: E402
from test_moe_layer import _check_routing_margins, _expert_weights, _run_reference  # noqa: E402

pytestmark = pytest.mark.skipif(grouped_mm_op() is None, reason="this torch has no grouped_mm")

D, F = 16, 24  # multiples of 8: 16-byte strides in bf16 and fp32


def _layer_pair(E: int, activation: str, top_k: int, seed: int = 0, device: str = "cpu", dtype=torch.float32):
    """Two identical layers, one per kernel."""
    torch.manual_seed(seed)
    loop = MoELayer(D, F, E, top_k=top_k, capacity_factor=None, activation=activation, expert_kernel="loop")
    with torch.no_grad():
        loop.router.weight.normal_(0.0, 1.0)
        for w in _expert_weights(loop):
            w.normal_(0.0, 0.3)
    grouped = MoELayer(D, F, E, top_k=top_k, capacity_factor=None, activation=activation,
                       expert_kernel="grouped_mm")
    grouped.load_state_dict(loop.state_dict())
    return loop.to(device, dtype), grouped.to(device, dtype)


def _forward_backward(layer: MoELayer, x: torch.Tensor, g_y: torch.Tensor):
    x = x.detach().clone().requires_grad_(True)
    params = [x, layer.router.weight] + _expert_weights(layer)
    y, _ = layer(x)
    grads = torch.autograd.grad((y * g_y).sum(), params)
    return y.detach(), grads


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert torch.isfinite(got).all()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


NAMES = ["x", "router", "w_in", "w_out", "w_gate"]


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("E, T, top_k", [(8, 24, 2), (32, 40, 2), (128, 48, 2)])
def test_grouped_matches_loop_and_float64_reference(E, T, top_k, activation):
    loop, grouped = _layer_pair(E, activation, top_k)
    g = torch.Generator().manual_seed(E)
    x = torch.randn(T, D, generator=g)
    g_y = torch.randn(T, D, generator=g)
    y_loop, grads_loop = _forward_backward(loop, x, g_y)
    y_grp, grads_grp = _forward_backward(grouped, x, g_y)
    assert loop.experts.last_kernel == "loop" and grouped.experts.last_kernel == "grouped_mm"
    counts = grouped.stats.tokens_per_expert.tolist()
    if E == 128:
        assert counts.count(0) > 40, counts  # the zero-token case is really exercised

    ref, ref_params = _run_reference(loop, x, dict(top_k=top_k, activation=activation))
    _check_routing_margins(ref)
    ref_grads = torch.autograd.grad((ref.y_TD * g_y.double()).sum(), ref_params)
    assert _rel_err(y_grp, y_loop) < 1e-5
    assert _rel_err(y_grp, ref.y_TD) < 1e-5
    for n, got, want, want64 in zip(NAMES, grads_grp, grads_loop, ref_grads):
        assert _rel_err(got, want) < 1e-5, n
        assert _rel_err(got, want64) < 1e-5, n
    for n, gw in zip(NAMES[2:], grads_grp[2:]):
        for e, c in enumerate(counts):
            if c == 0:
                assert torch.equal(gw[e], torch.zeros_like(gw[e])), f"{n}[{e}] not exactly zero"
            else:
                assert gw[e].abs().sum() > 0, f"{n}[{e}] has tokens but no gradient"


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_grouped_experts_with_idle_first_and_last_experts(activation):
    """Idle experts at both ends and in the middle; through .backward() the .grad fields exist and
    the idle experts' are exact zeros, even when a stale gradient was there before."""
    splits = (0, 5, 0, 0, 7, 3, 0)
    torch.manual_seed(1)
    loop = GroupedExperts(len(splits), D, F, activation, expert_kernel="loop")
    grouped = GroupedExperts(len(splits), D, F, activation, expert_kernel="grouped_mm")
    grouped.load_state_dict(loop.state_dict())
    x = torch.randn(sum(splits), D)
    for m in (loop, grouped):
        for p in m.parameters():
            p.grad = torch.full_like(p, float("nan"))  # poisoned: must be replaced, not accumulated into
        m.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        m(xx, splits).square().sum().backward()
        m.x_grad = xx.grad
    assert grouped.last_kernel == "grouped_mm"
    assert _rel_err(grouped.x_grad, loop.x_grad) < 1e-5
    for (n, p_loop), p_grp in zip(loop.named_parameters(), grouped.parameters()):
        assert _rel_err(p_grp.grad, p_loop.grad) < 1e-5, n
        for e in (0, 2, 3, 6):
            assert torch.equal(p_grp.grad[e], torch.zeros_like(p_grp.grad[e])), (n, e)


def test_grouped_experts_with_no_rows_at_all():
    experts = GroupedExperts(4, D, F, "swiglu", expert_kernel="grouped_mm")
    x = torch.randn(0, D, requires_grad=True)
    y = experts(x, (0, 0, 0, 0))
    assert y.shape == (0, D)
    (y.sum() + 0 * x.sum()).backward()
    for p in experts.parameters():
        assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p))


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_grouped_cast_on_use_bf16_matches_loop(activation):
    """fp32 weights, bf16 tokens (cast-on-use under autocast): grouped within bf16 rounding of the
    loop, both near the float64 reference, weight grads in fp32, no bf16 weight copy kept."""
    torch.manual_seed(2)
    E, splits = 8, (6, 0, 9, 4, 0, 11, 2, 8)
    loop = GroupedExperts(E, D, F, activation, expert_kernel="loop")
    grouped = GroupedExperts(E, D, F, activation, expert_kernel="grouped_mm")
    grouped.load_state_dict(loop.state_dict())
    x = torch.randn(sum(splits), D)
    out = {}
    for name, m in (("loop", loop), ("grouped", grouped)):
        m.cast_on_use = True
        saved_bf16 = []

        def pack(t):
            if t.dtype == torch.bfloat16 and t.dim() == 3:
                saved_bf16.append(t.shape)
            return t

        xx = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = m(xx, splits)
        assert y.dtype == torch.bfloat16 and saved_bf16 == []
        y.float().square().sum().backward()
        out[name] = (y.float(), xx.grad, [p.grad for p in m.parameters()])
        assert all(p.grad.dtype == torch.float32 for p in m.parameters())
    x64 = x.double().requires_grad_(True)
    w64 = [p.detach().double().requires_grad_(True) for p in loop.parameters()]
    y64 = _float64_experts(x64, splits, w64, activation)
    grads64 = torch.autograd.grad(y64.square().sum(), [x64] + w64)
    y_g, dx_g, dw_g = out["grouped"]
    y_l, dx_l, dw_l = out["loop"]
    assert _rel_err(y_g, y_l) < 1e-2 and _rel_err(y_g, y64) < 1e-2
    assert _rel_err(dx_g, dx_l) < 2e-2 and _rel_err(dx_g, grads64[0]) < 2e-2
    for got, want, want64 in zip(dw_g, dw_l, grads64[1:]):
        assert _rel_err(got, want) < 2e-2 and _rel_err(got, want64) < 2e-2
        for e in (1, 4):
            assert torch.equal(got[e], torch.zeros_like(got[e]))


def _float64_experts(x, splits, weights, activation):
    """Per-expert float64 FFN written out plainly (rows grouped by expert)."""
    w_in, w_out = weights[0], weights[1]
    w_gate = weights[2] if len(weights) == 3 else None
    rows, start = [], 0
    for e, n in enumerate(splits):
        xe = x[start:start + n]
        h = xe @ w_in[e]
        a = torch.nn.functional.silu(xe @ w_gate[e]) * h if activation == "swiglu" else torch.nn.functional.gelu(h)
        rows.append(a @ w_out[e])
        start += n
    return torch.cat(rows)


def test_auto_keeps_the_loop_on_cpu_and_config_key_reaches_the_layer():
    from m6.config import ModelConfig
    from m6.config_loader import ConfigError
    from m6.model.m6_model import build_ffn

    x = torch.randn(10, D)
    w = torch.randn(4, D, F)
    assert choose_kernel("auto", x, [w]) == "loop"
    assert choose_kernel("grouped_mm", x, [w]) == "grouped_mm"
    assert choose_kernel("loop", x, [w]) == "loop"
    cfg = ModelConfig(d_model=D, ffn_dim=F, num_heads=2)
    cfg.moe.expert_kernel = "grouped_mm"
    assert build_ffn(cfg, 0).experts.expert_kernel == "grouped_mm"
    cfg.moe.expert_kernel = "cublas"
    with pytest.raises(ConfigError, match="model.moe.expert_kernel"):
        cfg.moe.validate()
    cfg.moe.expert_kernel, cfg.moe.ffn_dim = "grouped_mm", 20
    with pytest.raises(ConfigError, match="multiples of 8"):
        cfg.validate()
    with pytest.raises(ValueError, match="16-byte strides"):
        choose_kernel("grouped_mm", torch.randn(10, 6), [torch.randn(4, 6, F)])
    with pytest.raises(ValueError, match="expert_kernel"):
        GroupedExperts(2, D, F, expert_kernel="cublas")


@pytest.mark.parametrize("masked", [False, True])
def test_dropless_grouped_forward_and_backward_copy_nothing_to_the_host(monkeypatch, masked):
    """Dropless, experts in this process, grouped_mm: the rows per expert stay on the device (the
    host knows there are T*K of them, padding dispatched with weight 0), so neither pass syncs; the
    result equals the loop's, which reads the counts back and leaves the padding out."""
    import m6.moe.dispatch as dispatch_module

    copies = []
    real = dispatch_module.host_ints
    monkeypatch.setattr(dispatch_module, "host_ints", lambda *t: copies.append(len(t)) or real(*t))
    loop, layer = _layer_pair(8, "swiglu", 2)
    x = torch.randn(3, 10, D)
    mask = torch.rand(3, 10, generator=torch.Generator().manual_seed(1)) > 0.3 if masked else None
    g_y = torch.randn(3, 10, D)
    recorder = SyncRecorder()
    results = {}
    for name, lay in (("grouped", layer), ("loop", loop)):
        copies.clear()
        xx = x.clone().requires_grad_(True)
        with recorder:
            y, aux = lay(xx, mask)
            ((y * g_y).sum() + aux).backward()
        results[name] = (copies[:], [y, xx.grad] + [p.grad for p in lay.parameters()], lay.stats)
    assert layer.experts.last_kernel == "grouped_mm" and loop.experts.last_kernel == "loop"
    assert recorder.syncing == []
    assert results["grouped"][0] == [] and results["loop"][0] == [1]
    for ours, ref in zip(results["grouped"][1], results["loop"][1]):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    if masked:
        assert float(results["grouped"][1][0][~mask].abs().max()) == 0.0  # padding rows get exact zeros
    for field in ("tokens_per_expert", "kept", "dropped", "routed_local"):
        assert torch.equal(getattr(results["grouped"][2], field), getattr(results["loop"][2], field)), field


def test_capacity_keeps_its_host_copy(monkeypatch):
    """With a capacity the kept row count is data-dependent: one host copy per forward remains."""
    import m6.moe.dispatch as dispatch_module

    copies = []
    real = dispatch_module.host_ints
    monkeypatch.setattr(dispatch_module, "host_ints", lambda *t: copies.append(len(t)) or real(*t))
    torch.manual_seed(0)
    layer = MoELayer(D, F, 8, top_k=2, capacity_factor=1.0, expert_kernel="grouped_mm")
    y, aux = layer(torch.randn(3, 10, D, requires_grad=True))
    (y.square().sum() + aux).backward()
    assert layer.experts.last_kernel == "grouped_mm" and len(copies) == 1


def test_grouped_gemms_from_device_counts_zero_idle_experts():
    """The weight gradient of an expert with no rows is an exact zero (masked on the device, as the
    host splits zero it), even where the kernel left its block unwritten."""
    from m6.moe.expert_gemm import GroupedGemms

    splits = [0, 5, 0, 3]
    a, g = torch.randn(8, D), torch.randn(8, F)
    host = GroupedGemms(splits, torch.device("cpu")).weight_grad(a, g)
    dev = GroupedGemms(torch.tensor(splits), torch.device("cpu")).weight_grad(a, g)
    assert torch.equal(host, dev) and float(dev[0].abs().max()) == 0.0 and float(dev[2].abs().max()) == 0.0


# ---------------------------------------------------------------------------------------------
# CUDA: the fused bf16 kernel (compute capability 9.x/10.x) against the loop, within bf16 tolerance.
# On another GPU torch has no fused kernel and m6 refuses grouped_mm (tests/simcuda checks that).
needs_fused_grouped_mm = pytest.mark.skipif(
    not torch.cuda.is_available() or not fused_grouped_mm_on(torch.device("cuda")),
    reason="needs a GPU with torch's fused grouped GEMM (compute capability 9.x or 10.x)")


@needs_fused_grouped_mm
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("E", [8, 32, 128])
def test_cuda_bf16_grouped_matches_loop(E, activation):
    loop, grouped = _layer_pair(E, activation, top_k=2, device="cuda")
    for m in (loop, grouped):
        m.experts.cast_on_use = True
    g = torch.Generator(device="cuda").manual_seed(E)
    T = 1000 + E  # odd per-expert row counts: group offsets not multiples of 8
    x = torch.randn(T, D, device="cuda", generator=g)
    g_y = torch.randn(T, D, device="cuda", generator=g)
    results = {}
    for name, m in (("loop", loop), ("grouped", grouped)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            results[name] = _forward_backward(m, x, g_y.bfloat16())
    auto = MoELayer(D, F, E, top_k=2, capacity_factor=None, activation=activation).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        auto(x)
    assert auto.experts.last_kernel == "grouped_mm"
    counts = grouped.stats.tokens_per_expert.tolist()
    assert any(c % 8 for c in counts)
    y_l, grads_l = results["loop"]
    y_g, grads_g = results["grouped"]
    assert _rel_err(y_g, y_l) < 1e-2
    for n, got, want in zip(NAMES, grads_g, grads_l):
        assert _rel_err(got, want) < 2e-2, n
    for gw in grads_g[2:]:
        for e, c in enumerate(counts):
            if c == 0:
                assert torch.equal(gw[e], torch.zeros_like(gw[e]))


@needs_fused_grouped_mm
@pytest.mark.parametrize("capacity_factor, masked, forward_syncs", [(None, False, 0), (None, True, 0), (1.25, True, 1)])
def test_cuda_grouped_forward_syncs(capacity_factor, masked, forward_syncs):
    """Counted by torch itself: a dropless layer on grouped_mm syncs neither in forward nor in
    backward, padding mask or not; with a capacity the forward reads the kept counts once."""
    import warnings

    _, layer = _layer_pair(16, "swiglu", 2, device="cuda")
    layer.capacity_factor = capacity_factor
    x = torch.randn(4, 64, D, device="cuda", requires_grad=True)
    mask = torch.rand(4, 64, device="cuda") > 0.2 if masked else None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, aux = layer(x, mask)
    (y.float().sum() + aux).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as fwd:
            warnings.simplefilter("always")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y, aux = layer(x, mask)
        with warnings.catch_warnings(record=True) as bwd:
            warnings.simplefilter("always")
            (y.float().sum() + aux).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert layer.experts.last_kernel == "grouped_mm"
    assert len([w for w in fwd if "synchroniz" in str(w.message)]) == forward_syncs
    assert not [w for w in bwd if "synchroniz" in str(w.message)]
