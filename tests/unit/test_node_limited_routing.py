"""Node-limited routing (model.moe.max_nodes_per_token, DeepSeek-V3's rule): each token's experts
lie in at most M node groups, chosen as a per-token reference loop chooses them; M = G is plain
top-k; the layout check that puts every node group on one node."""

from __future__ import annotations

import math

import pytest
import torch

from m6.config import ConfigError, MoEConfig
from m6.moe import MoELayer
from m6.moe.router import TopKRouter
from m6.parallel import LayoutError, build_layout
from m6.parallel.node_groups import check_node_groups, ep_group_nodes


def _reference_experts(scores_E: list[float], bias_E: list[float], G: int, M: int, k: int) -> set[int]:
    """One token, by hand: group score = sum of its best ceil(k/M) choice scores; M best groups; top-k inside."""
    E = len(scores_E)
    per = E // G
    choice = [s + b for s, b in zip(scores_E, bias_E)]
    group_scores = [sum(sorted(choice[g * per:(g + 1) * per], reverse=True)[:min(per, math.ceil(k / M))])
                    for g in range(G)]
    groups = sorted(range(G), key=lambda g: -group_scores[g])[:M]
    allowed = [e for g in groups for e in range(g * per, (g + 1) * per)]
    return set(sorted(allowed, key=lambda e: -choice[e])[:k])


@pytest.mark.parametrize("E, G, M, k, score, biased", [
    (8, 4, 1, 2, "softmax", False), (8, 4, 2, 3, "sigmoid", False), (16, 4, 2, 4, "softmax", True),
    (12, 3, 2, 1, "sigmoid", True), (8, 2, 1, 4, "softmax", False),
])
def test_each_token_stays_in_its_best_groups(E, G, M, k, score, biased):
    torch.manual_seed(E * 100 + G * 10 + M)
    router = TopKRouter(16, E, k, score_function=score, router_dtype="fp32", node_groups=G,
                        max_nodes_per_token=M).double()
    x = torch.randn(64, 16, dtype=torch.float64) * 20
    bias = torch.randn(E, dtype=torch.float64) * 0.01 if biased else None
    routing = router(x, bias)
    scores = torch.softmax(routing.logits_TE, -1) if score == "softmax" else torch.sigmoid(routing.logits_TE)
    per = E // G
    for t in range(x.shape[0]):
        ids = routing.expert_ids_TK[t].tolist()
        assert len({e // per for e in ids}) <= M
        expected = _reference_experts(scores[t].tolist(), (bias if biased else torch.zeros(E)).tolist(), G, M, k)
        assert set(ids) == expected, t
        # the weights are the chosen experts' own (normalised) scores, as without the limit
        chosen = scores[t, routing.expert_ids_TK[t]]
        torch.testing.assert_close(routing.weights_TK[t], chosen / chosen.sum())


def test_limit_to_every_group_is_plain_top_k():
    torch.manual_seed(0)
    plain = TopKRouter(16, 8, 2, router_dtype="fp32").double()
    limited = TopKRouter(16, 8, 2, router_dtype="fp32", node_groups=4, max_nodes_per_token=4).double()
    limited.load_state_dict(plain.state_dict())
    x = torch.randn(200, 16, dtype=torch.float64) * 10
    a, b = plain(x), limited(x)
    assert torch.equal(a.expert_ids_TK, b.expert_ids_TK)
    assert torch.equal(a.weights_TK, b.weights_TK)
    # and M < G really changes the choice for some tokens (the limit is not a no-op)
    one = TopKRouter(16, 8, 2, router_dtype="fp32", node_groups=4, max_nodes_per_token=1).double()
    one.load_state_dict(plain.state_dict())
    assert not torch.equal(one(x).expert_ids_TK, a.expert_ids_TK)


def test_layer_with_node_limit_runs_forward_and_backward():
    layer = MoELayer(16, 32, 8, top_k=2, capacity_factor=None, node_groups=2, max_nodes_per_token=1)
    x = torch.randn(4, 6, 16, requires_grad=True)
    y, aux = layer(x)
    (y.sum() + aux).backward()
    assert x.grad is not None and layer.router.weight.grad is not None


@pytest.mark.parametrize("overrides, key", [
    (dict(node_groups=3), "model.moe.node_groups"),
    (dict(node_groups=4, max_nodes_per_token=5), "model.moe.max_nodes_per_token"),
    (dict(node_groups=8, max_nodes_per_token=1), "model.moe.top_k"),
    (dict(node_groups=2, max_nodes_per_token=1, num_prototypes=2), "model.moe.num_prototypes"),
])
def test_config_names_the_bad_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        MoEConfig(**{"num_experts": 8, "top_k": 2, "max_nodes_per_token": 1, **overrides}).validate()
    MoEConfig(num_experts=8, top_k=2, node_groups=4, max_nodes_per_token=None).validate()  # null = off
    with pytest.raises(ValueError, match="max_nodes_per_token"):
        TopKRouter(16, 8, 2, node_groups=4, max_nodes_per_token=5)


def test_node_groups_must_fit_the_nodes_of_the_launch():
    # 2 nodes x 2 processes, EP 4 over 8 experts: nodes hold experts 0-3 and 4-7.
    two_nodes = build_layout(4, 1, 4, 8, local_world_size=2)
    assert ep_group_nodes(two_nodes) == [0, 0, 1, 1]
    check_node_groups(two_nodes, 2, 1)
    check_node_groups(two_nodes, 4, 1)  # two groups per node: still one node per group
    with pytest.raises(LayoutError, match=r"model\.moe\.node_groups \(1\).*multiple of 2"):
        check_node_groups(two_nodes, 1, 1)
    check_node_groups(two_nodes, 1, 0)  # routing not limited: nothing to check
    # EP inside one node (EP 2, 2 per node): any grouping fits.
    check_node_groups(build_layout(4, 3, 2, 8, local_world_size=2), 1, 1)
