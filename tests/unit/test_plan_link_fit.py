"""bench.plan_validation.fit_link: the latency and bandwidth it passes to the planner are the ones
that reproduce the probed times by the planner's own formulas."""

from __future__ import annotations

import pytest

from bench.plan_validation import fit_link


def _probe(world: int, latency_s: float, GBps: float) -> dict:
    """Times a link of exactly this latency and bandwidth gives, per the planner's formulas."""
    sizes = [16384, 262144, 1048576, 4194304]
    bw = GBps * 1e9
    return {"world_size": world,
            "all_to_all": {str(n): latency_s + n * (world - 1) / world / bw for n in sizes},
            "all_reduce": {str(n): latency_s + 2 * (world - 1) / world * n / bw for n in sizes}}


@pytest.mark.parametrize("world,latency_us,GBps", [(2, 620.0, 1.41), (4, 3388.0, 0.66)])
def test_fit_recovers_the_link(world, latency_us, GBps) -> None:
    link = fit_link(_probe(world, latency_us * 1e-6, GBps))
    assert link["latency_us"] == pytest.approx(latency_us, rel=1e-6)
    assert link["GBps"] == pytest.approx(GBps, rel=1e-6)


@pytest.mark.parametrize("cost", [1.0, 2.3])
def test_fit_recovers_the_gather_scatter_cost(cost) -> None:
    """FSDP2's all-gather / reduce-scatter probed at ``cost`` times a ring's time: the fit gives
    the factor the planner's sharded sync multiplies its ring bytes by."""
    world, latency_s, bw = 4, 3e-3, 0.7e9
    probe = _probe(world, latency_s, bw / 1e9)
    for op in ("all_gather", "reduce_scatter"):
        probe[op] = {n: latency_s + cost * (world - 1) / world * int(n) / bw for n in probe["all_reduce"]}
    link = fit_link(probe)
    assert link["gather_scatter_cost"] == pytest.approx(cost, rel=1e-6)
