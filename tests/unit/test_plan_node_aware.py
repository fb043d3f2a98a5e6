"""The planner's two-level exchange (m6.plan.timing.expert_exchange_s): the flat exchange's rows for
other nodes on the inter-node link while those for the node's own ranks take the intra-node one,
node-aware dispatch's one row per (token, remote node) then forwarded inside the node, what
node-limited routing saves there, and the search trying node-aware dispatch where EP spans nodes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from m6 import config as m6config
from m6.plan.search import search
from m6.plan.timing import GPUS, HostProfile, expert_exchange_s, nodes_per_token, step_time

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = ["train.global_batch_size=64", "train.micro_batch_size=2", "data.seq_len=64", "model.moe.top_k=2",
        "model.moe.num_experts=8", "model.moe.node_groups=2"]
WORLD, EP, PER_NODE = 16, 8, 4  # the expert-parallel group spans two nodes of 4
HW = dataclasses.replace(GPUS["h100"], latency_s=0.0, inter_node_GBps=1.0, intra_node_GBps=100.0)


def tiny(*extra: str) -> m6config.Config:
    return m6config.load(CONFIGS / "tiny.yaml", [*TINY, *extra])


def test_nodes_a_token_reaches():
    assert nodes_per_token(1, 8, 0) == pytest.approx(1.0)
    assert nodes_per_token(2, 2, 0) == pytest.approx(1.5)  # both experts on one node half the time
    assert nodes_per_token(2, 2, 1) == pytest.approx(1.0)  # node-limited: always one
    assert nodes_per_token(8, 8, 2) <= 2.0


def test_flat_and_node_aware_bytes_on_each_link():
    cfg = tiny()
    P, row = 1000, cfg.model.d_model * 2
    flat = expert_exchange_s(cfg, P, 2, EP, PER_NODE, HW)
    # flat: 2 rows per token, 4 of the 8 ranks on the other node; the intra-node part (3/8 of the
    # rows at 100x the bandwidth) hides under the inter-node one.
    assert flat == pytest.approx(P * 2 * row * 4 / 8 / 1e9)
    aware = expert_exchange_s(tiny("model.moe.a2a_dispatch=node_aware"), P, 2, EP, PER_NODE, HW)
    # node-aware: 1.5 nodes per token, half of them remote, plus 12 B per remote assignment over the
    # four exchanges; then 3/4 of the 2 assignments forwarded inside the node.
    inter = P * 1.5 * 0.5 * row + P * 2 * 0.5 * 12 / 4
    assert aware == pytest.approx(inter / 1e9 + P * 2 * 0.75 * row / 100e9)
    limited = expert_exchange_s(tiny("model.moe.a2a_dispatch=node_aware", "model.moe.max_nodes_per_token=1"),
                                P, 2, EP, PER_NODE, HW)
    assert limited < aware < flat
    # Node-limited routing alone does not change the flat exchange's bytes.
    assert expert_exchange_s(tiny("model.moe.max_nodes_per_token=1"), P, 2, EP, PER_NODE, HW) == flat
    # Inside one node both forms are one exchange at the intra-node rate.
    assert expert_exchange_s(tiny("model.moe.a2a_dispatch=node_aware"), P, 2, 4, PER_NODE, HW) == \
        expert_exchange_s(cfg, P, 2, 4, PER_NODE, HW) == pytest.approx(P * 2 * row * 3 / 4 / 100e9)


def test_step_time_and_search_take_node_aware_dispatch():
    flat = step_time(tiny("model.moe.max_nodes_per_token=1"), WORLD, EP, PER_NODE, HW, None)
    aware = step_time(tiny("model.moe.max_nodes_per_token=1", "model.moe.a2a_dispatch=node_aware"), WORLD, EP,
                      PER_NODE, HW, None)
    assert aware.all_to_all < flat.all_to_all and aware.compute == flat.compute
    only = dict(recompute=("none",), offload=("none",), apply_groups=(1,), a2a=(None,), micro_batches=[1],
                shard=("none",))
    found = search(tiny("model.moe.max_nodes_per_token=1"), WORLD, PER_NODE, HW, HostProfile(1), 1e6,
                   eps=[1, 4, EP], **only)
    forms = {(c.expert_parallel_size, c.a2a_overlap_degree, c.a2a_dispatch) for c in found.feasible}
    # node-aware only where the group spans nodes (EP 8 over nodes of 4), at every overlap degree
    assert forms == {(1, 1, "flat"), (4, 1, "flat"), (4, 2, "flat"), (4, 4, "flat"), (EP, 1, "flat"),
                     (EP, 2, "flat"), (EP, 4, "flat"), (EP, 1, "node_aware"), (EP, 2, "node_aware"),
                     (EP, 4, "node_aware")}
    best = min((c for c in found.feasible if c.expert_parallel_size == EP), key=lambda c: c.time.total)
    assert best.a2a_dispatch == "node_aware" and "model.moe.a2a_dispatch=node_aware" in best.overrides()
