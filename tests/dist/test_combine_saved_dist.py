"""The combine and ungroup autograd Functions (m6.moe.dispatch) under expert parallelism on 2 real
gloo ranks: the same loss and every parameter gradient bitwise as the plain autograd graph
(tests/unit/test_combine_saved.py's reference), for the loop and grouped_mm kernels, fp32 and bf16,
the blocking exchange and the chunked one (overlap degree 2), flat and node-aware (2 nodes of 1
rank: the relay's weighted sums and the source's sums); and the saved-tensor meter counts exactly
the rows in fp32 and ungroup's source fewer."""

from __future__ import annotations

import contextlib

import torch
from dist_helpers import REPO, run_distributed


def _compare(rank: int, world_size: int) -> None:
    from m6 import config as m6config
    from m6.moe.all_to_all import AllToAllDispatcher
    from m6.moe.node_aware_all_to_all import NodeAwareDispatcher
    from m6.parallel import build_layout, create_process_groups
    from m6.parallel.node_groups import ep_group_nodes
    from m6.plan.memory import rank_model
    from tests.unit.test_combine_saved import ReferenceOps, assert_bitwise, forward_backward
    from tests.unit.test_plan_memory import SMALL

    base = m6config.load(REPO / "configs" / "tiny.yaml", SMALL)
    E = base.model.moe.num_experts
    layout = build_layout(world_size, rank, world_size, E, local_world_size=1)  # 2 nodes of 1 rank
    groups = create_process_groups(layout, node_aware=True)

    def dispatcher(form: str, overlap: int):
        if form == "flat":
            return AllToAllDispatcher(groups.expert, E, overlap_degree=overlap)
        return NodeAwareDispatcher(groups.expert, groups.node_aware.rail, groups.node_aware.node, E,
                                   ep_group_nodes(layout), None, layout.counts_for(E), overlap)

    cases = [(kernel, form) for kernel in ("loop", "grouped_mm") for form in ("flat", "node_aware")
             if (kernel, form) != ("grouped_mm", "node_aware")]
    for kernel, form in cases:
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
                        layer.dispatcher = dispatcher(form, overlap)
                    with reference.installed() if use_reference else contextlib.nullcontext():
                        runs.append(forward_backward(model, cfg, dtype))
                (loss, grads, held), (ref_loss, ref_grads, ref_held) = runs
                label = f"rank {rank} {kernel} {form} {dtype} overlap {overlap}"
                assert grads, label
                assert_bitwise((loss, grads), (ref_loss, ref_grads), label)
                # Per MoE layer: flat, the combine and one ungroup per chunk; node-aware, one ungroup
                # and one relay sum per chunk, and the source's sum.
                chunks = overlap
                expected = ({"combine_tokens": 1, "ungroup": chunks} if form == "flat"
                            else {"ungroup": chunks, "sum_rows": chunks + 1})
                assert reference.calls == expected, (label, reference.calls)
                assert ref_held - held == reference.extra_bytes, (label, ref_held, held, reference.extra_bytes)


def test_combine_and_ungroup_keep_less_with_bitwise_the_same_gradients_under_expert_parallelism():
    run_distributed(_compare, 2, timeout_s=120)
