"""Node-aware dispatch (model.moe.a2a_dispatch: node_aware), blocking and chunked (overlap degree
2, 3, ..., more chunks than rows), against the flat all-to-all on real gloo groups: the same
outputs, input gradients, router and expert gradients and statistics, at world 4 as 2 nodes x 2
ranks and as 1 node x 4, at world 2 as 2 nodes x 1, for fixed edge cases and random routings (one
spawn per layout runs them all); the protocol's separate dispatch and combine equal to the
pipeline; and the inter-node bytes the dispatcher counts against a count of the (token, node)
pairs of every rank's routing and against the payload bytes the exchanges really sent across
nodes (a pass-through spy on all_to_all_single)."""

from __future__ import annotations

import random
import types

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from moe_cases import run_case, sized

from m6.moe import MoELayer
from m6.moe.dispatch import Dispatcher
from m6.moe.node_aware_all_to_all import NodeAwareDispatcher
from m6.parallel import ParallelPlan, apply_plan, build_layout, create_process_groups


def _run(rank: int, world: int, per_node: int, case: dict, groups, dispatch: str, degree=1) -> tuple:
    """This rank's output, input gradient, all-reduced router gradient, local expert gradients
    and stats counts with the given dispatcher (and overlap degree; "phases": the protocol's
    dispatch, experts, combine as three calls)."""
    def install(layer: MoELayer) -> None:
        apply_plan(layer, ParallelPlan(split=[layer]), groups, a2a_dtype=case.get("a2a_dtype"), a2a_dispatch=dispatch,
                   a2a_overlap_degree=1 if degree == "phases" else degree)
        if degree == "phases":
            layer.dispatcher.dispatch_compute_combine = types.MethodType(Dispatcher.dispatch_compute_combine,
                                                                         layer.dispatcher)
        assert isinstance(layer.dispatcher, NodeAwareDispatcher) == (dispatch == "node_aware")

    with _InterNodeSpy(per_node) as spy:
        layer, x, results = run_case(rank, case, install)
    if dispatch == "node_aware":
        assert layer.dispatcher.inter_node_bytes == spy.payload_bytes, (case["name"], degree, rank)
        if case["cf"] is None:
            _check_inter_node_bytes(rank, world, per_node, layer, x, case)
    return results


