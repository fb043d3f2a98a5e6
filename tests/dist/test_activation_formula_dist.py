"""The activation formula under expert parallelism (m6.model.activation_bytes with
expert_parallel_size 2) against the saved-tensor meter on 2 real gloo ranks running the
AllToAllDispatcher: the rows received back, which the combine keeps (ungroup keeps only its
index), in fp32, in bf16 (the payload in the compute dtype) and with a bf16 payload of an fp32 run."""

from __future__ import annotations


import torch
import torch.distributed as dist
from dist_helpers import REPO, run_distributed


def _measure(rank: int, world_size: int) -> None:
    from m6 import config as m6config
    from m6.model.activation_bytes import ActivationShape, activation_bytes
    from m6.model.cast_on_use import set_cast_on_use
    from m6.moe.all_to_all import AllToAllDispatcher
    from m6.plan.memory import rank_model
    from tests.unit.test_activation_formula import metered_forward
    from tests.unit.test_plan_memory import SMALL

    # force_balance: each rank receives as many rows as it sends, the formula's assumption.
    cfg = m6config.load(REPO / "configs" / "tiny.yaml", SMALL + ["model.moe.force_balance=true", "model.num_layers=2",
                                                                 "model.moe.expert_kernel=loop"])
    for precision, a2a in (("fp32", None), ("bf16", None), ("fp32", torch.bfloat16)):
        torch.manual_seed(0)
        model = rank_model(cfg, world_size, world_size, rank=rank)
        model.materialize(torch.device("cpu"), 0)
        for layer in model.moe_layers().values():
            layer.dispatcher = AllToAllDispatcher(dist.group.WORLD, cfg.model.moe.num_experts, a2a)
        dtype = torch.bfloat16 if precision == "bf16" else None
        set_cast_on_use(model, dtype is not None)
        loss, held = metered_forward(model, cfg, 3, dtype)
        c = 2 if dtype is not None else 4
        shape = ActivationShape(3, cfg.data.seq_len, c, 2 if a2a is not None else c, world_size, expert_kernel="loop")
        predicted = activation_bytes(cfg.model, shape).kept()
        assert abs(predicted - held) <= 0.005 * held, (rank, precision, a2a, predicted, held)
        loss.backward()  # the backward's exchanges, on every rank alike


def test_formula_equals_the_meter_under_expert_parallelism():
    run_distributed(_measure, 2, timeout_s=120)
