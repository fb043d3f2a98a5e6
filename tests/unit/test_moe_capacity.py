"""Capacity and dispatch-plan semantics of m6.moe on hand-written routings.

Every expected value below is written out by hand from the rule in the contract: per expert, keep
the `capacity` assignments with the highest combine weight; ties keep the lower flat index
(token * K + k) first; dropped assignments are absent from the plan.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from m6.moe import expert_capacity, plan_dispatch
from m6.moe.dispatch import group_capacity


def _kept(plan):
    """The plan's kept assignments (the host learns N from the counts, as the dispatchers do)."""
    return plan.kept(int(plan.counts_E.sum()))


def _hand_routing() -> tuple[torch.Tensor, torch.Tensor]:
    """T=4 tokens, K=2, E=3.  Flat index = 2 * token + k.

    flat  (t,k)  expert  weight
      0   (0,0)    0      0.6
      1   (0,1)    1      0.4
      2   (1,0)    0      0.7
      3   (1,1)    2      0.3
      4   (2,0)    0      0.6   <- ties flat 0 on expert 0, exactly at the capacity boundary
      5   (2,1)    1      0.4   <- ties flat 1 on expert 1, exactly at the capacity boundary
      6   (3,0)    1      0.5
      7   (3,1)    0      0.5
    """
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.6, 0.4], [0.5, 0.5]])
    return ids, weights


def test_capacity_keeps_highest_weight_and_breaks_ties_by_flat_index():
    ids, weights = _hand_routing()
    plan = plan_dispatch(ids, weights, num_experts=3, capacity=2)
    # expert 0: candidates by weight 0.7 (flat 2), 0.6 (flat 0), 0.6 (flat 4), 0.5 (flat 7)
    #           -> keep flat 2 (token 1, a later token beats token 0 on weight) then flat 0 (tie won).
    # expert 1: 0.5 (flat 6), 0.4 (flat 1), 0.4 (flat 5) -> keep flat 6, flat 1.
    # expert 2: 0.3 (flat 3) -> keep.
    assert _kept(plan).token_idx_N.tolist() == [1, 0, 3, 0, 1]
    assert _kept(plan).weights_N.tolist() == pytest.approx([0.7, 0.6, 0.5, 0.4, 0.3])
    assert plan.counts_E.tolist() == [2, 2, 1]
    assert plan.routed_counts_E.tolist() == [4, 3, 1]
    assert int(plan.num_dropped) == 3
    assert plan.num_tokens == 4


def test_capacity_kept_set_via_weight_gradient():
    """The gradient of sum(weights_N) marks exactly the kept (token, k) slots with 1."""
    ids, weights = _hand_routing()
    weights = weights.clone().requires_grad_(True)
    plan = plan_dispatch(ids, weights, num_experts=3, capacity=2)
    (grad,) = torch.autograd.grad(_kept(plan).weights_N.sum(), weights)
    kept = {(0, 0), (0, 1), (1, 0), (1, 1), (3, 0)}
    expected = torch.tensor([[1.0 if (t, k) in kept else 0.0 for k in range(2)] for t in range(4)])
    assert torch.equal(grad, expected)


def test_capacity_one_and_large_capacity():
    ids, weights = _hand_routing()
    plan = plan_dispatch(ids, weights, num_experts=3, capacity=1)
    assert _kept(plan).token_idx_N.tolist() == [1, 3, 1]  # flat 2, flat 6, flat 3
    assert plan.counts_E.tolist() == [1, 1, 1]
    assert int(plan.num_dropped) == 5

    plan = plan_dispatch(ids, weights, num_experts=3, capacity=4)
    # nothing dropped; each expert still lists its assignments highest weight first
    assert _kept(plan).token_idx_N.tolist() == [1, 0, 2, 3, 3, 0, 2, 1]
    assert plan.counts_E.tolist() == [4, 3, 1]
    assert int(plan.num_dropped) == 0


def test_capacity_zero_drops_everything():
    ids, weights = _hand_routing()
    plan = plan_dispatch(ids, weights, num_experts=3, capacity=0)
    assert _kept(plan).token_idx_N.numel() == 0
    assert plan.counts_E.tolist() == [0, 0, 0]
    assert int(plan.num_dropped) == 8


def test_dropless_groups_by_expert_in_token_order():
    ids, weights = _hand_routing()
    plan = plan_dispatch(ids, weights, num_experts=4, capacity=None)  # expert 3 receives nothing
    assert _kept(plan).token_idx_N.tolist() == [0, 1, 2, 3, 0, 2, 3, 1]
    assert _kept(plan).weights_N.tolist() == pytest.approx([0.6, 0.7, 0.6, 0.5, 0.4, 0.4, 0.5, 0.3])
    assert plan.counts_E.tolist() == [4, 3, 1, 0]
    assert plan.routed_counts_E.tolist() == [4, 3, 1, 0]
    assert int(plan.num_dropped) == 0


def test_capacity_many_exact_ties_keep_earliest_tokens():
    """All 300 tokens tie on one expert: the kept ones are exactly tokens 0..capacity-1, in order
    (large enough that a non-stable sort would visibly scramble them)."""
    T = 300
    ids = torch.zeros(T, 1, dtype=torch.long)
    weights = torch.ones(T, 1)
    plan = plan_dispatch(ids, weights, num_experts=2, capacity=37)
    assert _kept(plan).token_idx_N.tolist() == list(range(37))
    assert plan.counts_E.tolist() == [37, 0]
    assert int(plan.num_dropped) == T - 37


