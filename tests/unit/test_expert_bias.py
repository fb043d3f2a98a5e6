"""Auxiliary-loss-free balancing: the bias chooses experts but never weighs them, the update rule, the
counts the training loop totals, and the config's checks. Against loops over tokens and experts."""

from __future__ import annotations

import math

import pytest
import torch

from m6.config import Config, ConfigError
from m6.moe import MoELayer
from m6.moe.router import TopKRouter
from m6.train.expert_bias import ExpertBiasUpdate


def reference_routing(scores_TE: torch.Tensor, bias_E: torch.Tensor, P: int, k: int, normalize: bool):
    """Per token and prototype group: top-k of score + bias, weights the unbiased scores."""
    T, E = scores_TE.shape
    G = E // P
    ids, weights = [], []
    for t in range(T):
        row_ids, row_w = [], []
        for p in range(P):
            group = range(p * G, (p + 1) * G)
            chosen = sorted(group, key=lambda e: -(scores_TE[t, e] + bias_E[e]).item())[:k]
            row_ids += chosen
            row_w += [scores_TE[t, e].item() for e in chosen]
        total = sum(row_w)
        weights.append([w / total for w in row_w] if normalize else row_w)
        ids.append(row_ids)
    return torch.tensor(ids), torch.tensor(weights, dtype=torch.float64)


