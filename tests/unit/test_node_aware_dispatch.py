"""model.moe.a2a_dispatch: the config check and the launch check of node-aware dispatch (its
results against the flat exchange: tests/dist/test_node_aware_dist.py)."""

from __future__ import annotations

import pytest

from m6.config import ConfigError, MoEConfig
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
