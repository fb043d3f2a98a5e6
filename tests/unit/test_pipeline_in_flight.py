"""The micro-batches a pipeline rank holds at once (auto recompute's budget share at pipeline
parallel, m6.train.pipeline_recompute), counted over torch's order of the rank's actions
(m6.parallel.pipeline_order): the closed forms where the schedules have one, and ZB-V's own."""

from __future__ import annotations

import pytest

from m6.train.pipeline_recompute import in_flight


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_one_f_one_b_holds_p_minus_rank(pp):
    for m in (pp, 2 * pp, 4 * pp):
        for rank in range(pp):
            assert in_flight("1f1b", pp, 1, m, rank) == min(m, pp - rank)


@pytest.mark.parametrize("pp, v", [(2, 2), (3, 2), (4, 2), (4, 3), (8, 2)])
def test_interleaved_holds_megatrons_warm_up_chunks(pp, v):
    for m in (pp, 2 * pp, 4 * pp):
        for rank in range(pp):
            expected = min(v * m, 2 * (pp - rank - 1) + (v - 1) * pp + 1) / v
            assert in_flight("interleaved", pp, v, m, rank) == pytest.approx(expected), (m, rank)


def test_zero_bubble_rank_zero_holds_its_first_chunks_and_one_second():
    """Rank 0 runs 2p - 1 first-chunk forwards and one second-chunk forward before its first
    weight pass; with as many micro-batches as ranks the later ranks' V holds more (p 4, m 4:
    rank 3 holds all 4 micro-batches of both its stages)."""
    for pp in (2, 4, 8):
        assert in_flight("zero_bubble", pp, 2, 4 * pp, 0) == pytest.approx(pp)
    assert in_flight("zero_bubble", 4, 2, 4, 3) == pytest.approx(4.0)
