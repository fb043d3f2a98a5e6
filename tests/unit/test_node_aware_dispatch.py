"""model.moe.a2a_dispatch: the config check and the launch check of node-aware dispatch (its
results against the flat exchange: tests/dist/test_node_aware_dist.py)."""

from __future__ import annotations

import pytest
import torch

from m6.config import ConfigError, MoEConfig
from m6.moe.chunked_all_to_all import chunk_cuts, chunk_of
from m6.moe.dispatch import plan_dispatch
from m6.moe.node_aware_all_to_all import _count_per_chunk_expert, _pair_rows, _rows_chunk_major
from m6.parallel import LayoutError, build_layout
from m6.parallel.node_groups import check_node_aware_dispatch


def test_a2a_dispatch_config_keys():
    MoEConfig(a2a_dispatch="node_aware").validate()
    MoEConfig(a2a_dispatch="flat", a2a_overlap_degree=4).validate()
    with pytest.raises(ConfigError, match="model.moe.a2a_dispatch must be 'flat' or 'node_aware', got 'deepep'"):
        MoEConfig(a2a_dispatch="deepep").validate()
    MoEConfig(a2a_dispatch="node_aware", a2a_overlap_degree=2).validate()
    with pytest.raises(ConfigError, match=r"a2a_dispatch=node_aware takes an integer model\.moe\.a2a_overlap_degree"):
        MoEConfig(a2a_dispatch="node_aware", a2a_overlap_degree="auto").validate()


def test_node_aware_needs_the_same_ranks_on_every_node():
    check_node_aware_dispatch(build_layout(4, 1, 4, 8, local_world_size=2), "node_aware")  # 2 + 2
    check_node_aware_dispatch(build_layout(4, 3, 2, 8, local_world_size=4), "node_aware")  # one node
    check_node_aware_dispatch(build_layout(6, 0, 3, 6, local_world_size=2), "flat")  # flat: nothing to check
    # world 6, EP 3, 2 per node: rank 0's group is ranks 0-2, two on node 0 and one on node 1.
    with pytest.raises(LayoutError, match=r"a2a_dispatch=node_aware does not match the launch.*\[2, 1\]"):
        check_node_aware_dispatch(build_layout(6, 0, 3, 6, local_world_size=2), "node_aware")


def test_the_module_docstrings_worked_example():
    """The source-side index arithmetic of m6.moe.node_aware_all_to_all on its docstring's example:
    2 nodes of 2 ranks, 4 experts (node 0: 0-1, node 1: 2-3), 2 chunks, 4 tokens at top-2."""
    plan = plan_dispatch(torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]]), torch.full((4, 2), 0.5), 4, None)
    B, T, K, E, C = 2, 4, 2, 4, 2
    expert_A = torch.searchsorted(torch.cumsum(plan.counts_E, 0), torch.arange(T * K), right=True)
    node_A = torch.tensor([0, 0, 1, 1, B]).index_select(0, expert_A)
    present, rows_B, row_A = _pair_rows(node_A, plan.order_A // K, B, T)
    assert present.view(B, T).tolist() == [[True, True, False, True], [False, True, True, True]]
    assert rows_B.tolist() == [3, 3]
    cuts = chunk_cuts(rows_B, C)
    assert cuts.tolist() == [[0, 1, 3], [0, 1, 3]]
    chunk_A = chunk_of(cuts, node_A, row_A)
    assert _rows_chunk_major(present, rows_B, cuts, 6, T).tolist() == [0, 1, 1, 3, 2, 3]
    assert _count_per_chunk_expert(expert_A, chunk_A, E, C).view(C, E).tolist() == [[1, 1, 1, 0], [1, 1, 1, 2]]
    # token 3's assignment to expert 0: row 2 of node 0, chunk 1 (which starts at row 1): index 1
    a = [i for i in range(T * K) if plan.order_A[i] // K == 3 and expert_A[i] == 0][0]
    assert (row_A[a] - cuts[node_A[a], chunk_A[a]]).item() == 1
