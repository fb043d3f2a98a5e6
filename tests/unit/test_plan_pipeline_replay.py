"""The planner's pipeline bubble (m6.plan.pipeline.bubble_s) is torch's own action order
(m6.parallel.pipeline_order) replayed (m6.plan.pipeline_replay): 1F1B and interleaved replay exactly
their textbook idle share (p-1)/(v m + p - 1); torch's ZB-V order idles where the paper's
schedule would not (bench/results/pipeline_bubble-cpu-2core.md: 4.0%, 2.0%, 5.9%, and 0.20 at
p 4 m 4, where a laid-out-for-2p-1 term said 3/7); a message's time lands on the critical path;
an order that waits on an action never run before it is an error, not a hang."""

import pytest

from m6.plan.pipeline import bubble_s, idle_share
from m6.parallel.pipeline_order import Action
from m6.plan.pipeline_replay import design_cost, replay, schedule_idle, schedule_order


def _grid():
    for p in (2, 3, 4, 8):
        for m in (p, p + 1, 2 * p, 3 * p + 2, 4 * p):
            yield "1f1b", p, 1, m
        for v in (2, 3, 4):
            for m in (p, 2 * p, 4 * p):  # interleaved runs a multiple of p micro-batches
                yield "interleaved", p, v, m


@pytest.mark.parametrize("schedule, p, v, m", list(_grid()))
def test_one_f_one_b_and_interleaved_replay_their_formula(schedule, p, v, m):
    done = replay(schedule_order(schedule, p, v, m), lambda s: s % p, p * v, lambda a: design_cost(a, v))
    assert done.makespan == pytest.approx(3 * (m + (p - 1) / v))
    assert done.idle_share() == pytest.approx([(p - 1) / (v * m + p - 1)] * p)  # every rank alike
    assert schedule_idle(schedule, p, v, m) == pytest.approx((p - 1) / v)
    assert idle_share(schedule, p, v, m) == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("p, m, share", [(2, 4, 1 / 25), (2, 8, 1 / 49), (4, 8, 1 / 17), (4, 4, 1 / 5)])
def test_zero_bubble_idles_as_torchs_order_does(p, m, share):
    assert idle_share("zero_bubble", p, 2, m) == pytest.approx(share)


def test_the_first_stage_runs_its_whole_backward_as_the_weight_gradient():
    # torch's PipelineStage.backward_one_chunk skips the first stage's input-gradient pass
    assert design_cost(Action("I", 0, 0), 2) == 0.0 and design_cost(Action("W", 0, 0), 2) == 1.0
    assert design_cost(Action("I", 1, 0), 2, 0.2) == pytest.approx(0.6)
    assert design_cost(Action("W", 1, 0), 2, 0.2) == pytest.approx(0.4)


def test_attention_moves_backward_work_to_the_input_gradient():
    # weightless attention matmuls: more I, less W to fill the V's bubble with; 1f1b's full backward alike
    assert schedule_idle("zero_bubble", 4, 2, 16, 0.2) > schedule_idle("zero_bubble", 4, 2, 16, 0.0)
    assert schedule_idle("1f1b", 4, 1, 8, 0.3) == schedule_idle("1f1b", 4, 1, 8, 0.0)


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved", 2), ("zero_bubble", 2)])
def test_bubble_s_is_the_replay_in_seconds(schedule, v):
    assert bubble_s(schedule, 4, v, 8, 0.5, 0.1) == pytest.approx(0.5 * schedule_idle(schedule, 4, v, 8, 0.1))
    assert bubble_s(schedule, 4, v, 8, 0.5, 0.1) > 0
    assert bubble_s(schedule, 1, v, 8, 0.5, 0.1) == 0.0


def test_message_time_on_the_critical_path():
    # one micro-batch over two ranks: F0, message, F1, B1, message, B0
    done = replay(schedule_order("1f1b", 2, 1, 1), lambda s: s, 2, lambda a: design_cost(a, 1), message_s=0.25)
    assert done.makespan == pytest.approx(6.5)
    assert done.spans[Action("F", 1, 0)] == pytest.approx((1.25, 2.25))
    assert done.spans[Action("B", 0, 0)] == pytest.approx((4.5, 6.5))


def test_an_order_that_waits_on_a_later_action_is_refused():
    order = {0: [Action("F", 0, 0), Action("B", 0, 0)], 1: [Action("B", 1, 0), Action("F", 1, 0)]}  # B before its F
    with pytest.raises(ValueError, match="deadlocks"):
        replay(order, lambda s: s, 2, lambda a: design_cost(a, 1))