def test_capacity_ties_mixed_with_distinct_weights():
    """K=3, every assignment on expert 0, weights with a three-way tie straddling the boundary."""
    ids = torch.zeros(3, 3, dtype=torch.long)
    weights = torch.tensor([[0.2, 0.5, 0.3],    # flat 0, 1, 2
                            [0.5, 0.1, 0.5],    # flat 3, 4, 5
                            [0.9, 0.05, 0.05]])  # flat 6, 7, 8
    plan = plan_dispatch(ids, weights, num_experts=1, capacity=3)
    # order: 0.9 (flat 6) then the 0.5 tie in flat order 1, 3, 5 -> keep flat 6, 1, 3.
    assert _kept(plan).token_idx_N.tolist() == [2, 0, 1]
    assert _kept(plan).weights_N.tolist() == pytest.approx([0.9, 0.5, 0.5])
    assert int(plan.num_dropped) == 6



def test_unrouted_tokens_take_no_capacity_and_are_never_dispatched():
    """The hand routing's 4 tokens are rows 1, 4, 5, 8 of a 10-row input; the other rows (padding,
    token mask False) were routed too, all to expert 0 with the top weight, and must not count."""
    ids, weights = _hand_routing()
    rows = torch.tensor([1, 4, 5, 8])
    all_ids = torch.zeros(10, 2, dtype=torch.long)
    all_weights = torch.full((10, 2), 0.99)
    all_ids[rows], all_weights[rows] = ids, weights
    routed = torch.zeros(10, dtype=torch.bool)
    routed[rows] = True
    plain = plan_dispatch(ids, weights, num_experts=3, capacity=2)
    plan = plan_dispatch(all_ids, all_weights, num_experts=3, capacity=2, routed_T=routed)
    assert _kept(plan).token_idx_N.tolist() == rows[_kept(plain).token_idx_N].tolist()
    assert plan.num_tokens == 10 and plain.num_tokens == 4
    assert torch.equal(_kept(plan).weights_N, _kept(plain).weights_N)
    assert torch.equal(plan.counts_E, plain.counts_E)
    assert torch.equal(plan.routed_counts_E, plain.routed_counts_E) and int(plan.num_dropped) == int(plain.num_dropped)
    dropless = plan_dispatch(all_ids, all_weights, num_experts=3, capacity=None, routed_T=routed)
    assert sorted(_kept(dropless).token_idx_N.tolist()) == sorted(rows.repeat_interleave(2).tolist())
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_tokens = 4  # a plan is built once, never edited


def test_capacity_is_decided_per_routing_group():
    """Two groups of 4 tokens (the hand routing twice): each keeps exactly what the hand routing
    keeps alone, whatever the other group holds; per-group capacities may differ."""
    ids, weights = _hand_routing()
    two_ids, two_weights = torch.cat([ids, ids]), torch.cat([weights, weights])
    alone = plan_dispatch(ids, weights, num_experts=3, capacity=2)
    rows, counts = _kept(alone).token_idx_N.tolist(), alone.counts_E.tolist()
    both = plan_dispatch(two_ids, two_weights, num_experts=3, capacity=2, group_size=4)
    # Expert-major, group-minor: expert e's kept rows of group 0, then of group 1 (rows + 4).
    expected, start = [], 0
    for n in counts:
        expected += rows[start:start + n] + [r + 4 for r in rows[start:start + n]]
        start += n
    assert _kept(both).token_idx_N.tolist() == expected
    assert both.counts_E.tolist() == [2 * c for c in counts]
    # One group of 8 with the same capacity keeps fewer: capacity is not per group there.
    assert int(plan_dispatch(two_ids, two_weights, num_experts=3, capacity=2).counts_E.sum()) < 2 * sum(counts)
    # Group 0 with capacity 1, group 1 with capacity 2: each keeps what its capacity keeps alone.
    mixed = _kept(plan_dispatch(two_ids, two_weights, num_experts=3, capacity=torch.tensor([1, 2]), group_size=4))
    one = _kept(plan_dispatch(ids, weights, num_experts=3, capacity=1)).token_idx_N.tolist()
    assert sorted(r for r in mixed.token_idx_N.tolist() if r < 4) == sorted(one)
    assert sorted(r - 4 for r in mixed.token_idx_N.tolist() if r >= 4) == sorted(rows)
    with pytest.raises(ValueError, match="routing groups"):
        plan_dispatch(ids, weights, num_experts=3, capacity=2, group_size=3)


@pytest.mark.parametrize(
    "num_tokens, num_assignments, num_experts, capacity_factor, min_capacity, expected",
    [
        (16, 2, 4, 1.25, 4, 10),   # 1.25 * 32 / 4 = 10
        (16, 2, 4, 1.0, 4, 8),     # exact
        (10, 2, 4, 1.0, 4, 5),     # 20 / 4 = 5
        (10, 1, 4, 1.0, 4, 4),     # ceil(2.5) = 3 < min_capacity 4
        (10, 1, 4, 1.0, 0, 3),     # ceil(2.5) = 3
        (7, 2, 8, 0.5, 1, 1),      # ceil(0.875) = 1
        (0, 2, 8, 1.0, 0, 0),      # empty batch
        # 1.1 * 50 * 4 / 4 = 55, though the float product is 55.00000000000001
        (50, 4, 4, 1.1, 0, 55),
    ],
)
def test_expert_capacity_formula(num_tokens, num_assignments, num_experts, capacity_factor, min_capacity,
                                 expected):
    assert expert_capacity(num_tokens, num_assignments, num_experts, capacity_factor, min_capacity) == expected
    # The device formula (every routing group at once) agrees with the host one.
    on_device = group_capacity(torch.tensor([num_tokens]), num_assignments, num_experts, capacity_factor, min_capacity)
    assert on_device.tolist() == [expected]
