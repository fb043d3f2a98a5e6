"""train.py with node-limited routing across two "nodes" (ranks with LOCAL_WORLD_SIZE 1, EP over
both): the same losses as one process (routing is world-size invariant), with the chunked
overlapped all-to-all on and with chunked node-aware dispatch; and a launch whose nodes split a node group
is refused with exit code 2."""

from __future__ import annotations

from dist_helpers import train_ranks
from test_train_world_sizes import SMALL, TINY, assert_same_curve, ranks, single, train_rows

NODE_LIMITED = ["model.moe.node_groups=2", "model.moe.max_nodes_per_token=1", "model.moe.top_k=2",
                "train.max_steps=4"]


def test_node_limited_two_nodes_match_one_process(tmp_path):
    single(tmp_path / "w1", *NODE_LIMITED)
    ranks(tmp_path / "w2", 2, *NODE_LIMITED, "model.moe.a2a_overlap_degree=2", per_node=1)
    assert_same_curve(train_rows(tmp_path / "w2"), train_rows(tmp_path / "w1"))
    ranks(tmp_path / "w2na", 2, *NODE_LIMITED, "model.moe.a2a_dispatch=node_aware",
          "model.moe.a2a_overlap_degree=2", per_node=1)
    assert_same_curve(train_rows(tmp_path / "w2na"), train_rows(tmp_path / "w1"))
    # The inter-node payload per step, logged: with each token's experts on one node, node-aware
    # dispatch moves one row per token where the flat exchange moves one per expert.
    flat, aware = ([r["inter_node_mb"] for r in train_rows(tmp_path / d)] for d in ("w2", "w2na"))
    assert all(0 < a < f for a, f in zip(aware, flat)), (aware, flat)
    assert "inter_node_mb" not in train_rows(tmp_path / "w1")[0]


def test_node_groups_that_span_nodes_are_refused(tmp_path):
    # 2 nodes x 1 process, EP 2: a single node group (all 4 experts) would span both nodes.
    args = ["--config", TINY, *SMALL, f"run.dir={tmp_path}", "model.moe.node_groups=1",
            "model.moe.max_nodes_per_token=1"]
    for rank, result in enumerate(train_ranks(2, args, local_world_size=1)):
        assert result.code == 2, (rank, result.stderr[-2000:])
        assert "config error: model.moe.node_groups (1) does not match the launch" in result.stderr, result.stderr