@pytest.mark.parametrize("score_function, P", [("softmax", 1), ("sigmoid", 1), ("softmax", 2)])
def test_bias_chooses_experts_but_weights_stay_unbiased(score_function, P):
    torch.manual_seed(0)
    T, D, E, k = 24, 8, 8, 2
    router = TopKRouter(D, E, top_k=k, num_prototypes=P, score_function=score_function).double()
    with torch.no_grad():
        router.weight.normal_(std=0.5)
    x = torch.randn(T, D, dtype=torch.float64)
    bias = torch.tensor([0.3, -0.2, 0.0, 0.15, -0.4, 0.25, 0.05, -0.1], dtype=torch.float64)
    unbiased = router(x)
    routed = router(x, bias)
    logits = (x @ router.weight.t()).view(T, P, E // P)
    scores = (torch.softmax(logits, -1) if score_function == "softmax" else torch.sigmoid(logits)).reshape(T, E)
    ids, weights = reference_routing(scores, bias, P, k, normalize=True)
    # Sorted per token: the order inside a token's k choices carries no meaning.
    assert torch.equal(routed.expert_ids_TK.sort(-1).values, ids.sort(-1).values)
    order_ref, order = ids.argsort(-1), routed.expert_ids_TK.argsort(-1)
    torch.testing.assert_close(routed.weights_TK.gather(-1, order), weights.gather(-1, order_ref))
    # The bias changed choices (this bias is large enough to), the probabilities did not move.
    assert not torch.equal(routed.expert_ids_TK.sort(-1).values, unbiased.expert_ids_TK.sort(-1).values)
    torch.testing.assert_close(routed.probs_TE, unbiased.probs_TE, rtol=0, atol=0)
    # Gradients reach the gate through the unbiased scores only: the bias needs none.
    routed.weights_TK.sum().backward()
    assert router.weight.grad is not None and torch.isfinite(router.weight.grad).all()


def test_update_moves_each_expert_toward_its_group_mean():
    layer = MoELayer(8, 16, 8, top_k=1, num_prototypes=2, expert_bias_update_rate=0.01, init_seed=0)
    counts = torch.tensor([5, 1, 3, 3, 0, 4, 4, 4])  # group means 3 and 3
    layer.update_expert_bias(counts)
    layer.update_expert_bias(counts)
    expected = [0.01 * 2 * math.copysign(1, 3 - c) if c != 3 else 0.0 for c in counts.tolist()]
    assert layer.expert_bias.tolist() == pytest.approx(expected, abs=1e-7)
    assert "expert_bias" in layer.state_dict() and not any("bias" in n for n, _ in layer.named_parameters())
    assert "expert_bias" not in MoELayer(8, 16, 8, init_seed=0).state_dict()  # off: no key, old checkpoints load


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_layer_routes_with_the_bias_and_counts_before_capacity(capacity_factor):
    torch.manual_seed(1)
    B, S, D, E, k = 3, 10, 8, 4, 2
    layer = MoELayer(D, 16, E, top_k=k, capacity_factor=capacity_factor, min_capacity=1,
                     expert_bias_update_rate=0.1, init_seed=0).double()
    layer.expert_bias.copy_(torch.tensor([1.0, 0.0, 0.0, -1.0]))  # expert 0 always, expert 3 never chosen
    x = torch.randn(B, S, D, dtype=torch.float64)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[2, 6:] = False  # padding: not routed, not counted
    layer(x, mask)
    assert layer.stats.routed_local.tolist()[0] == int(mask.sum())
    assert layer.stats.routed_local.tolist()[3] == 0
    assert int(layer.stats.routed_local.sum()) == k * int(mask.sum())


def test_step_totals_micro_batches_and_skips_non_finite_steps():
    torch.manual_seed(2)
    layers = {f"block{i}": MoELayer(8, 16, 4, top_k=1, capacity_factor=None, expert_bias_update_rate=0.5,
                                    init_seed=i) for i in range(2)}
    update = ExpertBiasUpdate(layers, group=None, device=torch.device("cpu"))
    totals = {name: torch.zeros(4, dtype=torch.int64) for name in layers}
    for _ in range(3):  # micro-batches
        x = torch.randn(2, 5, 8)
        for name, layer in layers.items():
            layer(x)
            totals[name] += layer.stats.routed_local
        update.add_micro_batch()
    update.step(apply=False)
    assert all(not layer.expert_bias.any() for layer in layers.values())
    for name, layer in layers.items():
        layer(torch.randn(2, 5, 8))
        totals[name] = layer.stats.routed_local.clone()
    update.add_micro_batch()  # the skipped step's counts are gone: only this one's count
    update.step(apply=True)
    for name, layer in layers.items():
        expected = 0.5 * torch.sign(totals[name].double().mean() - totals[name].double())
        assert layer.expert_bias.tolist() == pytest.approx(expected.tolist())
    scalars, vectors = update.log_values()
    assert set(vectors) == set(layers) and scalars["moe/block0/expert_bias_max_abs"] == pytest.approx(0.5)


def test_config_checks_the_rate():
    for overrides, message in (({"expert_bias_update_rate": -0.1}, "model.moe.expert_bias_update_rate"),
                               ({"expert_bias_update_rate": math.inf}, "model.moe.expert_bias_update_rate"),
                               ({"expert_bias_update_rate": 1e-3, "force_balance": True}, "force_balance")):
        cfg = Config()
        for key, value in overrides.items():
            setattr(cfg.model.moe, key, value)
        with pytest.raises(ConfigError, match=message):
            cfg.validate()
    with pytest.raises(ValueError, match="force_balance"):
        MoELayer(8, 16, 4, force_balance=True, expert_bias_update_rate=0.1, init_seed=0)


def test_init_from_weights_saved_without_a_bias_starts_it_at_zero():
    from m6.checkpoint.errors import CheckpointError
    from m6.checkpoint.init_from import plan_init

    saved = {"blocks.1.ffn.router.weight": torch.Size([4, 8]), "blocks.1.ffn.experts.w_in": torch.Size([4, 8, 16])}
    model = {**saved, "blocks.1.ffn.expert_bias": torch.Size([4])}
    plan = plan_init(model, saved, "old-run")
    assert plan.fresh_biases == ["blocks.1.ffn.expert_bias"] and sorted(plan.by_name) == sorted(saved)
    dense = {"blocks.1.ffn.fc_in.weight": torch.Size([16, 8]), "blocks.1.ffn.fc_out.weight": torch.Size([8, 16])}
    upcycled = plan_init({**model, "blocks.1.ffn.experts.w_out": torch.Size([4, 16, 8])}, dense, "dense-run")
    assert "blocks.1.ffn.expert_bias" in upcycled.fresh and upcycled.upcycled == ["blocks.1.ffn."]
    with pytest.raises(CheckpointError, match="missing in checkpoint: blocks.1.ffn.router.weight"):
        plan_init(model, {"blocks.1.ffn.experts.w_in": torch.Size([4, 8, 16])}, "old-run")
