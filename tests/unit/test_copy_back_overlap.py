"""The planner's block copy-back overlap (m6.plan.copy_back_overlap) against an event-by-event
simulation of the copy stream and the forward: segment i's copy follows segment i - 1's on the
link, and block i's forward starts when block i - 1's has ended and its own copy has landed."""

from __future__ import annotations

import pytest

from m6.plan.copy_back_overlap import weights_back_exposed


def simulated_wait(copies: list[float], forwards: list[float]) -> float:
    """Seconds the forward ends later than its compute alone would."""
    landed = end = 0.0
    for copy, forward in zip(copies, forwards):
        landed += copy
        end = max(end, landed) + forward
    return end - sum(forwards)


@pytest.mark.parametrize("first, per_block, forward, blocks", [
    (0.05, 0.02, 0.01, 8),   # the link slower than the forward: most of the copy shows
    (0.05, 0.01, 0.02, 8),   # the forward slower: only the first piece shows
    (0.30, 0.01, 0.02, 4),   # a large first piece (a big embedding and head)
    (0.01, 0.01, 0.01, 1),   # one block: nothing to overlap with
    (0.02, 0.015, 0.015, 24),  # balanced
])
def test_exposed_copy_back_is_the_simulated_pipelines(first, per_block, forward, blocks):
    copies = [first] + [per_block] * (blocks - 1)
    back = sum(copies)
    got = weights_back_exposed(back, first, forward * blocks, blocks)
    assert got == pytest.approx(simulated_wait(copies, [forward] * blocks))
    assert first - 1e-12 <= got <= back + 1e-12


def test_other_copies_on_the_link_during_the_forward_hide_less():
    free = weights_back_exposed(1.0, 0.1, 1.0, 10)
    busy = weights_back_exposed(1.0, 0.1, 1.0, 10, link_busy_s=0.5)
    assert free < busy <= 1.0
    assert weights_back_exposed(0.0, 0.0, 1.0, 10) == 0.0
