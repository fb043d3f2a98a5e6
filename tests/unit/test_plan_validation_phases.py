"""bench.plan_validation's breakdown of a measured step: at pipeline parallel the forwards and
backwards run inside the schedule (PhaseClock's pipeline phase), with the update's finish nested
in it; the table's forward + backward is the schedule less the finish, never the 0 of the
trainer's own forward_loss / backward, which a pipeline step does not call."""

from __future__ import annotations

import pytest

from bench.plan_measure import PIPELINE_PHASE
from bench.plan_validation import forward_backward_and_listed

PLAIN = {"forward": 0.20, "backward": 0.30, "finish (grad sync wait, offload)": 0.05, "clip": 0.01, "update": 0.02}


def test_plain_step_is_forward_plus_backward() -> None:
    fb, listed = forward_backward_and_listed(PLAIN)
    assert fb == pytest.approx(0.50)
    assert listed == pytest.approx(0.58)


def test_pipeline_step_is_the_schedule_less_its_nested_finish() -> None:
    phases = dict(PLAIN, forward=0.0, backward=0.0, **{PIPELINE_PHASE: 0.40})
    fb, listed = forward_backward_and_listed(phases)
    assert fb == pytest.approx(0.35)
    assert listed == pytest.approx(0.43)  # schedule (finish inside it) + clip + update
