"""One rank's forward and backward of a small float64 MoE layer on a test case (the exchange tests'
shared step: test_a2a_overlap_dist, test_node_aware_dist). A case names the experts, top_k, the
capacity factor, the rows per rank, the seed and optionally all_to_one (every token prefers the last
expert); ``install(layer)`` puts the dispatcher under test in."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from m6.moe import MoELayer


def case_layer(case: dict) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(16, 24, case["experts"], top_k=case["top_k"], capacity_factor=case["cf"], min_capacity=1,
                    aux_loss_coef=0.1, z_loss_coef=0.01).double()


def run_case(rank: int, case: dict, install: Callable[[MoELayer], None]) -> tuple[MoELayer, torch.Tensor, tuple]:
    """(layer, this rank's input, (output, input gradient, router gradient summed over ranks, local
    expert gradients, routed tokens per expert)) after one forward and backward."""
    sizes = case["sizes"]
    g = torch.Generator().manual_seed(case["seed"])
    x_all = torch.randn(sum(sizes), 16, generator=g, dtype=torch.float64)
    dy_all = torch.randn(x_all.shape, generator=g, dtype=torch.float64)
    layer = case_layer(case)
    if case.get("all_to_one"):
        with torch.no_grad():  # every token prefers the last expert (on the last rank)
            layer.router.weight.zero_()
            layer.router.weight[-1] = 10.0
            x_all = x_all.abs()
    install(layer)
    start = sum(sizes[:rank])
    mine = slice(start, start + sizes[rank])
    x = x_all[mine].clone().requires_grad_(True)
    y, aux = layer(x)
    ((y * dy_all[mine]).sum() + aux).backward()
    router_grad = layer.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    return layer, x.detach(), (y.detach(), x.grad, router_grad, layer.experts.w_in.grad, layer.experts.w_out.grad,
                               layer.stats.tokens_per_expert)


def sized(fixed: list[dict], world: int) -> list[dict]:
    """The fixed cases with rows per rank (7, 10, 13, ...; 2 each when ``tiny``; none on rank 0 when
    ``empty_rank``) and a seed each."""
    cases = []
    for i, case in enumerate(fixed):
        sizes = [2] * world if case.get("tiny") else [7 + 3 * r for r in range(world)]
        if case.get("empty_rank"):
            sizes[0] = 0
        cases.append(dict(case, sizes=sizes, seed=10 + i))
    return cases
