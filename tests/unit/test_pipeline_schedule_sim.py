"""The bench's side of the pipeline replay (bench.pipeline_schedule_sim over m6.plan.pipeline_replay):
an action's design time is its timed holds' (the bench's stages hold forward_s / v per kind), the
first stage's input-gradient action holding nothing under ZB-V; a case replays at the costs a run
measured, its messages' time included."""

import pytest

from bench.pipeline_schedule_sim import held_kinds, nominal_cost, replay_case
from m6.parallel.pipeline_order import Action
from m6.plan.pipeline_replay import schedule_order


@pytest.mark.parametrize("schedule, p, v, m", [("1f1b", 3, 1, 5), ("interleaved", 2, 2, 4), ("zero_bubble", 4, 2, 8)])
def test_design_cost_is_the_actions_holds(schedule, p, v, m):
    for actions in schedule_order(schedule, p, v, m).values():
        for a in actions:
            assert nominal_cost(a, v, 0.1) == pytest.approx(len(held_kinds(a)) * 0.1 / v)
    assert held_kinds(Action("I", 0, 3)) == () and held_kinds(Action("W", 0, 3)) == ("I", "W")


def test_a_case_replays_at_measured_costs_and_message_time():
    # zero bubble, p 2: rank 0 runs stages 0 and 3; a slow forward on stage 1 delays the V's turn
    order = schedule_order("zero_bubble", 2, 2, 2)
    design = replay_case("zero_bubble", 2, 2, order, lambda a: nominal_cost(a, 2, 1.0))
    slow = replay_case("zero_bubble", 2, 2, order, lambda a: nominal_cost(a, 2, 1.0) + (1.0 if a == Action("F", 1, 0) else 0))
    sent = replay_case("zero_bubble", 2, 2, order, lambda a: nominal_cost(a, 2, 1.0), message_s=0.1)
    assert slow.makespan == pytest.approx(design.makespan + 1.0)
    assert sent.makespan > design.makespan
    assert sent.spans[Action("F", 1, 0)][0] == pytest.approx(design.spans[Action("F", 1, 0)][0] + 0.1)
