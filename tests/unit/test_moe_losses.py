"""Balance loss and z-loss of m6.moe.MoELayer on routings whose numbers are worked out by hand.

The router is made transparent: d_model = E and router.weight = identity, so the logits are the
input itself; inputs are logs of small integers so every softmax / sigmoid is a simple fraction.
"""

from __future__ import annotations

import math

import pytest
import torch

from m6.moe import MoELayer


def _transparent_layer(num_experts: int, **kwargs) -> MoELayer:
    layer = MoELayer(d_model=num_experts, ffn_dim=3, num_experts=num_experts, capacity_factor=None,
                     aux_loss_coef=0.5, z_loss_coef=0.25, **kwargs)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(num_experts))
    return layer


def _log(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).log().float()


def test_softmax_top2_losses_by_hand():
    # token 0: exp(logits) = 1,2,3,4 (sum 10) -> probs .1 .2 .3 .4, picks experts 3, 2
    # token 1: exp(logits) = 4,3,2,1 (sum 10) -> probs .4 .3 .2 .1, picks experts 0, 1
    # token 2: exp(logits) = 1,1,2,6 (sum 10) -> probs .1 .1 .2 .6, picks experts 3, 2
    layer = _transparent_layer(4, top_k=2)
    x = _log([[1, 2, 3, 4], [4, 3, 2, 1], [1, 1, 2, 6]])
    _, aux = layer(x)
    # f = routed counts / (T*K) = [1, 1, 2, 2] / 6
    # P = mean probs = [.6/3, .6/3, .7/3, 1.1/3] = [.2, .2, 7/30, 11/30]
    # balance = 4 * (.2/6 + .2/6 + (2/6)(7/30) + (2/6)(11/30)) = 4 * (1/15 + 1/5) = 16/15
    balance = 16 / 15
    z = math.log(10) ** 2  # every token's logsumexp is log(10)
    assert layer.stats.tokens_per_expert.tolist() == [1, 1, 2, 2]
    assert float(layer.stats.aux_loss) == pytest.approx(balance, rel=1e-6)
    assert float(layer.stats.z_loss) == pytest.approx(z, rel=1e-6)
    assert float(aux.detach()) == pytest.approx(0.5 * balance + 0.25 * z, rel=1e-6)

    routing = layer.router(x)
    assert routing.expert_ids_TK.tolist() == [[3, 2], [0, 1], [3, 2]]
    # renormalised over the two picks: 4/7, 3/7 ; 4/7, 3/7 ; 6/8, 2/8
    assert routing.weights_TK.flatten().tolist() == pytest.approx([4 / 7, 3 / 7, 4 / 7, 3 / 7, 0.75, 0.25],
                                                                  rel=1e-6)


def test_softmax_top1_one_hot_losses_by_hand():
    # logits = ln(3) * one-hot: exp = 3,1,1,1 (sum 6) -> prob 1/2 on the hot expert, 1/6 elsewhere.
    layer = _transparent_layer(4, top_k=1)
    x = torch.eye(4)[[0, 0, 1, 2]] * math.log(3)
    _, aux = layer(x)
    # f = [2, 1, 1, 0] / 4
    # P = ([1/2,1/6,1/6,1/6]*2 + [1/6,1/2,1/6,1/6] + [1/6,1/6,1/2,1/6]) / 4 = [1/3, 1/4, 1/4, 1/6]
    # balance = 4 * (1/2 * 1/3 + 1/4 * 1/4 + 1/4 * 1/4) = 4 * 7/24 = 7/6
    balance = 7 / 6
    z = math.log(6) ** 2
    assert layer.stats.tokens_per_expert.tolist() == [2, 1, 1, 0]
    assert float(layer.stats.aux_loss) == pytest.approx(balance, rel=1e-6)
    assert float(layer.stats.z_loss) == pytest.approx(z, rel=1e-6)
    assert float(aux.detach()) == pytest.approx(0.5 * balance + 0.25 * z, rel=1e-6)
    # top-1 with renormalisation: every combine weight is exactly 1
    assert torch.equal(layer.router(x).weights_TK, torch.ones(4, 1))


