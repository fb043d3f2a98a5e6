"""MoELayer interface: argument validation, batch invariance, autocast, leading dims, jitter.

Shape legend: T tokens, D d_model, E experts.
"""

from __future__ import annotations

import inspect
import math
import typing

import pytest
import torch

from m6.moe import (Dispatcher, GlobalRoutingStats, LocalDispatcher, LocalRoutingStats, MoELayer,
                    RoutingStatsReducer)
from m6.moe.all_to_all import AllToAllDispatcher


def _make_layer(d_model, ffn_dim, num_experts, seed=0, router_std=1.0, expert_std=0.5, **kwargs) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(d_model, ffn_dim, num_experts, **kwargs)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, router_std)
        for p in layer.experts.parameters():
            p.normal_(0.0, expert_std)
    return layer


# ---------------------------------------------------------------------------------------------
# 5. Dropless batch invariance
@pytest.mark.parametrize("kwargs", [dict(top_k=2), dict(top_k=1, num_prototypes=2, activation="swiglu")])
def test_dropless_token_output_independent_of_batch(kwargs):
    layer = _make_layer(6, 5, 4, capacity_factor=None, **kwargs)
    x = torch.randn(24, 6, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        y_all, _ = layer(x)
        for t in (0, 7, 23):
            y_one, _ = layer(x[t:t + 1])
            torch.testing.assert_close(y_one[0], y_all[t], rtol=1e-5, atol=1e-6)
            y_pair, _ = layer(x[[t, (t + 11) % 24]])
            torch.testing.assert_close(y_pair[0], y_all[t], rtol=1e-5, atol=1e-6)


def test_capacity_output_does_depend_on_batch():
    """Counter-check for the invariance test: with a small capacity, adding tokens drops some."""
    layer = _make_layer(6, 5, 4, top_k=2, capacity_factor=0.5, min_capacity=1)
    x = torch.randn(24, 6, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        y_all, _ = layer(x)
        y_alone = torch.cat([layer(x[t:t + 1])[0] for t in range(24)])
    assert int(layer.stats.dropped) == 0  # the last call was a single token
    assert not torch.allclose(y_all, y_alone)


# ---------------------------------------------------------------------------------------------
# 7. Argument validation
@pytest.mark.parametrize("kwargs, name", [
    (dict(num_experts=4, top_k=5), "top_k"),
    (dict(num_experts=8, top_k=5, num_prototypes=2), "top_k"),
    (dict(num_experts=6, num_prototypes=4), "num_prototypes"),
    (dict(d_model=0), "d_model"),
    (dict(d_model=-3), "d_model"),
    (dict(ffn_dim=0), "ffn_dim"),
    (dict(num_experts=0), "num_experts"),
    (dict(num_experts=-4), "num_experts"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=-1), "top_k"),
    (dict(num_prototypes=0), "num_prototypes"),
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(capacity_factor=-1.25), "capacity_factor"),
    (dict(capacity_factor=float("nan")), "capacity_factor"),
    (dict(min_capacity=-1), "min_capacity"),
    (dict(activation="relu"), "activation"),
    (dict(score_function="sparsemax"), "score_function"),
    (dict(aux_loss_coef=-0.1), "aux_loss_coef"),
    (dict(z_loss_coef=-0.1), "z_loss_coef"),
    (dict(router_jitter=-0.1), "router_jitter"),
    (dict(capacity_factor=float("inf")), "capacity_factor"),
])
def test_bad_arguments_raise_value_error_naming_argument(kwargs, name):
    args = dict(d_model=8, ffn_dim=16, num_experts=4, top_k=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        MoELayer(**args)


def test_wrong_input_last_dim_raises():
    layer = MoELayer(8, 16, 4)
    with pytest.raises(ValueError, match="d_model"):
        layer(torch.randn(3, 7))
    with pytest.raises(ValueError, match="d_model"):
        layer(torch.randn(2, 3, 9))


# ---------------------------------------------------------------------------------------------
# 8. Stats bounds and autocast
def test_entropy_bounds_reached():
    E = 4
    layer = _make_layer(6, 5, E, top_k=1, capacity_factor=None)
    x = torch.randn(8, 6)
    with torch.no_grad():
        layer.router.weight.zero_()  # undecided router: uniform scores
        layer(x)
        assert float(layer.stats.router_entropy) == pytest.approx(math.log(E), rel=1e-6)
        assert int(layer.stats.dropped) == 0 and float(layer.stats.dropped_fraction) == 0.0
        layer.router.weight.copy_(torch.eye(E, 6) * 200.0)  # decided router: one-hot scores
        layer(torch.eye(6)[:E].expand(8 // E, E, 6).reshape(8, 6))
        assert float(layer.stats.router_entropy) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_autocast_router_in_fp32_and_output_in_input_dtype(in_dtype):
    layer = _make_layer(6, 5, 4, top_k=2, capacity_factor=None, activation="swiglu")
    seen = {}
    layer.router.register_forward_hook(lambda m, i, out: seen.update(logits=out.logits_TE, w=out.weights_TK))
    x = torch.randn(10, 6, generator=torch.Generator().manual_seed(1)).to(in_dtype)
    with torch.no_grad():
        y_ref, _ = layer(x.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, aux = layer(x)
    assert seen["logits"].dtype == torch.float32
    assert seen["w"].dtype == torch.float32
    assert y.dtype == in_dtype
    assert aux.dtype == torch.float32
    torch.testing.assert_close(y.float(), y_ref, rtol=5e-2, atol=5e-2 * y_ref.abs().max().item())
    (y.float().sum() + aux).backward()
    for p in layer.parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# 9. Leading dims
@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_leading_dims_flatten(capacity_factor):
    """capacity_group="batch": leading dims are just flattened. Dropless: the same either way."""
    D = 6
    layer = _make_layer(D, 5, 4, top_k=2, capacity_factor=capacity_factor, min_capacity=1, capacity_group="batch")
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        y, aux = layer(x)
        stats_3d = layer.stats
        y_flat, aux_flat = layer(x.reshape(-1, D))
        stats_flat = layer.stats
        layer.capacity_group = "sequence"
        y_seq, _ = layer(x)
    assert y.shape == (3, 5, D)
    assert torch.equal(y, y_flat.reshape(3, 5, D))
    assert torch.equal(aux, aux_flat)
    assert torch.equal(stats_3d.tokens_per_expert, stats_flat.tokens_per_expert)
    assert torch.equal(stats_3d.dropped, stats_flat.dropped)
    assert torch.equal(y_seq, y) == (capacity_factor is None)


def test_sequence_capacity_groups_are_each_sequence_alone():
    """capacity_group="sequence" (default): a [B, S, D] batch keeps, per sequence, exactly what that
    sequence alone keeps, so splitting a batch over processes or micro-batches changes nothing."""
    D = 6
    layer = _make_layer(D, 5, 4, top_k=2, capacity_factor=0.5, min_capacity=1)
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(6))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    with torch.no_grad():
        y, aux = layer(x, mask)
        dropped, counts = layer.stats.dropped, layer.stats.tokens_per_expert
        alone, alone_dropped = [], 0
        for b in range(3):
            alone.append(layer(x[b:b + 1], mask[b:b + 1]))
            alone_dropped += int(layer.stats.dropped)
        y_split, _ = layer(x[1:], mask[1:])
    assert int(dropped) > 0 and int(dropped) == alone_dropped
    assert torch.equal(y, torch.cat([ya for ya, _ in alone]))
    assert torch.equal(y[1:], y_split)
    assert torch.equal(y[~mask], torch.zeros(int((~mask).sum()), D))
    assert int(counts.sum()) == 2 * int(mask.sum())


def test_single_vector_and_empty_batch():
    D = 6
    layer = _make_layer(D, 5, 4, top_k=2)
    x = torch.randn(D)
    with torch.no_grad():
        y, _ = layer(x)
        y2, _ = layer(x.reshape(1, D))
    assert y.shape == (D,) and torch.equal(y, y2[0])
    empty = torch.randn(2, 0, D, requires_grad=True)
    y, aux = layer(empty)
    assert y.shape == (2, 0, D) and torch.isfinite(aux)
    (y.sum() + aux).backward()
    assert int(layer.stats.tokens_per_expert.sum()) == 0


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [dict(top_k=2), dict(top_k=3, num_prototypes=2)])
def test_force_balance_gives_every_expert_the_same_count_and_trains_the_gate(kwargs):
    E, T = 8, 37
    layer = _make_layer(6, 5, E, capacity_factor=None, force_balance=True, **kwargs)
    # Inputs that the router alone would send to very few experts.
    x = torch.randn(1, 6).repeat(T, 1) + 0.01 * torch.randn(T, 6, generator=torch.Generator().manual_seed(3))
    routing = layer.router(x)
    ids = routing.expert_ids_TK
    K = layer.router.num_assignments
    assert ids.shape == (T, K)
    assert all(len(set(row.tolist())) == K for row in ids)  # distinct experts per token
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    assert int(counts.max() - counts.min()) <= 1 and int(counts.sum()) == T * K
    free = _make_layer(6, 5, E, capacity_factor=None, **kwargs)
    assert int(torch.bincount(free.router(x).expert_ids_TK.reshape(-1), minlength=E).max()) >= T  # unbalanced
    y, aux = layer(x)
    (y.sum() + aux).backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------
def test_router_jitter_only_in_training():
    layer = _make_layer(6, 5, 8, top_k=2, capacity_factor=None, router_jitter=0.5)
    plain = _make_layer(6, 5, 8, top_k=2, capacity_factor=None)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(32, 6, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        layer.eval(), plain.eval()
        assert torch.equal(layer(x)[0], plain(x)[0])
        layer.train()
        torch.manual_seed(0)
        assert not torch.equal(layer(x)[0], plain(x)[0])


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_token_mask_keeps_padding_out_of_routing(capacity_factor):
    torch.manual_seed(0)
    # One routing group for the whole call, so the real tokens alone form the same group.
    layer = MoELayer(8, 16, 4, top_k=2, capacity_factor=capacity_factor, min_capacity=1,
                     capacity_group="batch").double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    mask = torch.rand(3, 5) > 0.4
    y, aux = layer(x, mask)
    counts, dropped = layer.stats.tokens_per_expert.clone(), layer.stats.dropped.clone()
    y_real, aux_real = layer(x[mask])  # the real tokens alone
    assert torch.equal(y[~mask], torch.zeros_like(y[~mask]))
    torch.testing.assert_close(y[mask], y_real, rtol=0, atol=1e-12)
    torch.testing.assert_close(aux, aux_real, rtol=0, atol=1e-12)
    assert torch.equal(counts, layer.stats.tokens_per_expert) and int(counts.sum()) == 2 * int(mask.sum())
    assert int(dropped) == int(layer.stats.dropped)
    with pytest.raises(ValueError, match="token_mask"):
        layer(x, mask[:, :4])


# ---------------------------------------------------------------------------------------------
# Dispatcher and routing-stats reducer protocols
@pytest.mark.parametrize("cls", [LocalDispatcher, AllToAllDispatcher])
def test_dispatchers_implement_the_protocol(cls):
    assert issubclass(cls, Dispatcher)
    for name in ("dispatch", "combine"):
        method = getattr(cls, name)
        assert method is not getattr(Dispatcher, name), f"{cls.__name__}.{name} is not implemented"
        # Called positionally by the layer: same number of positional parameters as the protocol.
        assert len(inspect.signature(method).parameters) == len(inspect.signature(getattr(Dispatcher, name)).parameters)


def test_layer_dispatcher_is_typed_as_the_protocol():
    assert typing.get_type_hints(MoELayer)["dispatcher"] is Dispatcher
    layer = MoELayer(8, 16, 4)
    assert isinstance(layer.dispatcher, Dispatcher)


def test_routing_stats_reducers_implement_the_protocol():
    assert typing.get_type_hints(MoELayer)["stats_reducer"] is RoutingStatsReducer
    assert isinstance(MoELayer(8, 16, 4).stats_reducer, LocalRoutingStats)
    assert isinstance(GlobalRoutingStats(group=None), RoutingStatsReducer)
    local = LocalRoutingStats()
    assert isinstance(local, RoutingStatsReducer)
    sums = (torch.tensor([3, 1]), torch.tensor([1.5, 0.5]), torch.tensor(2.0), torch.tensor(2.0))
    assert all(a is b for a, b in zip(local(*sums), sums))
