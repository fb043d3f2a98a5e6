"""The combine and ungroup autograd Functions (m6.moe.dispatch) under expert parallelism on 2 real
gloo ranks: the same loss and every parameter gradient bitwise as the plain autograd graph
(tests/unit/test_combine_saved.py's reference), for the loop and grouped_mm kernels, fp32 and bf16,
the blocking exchange and the chunked one (overlap degree 2); and the saved-tensor meter counts
exactly the weighted fp32 rows and ungroup's source fewer."""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_helpers import REPO, run_distributed


def _compare(rank: int, world_size: int) -> None:
    from m6 import config as m6config
    from m6.moe.all_to_all import AllToAllDispatcher
    from m6.plan.memory import rank_model
    from tests.unit.test_combine_saved import ReferenceOps, assert_bitwise, forward_backward
    from tests.unit.test_plan_memory import SMALL

    for kernel in ("loop", "grouped_mm"):
        cfg = m6config.load(REPO / "configs" / "tiny.yaml", SMALL + [
            "model.num_layers=2", "model.d_model=32", "model.ffn_dim=64", "model.num_heads=2",
            f"model.moe.expert_kernel={kernel}"])
        for dtype in (None, torch.bfloat16):
            for overlap in (1, 2):
                runs, reference = [], ReferenceOps()
                for use_reference in (False, True):
                    torch.manual_seed(0)
                    model = rank_model(cfg, world_size, world_size, rank=rank)
                    model.materialize(torch.device("cpu"), 0)
                    for layer in model.moe_layers().values():
                        layer.dispatcher = AllToAllDispatcher(dist.group.WORLD, cfg.model.moe.num_experts,
                                                              overlap_degree=overlap)
                    if use_reference:
                        with reference.installed():
                            runs.append(forward_backward(model, cfg, dtype))
                    else:
                        runs.append(forward_backward(model, cfg, dtype))
                (loss, grads, held), (ref_loss, ref_grads, ref_held) = runs
                label = f"rank {rank} {kernel} {dtype} overlap {overlap}"
                assert grads, label
                assert_bitwise((loss, grads), (ref_loss, ref_grads), label)
                assert reference.extra_bytes > 0, label
                assert ref_held - held == reference.extra_bytes, (label, ref_held, held, reference.extra_bytes)


def test_combine_and_ungroup_keep_less_with_bitwise_the_same_gradients_under_expert_parallelism():
    run_distributed(_compare, 2, timeout_s=120)
