"""The chunked, overlapped all-to-all (model.moe.a2a_overlap_degree > 1) against the blocking one on
real gloo groups: the same outputs, input gradients, router and expert gradients and statistics, at
world 2 and 4, for fixed edge cases and for random routings (one spawn per world runs them all);
and the inter-node bytes the dispatcher counts, against a count from the routing."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from moe_cases import run_case, sized

from m6.moe import MoELayer
from m6.parallel import ParallelPlan, apply_plan, build_layout, create_process_groups


def _run(rank: int, world: int, case: dict, groups, degree) -> tuple:
    """This rank's output, input gradient, all-reduced router gradient, local expert gradients,
    stats counts and the degree it ran, with the dispatcher at ``degree``."""
    layer, _, results = run_case(rank, case, lambda layer: apply_plan(
        layer, ParallelPlan(split=[layer]), groups, a2a_dtype=case.get("a2a_dtype"), a2a_overlap_degree=degree))
    if case["cf"] is None:  # dropless: every routed row is sent, so the byte count follows from the routing
        _check_inter_node_bytes(rank, world, layer, case)
    return (*results, layer.dispatcher.last_degree)


def _check_inter_node_bytes(rank: int, world: int, layer: MoELayer, case: dict) -> None:
    """The dispatcher's counted inter-node bytes against a count from every rank's routing (ranks
    [0, world/2) are node 0, the rest node 1)."""
    counts = [torch.zeros_like(layer.stats.routed_local) for _ in range(world)]
    dist.all_gather(counts, layer.stats.routed_local)
    per_rank = case["experts"] // world
    rows = [[int(counts[s][r * per_rank:(r + 1) * per_rank].sum()) for r in range(world)] for s in range(world)]
    node = [r // (world // 2) for r in range(world)]
    remote = sum(rows[rank][r] + rows[r][rank] for r in range(world) if node[r] != node[rank])
    row_bytes = 16 * (case["a2a_dtype"] if case.get("a2a_dtype") else torch.float64).itemsize
    assert layer.dispatcher.inter_node_bytes == 2 * remote * row_bytes, (case["name"], rank)


FIXED = [  # world-independent parts; sizes are per rank and filled in below
    dict(name="dropless_top2", experts=4, top_k=2, cf=None, degrees=[2, 3, 4]),
    dict(name="capacity_top1", experts=8, top_k=1, cf=1.5, degrees=[2]),
    dict(name="all_to_one_expert", experts=4, top_k=1, cf=None, all_to_one=True, degrees=[2, 4]),
    dict(name="more_chunks_than_rows", experts=4, top_k=2, cf=None, degrees=[16], tiny=True),
    dict(name="rank_without_tokens", experts=4, top_k=2, cf=None, degrees=[2], empty_rank=True),
    dict(name="bf16_payload", experts=4, top_k=2, cf=None, degrees=[2], a2a_dtype=torch.bfloat16),
    dict(name="auto_small_is_blocking", experts=4, top_k=2, cf=None, degrees=["auto"], expect_degree=1),
]


def _cases(world: int) -> list[dict]:
    cases = sized(FIXED, world)
    rng = random.Random(world)
    for i in range(6):  # random routings, sizes (zero included), capacities and degrees
        experts = world * rng.choice([1, 2])
        cases.append(dict(name=f"random{i}", experts=experts, top_k=rng.randint(1, min(2, experts)),
                          cf=rng.choice([None, 1.0, 2.0]), sizes=[rng.choice([0, 1, 5, 13]) for _ in range(world)],
                          degrees=[rng.randint(2, 5)], seed=100 + i))
    return cases


def _overlap_equals_blocking(rank: int, world: int) -> None:
    # Two "nodes" of world/2 ranks each: what the dispatcher's inter-node byte count is checked against.
    groups = create_process_groups(build_layout(world, rank, world, 8 * world, local_world_size=world // 2))
    for case in _cases(world):
        blocking = _run(rank, world, case, groups, 1)
        assert blocking[-1] == 1
        for degree in case["degrees"]:
            overlapped = _run(rank, world, case, groups, degree)
            ran = overlapped[-1]
            assert ran == case.get("expect_degree", degree), (case["name"], ran)
            # fp64 throughout: chunking only changes the summation order of the weight gradients.
            tol = dict(rtol=1e-10, atol=1e-12)
            for what, a, b in zip(("y", "x.grad", "router.grad", "w_in.grad", "w_out.grad", "counts"),
                                  overlapped[:-1], blocking[:-1]):
                if a is None and b is None:
                    continue
                assert a is not None and b is not None, (case["name"], degree, what)
                torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{case['name']} degree {degree} {what}: {m}")


@pytest.mark.parametrize("world", [2, 4])
def test_chunked_overlap_equals_blocking_all_to_all(world):
    run_distributed(_overlap_equals_blocking, world, timeout_s=60)
