"""Uneven experts per rank (parallel.balance at EP > 1): the rounding rule, the layout's ranges and
its errors (no processes needed)."""

import pytest
import torch

from m6.parallel import LayoutError, build_layout
from m6.parallel.expert_ranges import describe_ranges, ep_position_weights, first_experts, weighted_counts


@pytest.mark.parametrize("experts, weights, counts", [
    (8, [2, 1], [5, 3]), (8, [3, 1], [6, 2]), (4, [2, 1], [3, 1]), (4, [3, 1], [3, 1]), (4, [1, 1], [2, 2]),
    (3, [1, 1], [2, 1]),  # tie: the lower rank
    (4, [100, 1, 1], [2, 1, 1]),  # rank 1 rounds to none: it takes one from rank 0, the largest
    (3, [1, 1, 1], [1, 1, 1]), (16, [4, 2, 1, 1], [8, 4, 2, 2]),
])
def test_counts_follow_the_weights_each_at_least_one(experts, weights, counts):
    assert weighted_counts(experts, weights) == counts


def test_counts_are_close_to_proportional():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 6, (1,), generator=gen))
        experts = int(torch.randint(n, 65, (1,), generator=gen))
        weights = (torch.rand(n, generator=gen) * 10 + 0.1).tolist()
        counts = weighted_counts(experts, weights)
        assert sum(counts) == experts and min(counts) >= 1
        ideal = [experts * w / sum(weights) for w in weights]
        # Largest remainder is within one of the ideal; raising a zero to one moves at most n - 1 more.
        assert all(abs(c - x) < n for c, x in zip(counts, ideal)), (experts, weights, counts)


def test_ranges_and_edp_columns():
    assert first_experts([5, 3]) == [0, 5] and describe_ranges([5, 3]) == ["0-4", "5-7"]
    assert describe_ranges([1, 2, 1]) == ["0", "1-2", "3"]
    # World 4 at EP 2: ranks 0 and 2 hold the same experts, their weights count together.
    assert ep_position_weights([2, 1, 4, 1], 2) == [6, 2]
    layouts = [build_layout(4, r, 2, 8, local_world_size=4, rank_weights=[2, 1, 4, 1]) for r in range(4)]
    assert [(lay.first_local_expert, lay.experts_per_rank) for lay in layouts] == [(0, 6), (6, 2), (0, 6), (6, 2)]
    assert layouts[0].expert_ranges_by_rank() == ["0-5", "6-7", "0-5", "6-7"] and layouts[0].uneven_experts


def test_weights_at_ep1_or_equal_keep_the_even_layout():
    assert build_layout(2, 1, 1, 8, local_world_size=2, rank_weights=[2, 1]).expert_counts == (8,)
    layout = build_layout(2, 1, 2, 8, local_world_size=2, rank_weights=[1, 1])
    assert layout.expert_counts == (4, 4) and not layout.uneven_experts
    # Uneven needs no divisibility: 7 experts over 2 ranks by [2, 1].
    assert build_layout(2, 1, 2, 7, local_world_size=2, rank_weights=[2, 1]).expert_counts == (5, 2)
    with pytest.raises(LayoutError, match="must divide model.moe.num_experts"):
        build_layout(2, 1, 2, 7, local_world_size=2)


@pytest.mark.parametrize("world, ep, experts, weights, says", [
    (2, 2, 1, [2, 1], "model.moe.num_experts (1) is smaller than parallel.expert_parallel_size (2)"),
    (4, 4, 3, [1, 1, 1, 1], "model.moe.num_experts (3) is smaller"),
    (2, 2, 8, [2, 1, 1], "parallel.balance has 3 weights, the job has 2 ranks"),
])
def test_impossible_uneven_layouts_name_the_keys(world, ep, experts, weights, says):
    with pytest.raises(LayoutError, match="parallel") as err:
        build_layout(world, 0, ep, experts, local_world_size=world, rank_weights=weights)
    assert says in str(err.value)


def test_sharded_model_stores_uneven_experts_as_rows_of_the_global_tensor():
    """Each rank keeps the rows of its range with the even layout's weights; a checkpoint declares
    them at that offset of the (num_experts, ...) global tensor."""
    from m6.config import load
    from m6.model import M6Model
    from m6.parallel import classify_parameters, default_plan, keep_local_experts
    from m6.parallel.layout import ProcessGroups
    from m6.train.state import first_row, global_shape

    cfg = load("configs/tiny.yaml", ["model.d_model=32", "model.num_layers=2", "model.num_heads=2",
                                     "model.ffn_dim=64", "model.moe.every=1", "model.moe.num_experts=8"])
    full = M6Model(cfg.model)
    full.materialize(torch.device("cpu"), 0)
    name = "blocks.0.ffn.experts.w_in"
    whole = dict(full.named_parameters())[name]
    for rank, (first, count) in enumerate([(0, 5), (5, 3)]):
        with torch.device("meta"):
            model = M6Model(cfg.model)
        layout = build_layout(2, rank, 2, 8, local_world_size=2, rank_weights=[2, 1])
        plan = default_plan(model)
        keep_local_experts(plan, layout)
        model.materialize(torch.device("cpu"), 0)
        sharded = classify_parameters(model, plan, ProcessGroups(layout, None))
        local = sharded.expert_params[name]
        assert local.shape[0] == count and torch.equal(local, whole[first:first + count])
        assert global_shape(sharded, name, local) == whole.shape and first_row(sharded, name, local) == first