def test_sigmoid_unnormalised_losses_by_hand():
    # sigmoid(0) = 1/2, sigmoid(ln 3) = 3/4, sigmoid(-ln 3) = 1/4
    layer = _transparent_layer(2, top_k=1, score_function="sigmoid", normalize_weights=False)
    x = torch.tensor([[0.0, math.log(3)], [math.log(3), -math.log(3)], [0.0, math.log(3)]])
    _, aux = layer(x)
    # scores: [1/2, 3/4] -> expert 1 ; [3/4, 1/4] -> expert 0 ; [1/2, 3/4] -> expert 1
    # P uses scores normalised over E: [2/5, 3/5], [3/4, 1/4], [2/5, 3/5] -> mean [1.55/3, 1.45/3]
    # f = [1/3, 2/3]; balance = 2 * (1.55/9 + 2.9/9) = 8.9/9
    balance = 8.9 / 9
    z = (2 * math.log(4) ** 2 + math.log(10 / 3) ** 2) / 3  # lse(0, ln3) = ln 4; lse(ln3, -ln3) = ln(10/3)
    assert layer.stats.tokens_per_expert.tolist() == [1, 2]
    assert float(layer.stats.aux_loss) == pytest.approx(balance, rel=1e-6)
    assert float(layer.stats.z_loss) == pytest.approx(z, rel=1e-6)
    assert float(aux.detach()) == pytest.approx(0.5 * balance + 0.25 * z, rel=1e-6)
    # no renormalisation: the combine weight is the raw sigmoid score
    assert layer.router(x).weights_TK.flatten().tolist() == pytest.approx([0.75, 0.75, 0.75], rel=1e-6)
    # mean entropy of [2/5, 3/5], [3/4, 1/4], [2/5, 3/5]
    h = lambda ps: -sum(p * math.log(p) for p in ps)  # noqa: E731
    entropy = (2 * h([0.4, 0.6]) + h([0.75, 0.25])) / 3
    assert float(layer.stats.router_entropy) == pytest.approx(entropy, rel=1e-6)


def test_prototype_losses_by_hand():
    # E=4 in P=2 groups {0,1} {2,3}; exp(logits) = 1,3,3,1.
    # group softmaxes: [1/4, 3/4] and [3/4, 1/4] -> picks expert 1 and expert 2, weights 1/2 each.
    layer = _transparent_layer(4, top_k=1, num_prototypes=2)
    x = _log([[1, 3, 3, 1]])
    _, aux = layer(x)
    # P (scores over all E normalised to 1) = [1/8, 3/8, 3/8, 1/8]; f = [0, 1/2, 1/2, 0]
    # balance = 4 * (3/16 + 3/16) = 3/2 ; z uses logsumexp over all E: ln(1+3+3+1) = ln 8
    balance = 1.5
    z = math.log(8) ** 2
    assert layer.stats.tokens_per_expert.tolist() == [0, 1, 1, 0]
    assert float(layer.stats.aux_loss) == pytest.approx(balance, rel=1e-6)
    assert float(layer.stats.z_loss) == pytest.approx(z, rel=1e-6)
    assert float(aux.detach()) == pytest.approx(0.5 * balance + 0.25 * z, rel=1e-6)
    routing = layer.router(x)
    assert routing.expert_ids_TK.tolist() == [[1, 2]]
    assert routing.weights_TK.flatten().tolist() == pytest.approx([0.5, 0.5], rel=1e-6)
    assert routing.probs_TE.flatten().tolist() == pytest.approx([1 / 8, 3 / 8, 3 / 8, 1 / 8], rel=1e-6)