class _InterNodeSpy:
    """Adds up the floating-point payload this rank's all_to_all_single calls send to ranks on
    other nodes (the counts exchange, integer, is not payload), then calls the real collective."""

    def __init__(self, per_node: int) -> None:
        self.per_node, self.payload_bytes, self.real = per_node, 0, dist.all_to_all_single

    def __enter__(self) -> "_InterNodeSpy":
        def spy(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            if input.is_floating_point():
                size = dist.get_world_size(group)
                splits = input_split_sizes or [input.shape[0] // size] * size
                row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
                me = dist.get_rank() // self.per_node
                self.payload_bytes += sum(n * row_bytes for r, n in enumerate(splits)
                                          if dist.get_global_rank(group, r) // self.per_node != me)
            return self.real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        dist.all_to_all_single = spy
        return self

    def __exit__(self, *exc) -> None:
        dist.all_to_all_single = self.real


def _check_inter_node_bytes(rank: int, world: int, per_node: int, layer: MoELayer, x: torch.Tensor,
                            case: dict) -> None:
    """Counted bytes against the routing (dropless: every assignment kept): per remote (token, node)
    pair one row each way, forward and backward; per remote assignment its (weight, row index) pair
    (two weight-sized values) out, and the weight's gradient alone back (the index has none)."""
    with torch.no_grad():
        plan = layer.dispatch_plan(layer.router(x), None, x.shape[0])
    K, E = plan.num_assignments, case["experts"]
    expert_of = torch.repeat_interleave(torch.arange(E), plan.counts_E)
    token_of = plan.order_A[:len(expert_of)] // K
    node_of_expert = expert_of // (E // world) // per_node
    mine = torch.tensor([len({(int(t), int(b)) for t, b in zip(token_of, node_of_expert) if b == node})
                         for node in range(world // per_node)] +
                        [int((node_of_expert == node).sum()) for node in range(world // per_node)])
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    B, me = world // per_node, rank // per_node
    relay_for = [s for s in range(world) if s % per_node == rank % per_node and s // per_node != me]
    rows_out = sum(int(mine[b]) for b in range(B) if b != me)
    assign_out = sum(int(mine[B + b]) for b in range(B) if b != me)
    rows_in = sum(int(every[s][me]) for s in relay_for)
    assign_in = sum(int(every[s][B + me]) for s in relay_for)
    row_bytes, w_bytes = 16 * (case.get("a2a_dtype") or torch.float64).itemsize, 8
    expected = 2 * (rows_out + rows_in) * row_bytes + (2 * assign_out + assign_in) * w_bytes
    assert layer.dispatcher.inter_node_bytes == expected, (case["name"], rank)
    if per_node == world:
        assert expected == 0


FIXED = [  # sizes are per rank and filled in below
    dict(name="dropless_top2", experts=8, top_k=2, cf=None, degrees=[1, 2, 3, "phases"]),
    dict(name="dropless_top3", experts=8, top_k=3, cf=None),
    dict(name="capacity_top2", experts=8, top_k=2, cf=1.0, degrees=[1, 2, "phases"]),
    dict(name="capacity_top1", experts=4, top_k=1, cf=1.5),
    dict(name="all_to_one_expert", experts=4, top_k=1, cf=None, all_to_one=True),
    dict(name="rank_without_tokens", experts=4, top_k=2, cf=None, empty_rank=True),
    dict(name="bf16_payload", experts=4, top_k=2, cf=None, a2a_dtype=torch.bfloat16),
    dict(name="more_chunks_than_rows", experts=4, top_k=2, cf=None, degrees=[16], tiny=True),
]


def _cases(world: int) -> list[dict]:
    cases = sized(FIXED, world)
    rng = random.Random(world)
    for i in range(5):  # random routings, sizes (zero included) and capacities
        experts = world * rng.choice([1, 2, 3])
        cases.append(dict(name=f"random{i}", experts=experts, top_k=rng.randint(1, min(4, experts)),
                          cf=rng.choice([None, 1.0, 2.0]), sizes=[rng.choice([0, 1, 5, 13]) for _ in range(world)],
                          degrees=[1, rng.randint(2, 5)], seed=100 + i))
    return cases


def _node_aware_equals_flat(rank: int, world: int, per_node: int) -> None:
    groups = create_process_groups(build_layout(world, rank, world, 8 * world, local_world_size=per_node),
                                   node_aware=True)
    for case in _cases(world):
        flat = _run(rank, world, per_node, case, groups, "flat")
        for degree in case.get("degrees", [1, 2, 3]):
            node_aware = _run(rank, world, per_node, case, groups, "node_aware", degree)
            # fp64 throughout: the relay's partial sums and the chunks only change the summation
            # order (bf16 payload: a token's outputs on one node are summed before the one rounding
            # to bf16, not after).
            tol = dict(rtol=1e-2, atol=1e-2) if case.get("a2a_dtype") else dict(rtol=1e-10, atol=1e-12)
            for what, a, b in zip(("y", "x.grad", "router.grad", "w_in.grad", "w_out.grad", "counts"),
                                  node_aware, flat):
                if a is None and b is None:
                    continue
                assert a is not None and b is not None, (case["name"], degree, what)
                torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{case['name']} degree {degree} {what}: {m}")


@pytest.mark.parametrize("world,per_node", [(4, 2), (4, 4), (2, 1)])
def test_node_aware_dispatch_equals_flat(world, per_node):
    run_distributed(_node_aware_equals_flat, world, per_node, timeout_s=90)
