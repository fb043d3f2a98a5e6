"""The pipeline schedule replay behind bench/pipeline_bubble.py: torch's 1F1B loop order idles
exactly the textbook (p-1)/(m+p-1) with forward 1, backward 2 and free messages; a message's
time lands on the critical path where a rank waits for it; an order that waits on an action
never run before it is an error, not a hang."""

import pytest

from bench.pipeline_schedule_sim import Op, one_f_one_b_order, simulate


def _cost(op: Op) -> float:
    return 1.0 if op.kind == "F" else 2.0


@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (4, 4), (4, 8), (3, 5)])
def test_one_f_one_b_idles_the_formula(p, m):
    replay = simulate(one_f_one_b_order(p, m), lambda s: s, p, _cost)
    assert replay.makespan == pytest.approx(3 * (m + p - 1))
    assert replay.idle_share() == pytest.approx([(p - 1) / (m + p - 1)] * p)


def test_torch_one_f_one_b_warms_up_p_minus_rank_forwards():
    order = one_f_one_b_order(3, 4)
    assert order[0][:4] == [Op(0, "F", 0), Op(0, "F", 1), Op(0, "F", 2), Op(0, "B", 0)]
    assert order[2][:3] == [Op(2, "F", 0), Op(2, "B", 0), Op(2, "F", 1)]
    assert all(sorted(ops) == sorted([Op(r, k, i) for k in "FB" for i in range(4)]) for r, ops in order.items())


def test_message_time_on_the_critical_path():
    # one micro-batch over two ranks: F0, message, F1, B1, message, B0
    replay = simulate(one_f_one_b_order(2, 1), lambda s: s, 2, _cost, message_s=0.25)
    assert replay.makespan == pytest.approx(6.5)
    assert replay.spans[Op(1, "F", 0)] == pytest.approx((1.25, 2.25))
    assert replay.spans[Op(0, "B", 0)] == pytest.approx((4.5, 6.5))


def test_an_order_that_waits_on_a_later_action_is_refused():
    order = {0: [Op(0, "F", 0), Op(0, "B", 0)], 1: [Op(1, "B", 0), Op(1, "F", 0)]}  # B before its own F
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(order, lambda s: s, 2, _cost)
