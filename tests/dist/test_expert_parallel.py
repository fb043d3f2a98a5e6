"""Expert parallelism on real gloo process groups: all-to-all, and EP>1 == EP=1 for the MoE layer."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed

from m6.moe import MoELayer
from m6.moe.all_to_all import all_to_all
from m6.parallel import ParallelPlan, apply_plan, build_layout, create_process_groups


def _all_to_all_checks(rank: int, world: int) -> None:
    # Rank r sends (r + d) % 3 rows to rank d (zero rows included); row values name (src, dst, row).
    send = [(rank + d) % 3 for d in range(world)]
    recv = [(s + rank) % 3 for s in range(world)]
    x = torch.cat([torch.tensor([[rank * 100 + d * 10 + i, 1.0] for i in range(send[d])]).reshape(-1, 2)
                   for d in range(world)]).requires_grad_(True)
    y = all_to_all(x, recv, send, dist.group.WORLD)
    expected = torch.cat([torch.tensor([[s * 100 + rank * 10 + i, 1.0] for i in range(recv[s])]).reshape(-1, 2)
                          for s in range(world)])
    assert torch.equal(y, expected)
    # Backward is the reverse exchange: each received row's gradient returns to the row that sent it.
    (y * (rank + 1)).sum().backward()
    grad_rows = torch.cat([torch.full((send[d], 2), float(d + 1)) for d in range(world)])
    assert torch.equal(x.grad, grad_rows)


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_round_trip_and_gradient(world):
    run_distributed(_all_to_all_checks, world)


def _layer(cfg: dict) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(16, 32, cfg["experts"], top_k=cfg["top_k"], capacity_factor=cfg["cf"], min_capacity=1,
                    aux_loss_coef=0.1, z_loss_coef=0.01, num_prototypes=cfg.get("prototypes", 1)).double()


def _ep_equals_single_process(rank: int, world: int, cfg: dict) -> None:
    sizes = cfg.get("sizes", [6] * world)  # tokens per rank (uneven, even zero, at the end of data)
    starts = [sum(sizes[:r]) for r in range(world)]
    g = torch.Generator().manual_seed(1)
    # With seq_len: sizes count sequences of seq_len tokens ([B, S, D], capacity per sequence),
    # some of them padding; else tokens of one [T, D] group.
    shape = (sum(sizes), cfg["seq_len"], 16) if cfg.get("seq_len") else (sum(sizes), 16)
    x_all = torch.randn(shape, generator=g, dtype=torch.float64)
    dy_all = torch.randn(x_all.shape, generator=g, dtype=torch.float64)  # not randn_like: global RNG differs per rank
    mask_all = torch.rand(shape[:-1], generator=g) > 0.25 if cfg.get("seq_len") else None
    reference = _layer(cfg)
    if cfg.get("all_to_one"):
        with torch.no_grad():  # every token prefers expert experts-1 (on the last rank)
            reference.router.weight.zero_()
            reference.router.weight[-1] = 10.0
            x_all = x_all.abs()
    layer = _layer(cfg)
    layer.load_state_dict(reference.state_dict())
    xr = x_all.clone().requires_grad_(True)
    y_ref, aux_ref = reference(xr, mask_all)
    ((y_ref * dy_all).sum() + aux_ref).backward()

    layout = build_layout(world, rank, cfg["ep"], cfg["experts"])
    sharded = apply_plan(layer, ParallelPlan(split=[layer]), create_process_groups(layout),
                         a2a_dtype=cfg.get("a2a_dtype"))
    tol = dict(rtol=2e-2, atol=2e-2) if cfg.get("a2a_dtype") else dict(rtol=1e-9, atol=1e-12)
    mine = slice(starts[rank], starts[rank] + sizes[rank])
    x = x_all[mine].clone().requires_grad_(True)
    y, aux = layer(x, None if mask_all is None else mask_all[mine])
    ((y * dy_all[mine]).sum() + aux).backward()
    if cfg.get("seq_len"):  # capacity really drops here, and the same assignments as one process
        assert int(reference.stats.dropped) > 0
        dropped = layer.stats.dropped.clone()
        dist.all_reduce(dropped)
        assert int(dropped) == int(reference.stats.dropped)

    torch.testing.assert_close(y, y_ref[mine], **tol)
    assert y.dtype == torch.float64  # a low-precision payload is cast back; the combine stays wide
    torch.testing.assert_close(aux, aux_ref, rtol=1e-10, atol=1e-12)  # global routing statistics
    torch.testing.assert_close(x.grad, xr.grad[mine], **tol)
    router_grad = layer.router.weight.grad.clone()
    dist.all_reduce(router_grad)  # replicated params: the sum over ranks is the full gradient
    torch.testing.assert_close(router_grad, reference.router.weight.grad, **tol)
    first, count = layout.first_local_expert, layout.experts_per_rank
    for name in ("w_in", "w_out"):
        local = getattr(layer.experts, name).grad.clone()
        dist.all_reduce(local, group=sharded.groups.expert_data)  # replicas of the same experts
        expected = getattr(reference.experts, name).grad[first:first + count]
        torch.testing.assert_close(local, expected, **tol)
    counts = layer.stats.tokens_per_expert
    torch.testing.assert_close(counts, reference.stats.tokens_per_expert)
    if cfg.get("all_to_one"):
        assert int(counts[-1]) == sum(sizes) and int(counts[:-1].sum()) == 0


EP_CASES = {
    "ep2_dropless_top2": dict(world=2, ep=2, experts=4, top_k=2, cf=None),
    "ep4_dropless_top1": dict(world=4, ep=4, experts=8, top_k=1, cf=None),
    "ep2_of_4_capacity": dict(world=4, ep=2, experts=4, top_k=2, cf=10.0),
    "ep2_prototypes": dict(world=2, ep=2, experts=8, top_k=1, cf=None, prototypes=2),
    "ep4_all_to_one_expert": dict(world=4, ep=4, experts=4, top_k=1, cf=None, all_to_one=True),
    "ep2_rank_without_tokens": dict(world=2, ep=2, experts=4, top_k=2, cf=None, sizes=[0, 9]),
    "ep4_uneven_capacity": dict(world=4, ep=4, experts=8, top_k=2, cf=50.0, sizes=[3, 0, 7, 5]),
    "ep2_of_4_sequence_capacity": dict(world=4, ep=2, experts=4, top_k=2, cf=1.0, seq_len=12, sizes=[2, 1, 3, 2]),
    "ep2_bf16_payload": dict(world=2, ep=2, experts=4, top_k=2, cf=None, a2a_dtype=torch.bfloat16),
}


@pytest.mark.parametrize("name", list(EP_CASES))
def test_moe_layer_expert_parallel_equals_single_process(name):
    cfg = EP_CASES[name]
    run_distributed(_ep_equals_single_process, cfg["world"], cfg)