def test_balance_loss_counts_assignments_before_capacity():
    """f_e counts every routed assignment, including the ones the capacity limit drops."""
    layer = MoELayer(d_model=4, ffn_dim=3, num_experts=4, top_k=1, capacity_factor=0.25, min_capacity=1,
                     aux_loss_coef=1.0, z_loss_coef=0.0)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(4))
    # exp(logits) = 3,1,1,1 on the hot expert: prob 1/2 there, 1/6 elsewhere.
    x = torch.eye(4)[[0, 0, 0, 1]] * math.log(3)
    _, aux = layer(x)
    assert layer.capacity(4) == 1
    assert int(layer.stats.dropped) == 2  # expert 0 keeps one of its three
    # P = ([1/2,1/6,1/6,1/6] * 3 + [1/6,1/2,1/6,1/6]) / 4 = [5/12, 1/4, 1/6, 1/6]
    # f before capacity = [3/4, 1/4, 0, 0] -> balance = 4 * (15/48 + 3/48) = 3/2
    # (f after capacity would be [1/2, 1/2, 0, 0] -> 4/3)
    assert float(aux.detach()) == pytest.approx(1.5, rel=1e-6)
    assert float(layer.stats.aux_loss) == pytest.approx(1.5, rel=1e-6)
    assert layer.stats.tokens_per_expert.tolist() == [3, 1, 0, 0]


def _accumulated(layer: MoELayer, micro_batches: list[torch.Tensor]) -> tuple[float, list, list]:
    """A step accumulated over ``micro_batches`` as the loop does it (m6.train.loss.micro_batch_loss):
    (the step's aux loss, the gradient of the token-loss part, the gradient of the aux part). The
    token loss is a fixed per-token function of the layer's output, summed."""
    from m6.train.loss import micro_batch_loss

    total_tokens = sum(x.shape[0] for x in micro_batches)
    readout = torch.linspace(-1.0, 1.0, layer.d_model)
    grads, auxes = {}, []
    for part in ("lm", "aux"):
        layer.zero_grad()
        for x in micro_batches:
            y, aux = layer(x)
            lm_sum = (y * readout).sum()
            if part == "lm":
                auxes.append(aux.item())
                lm_sum, aux = lm_sum, aux.detach() * 0
            else:
                lm_sum = lm_sum.detach() * 0
            micro_batch_loss(lm_sum, aux, total_tokens, len(micro_batches)).backward()
        grads[part] = [p.grad.clone() for p in layer.parameters() if p.grad is not None]
    return sum(auxes) / len(auxes), grads["lm"], grads["aux"]


def _close(a: list, b: list, tol: float) -> bool:
    return all(torch.allclose(x, y, rtol=tol, atol=tol) for x, y in zip(a, b, strict=True))


def test_the_token_loss_is_split_invariant_and_the_aux_loss_is_formed_per_micro_batch():
    """The documented limit (docs/moe.md, m6.train.balance): cutting a step's tokens into other
    micro-batches leaves the token loss's gradient unchanged (to 1e-6), while the aux losses are a
    mean over micro-batches of each one's own routing statistics: unchanged when every micro-batch
    has the same statistics, changed (with their gradients) when they differ."""
    torch.manual_seed(0)
    layer = MoELayer(d_model=8, ffn_dim=16, num_experts=4, top_k=2, capacity_factor=None, aux_loss_coef=0.5,
                     z_loss_coef=0.25, init_seed=0)
    x = torch.randn(8, 8) * 2
    whole, lm_whole = _accumulated(layer, [x])[0], _accumulated(layer, [x])[1]
    for cut in ([4, 4], [2, 2, 2, 2], [5, 3]):
        aux, lm_grads, _ = _accumulated(layer, list(x.split(cut)))
        assert _close(lm_grads, lm_whole, 1e-6), cut
        assert abs(aux - whole) > 1e-4, (cut, aux, whole)  # the limit: other statistics, another aux loss
    # Micro-batches with the same routing statistics (the same rows twice): the aux loss and its
    # gradient are the one micro-batch's whatever the cut.
    half = x[:4]
    one = _accumulated(layer, [torch.cat([half, half])])
    two = _accumulated(layer, [half, half])
    assert two[0] == pytest.approx(one[0], rel=1e-6)
    assert _close(two[2], one[2], 1e-6) and _close(two[1], one[1], 1e-6)
