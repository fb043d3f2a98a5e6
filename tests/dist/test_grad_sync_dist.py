"""Gradient sync on real gloo process groups when ranks' graphs differ: a parameter unused on some
ranks (a custom model's branch, a modality missing from a rank's batch). Every rank must issue the
same all-reduces in the same order: the gradients equal the single-process gradient of the global
batch, and nothing hangs (every collective here times out after TIMEOUT_S)."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import flat_bucket_sums, run_distributed
from torch import nn

from m6.moe import MoELayer
from m6.parallel import (GradientLayoutError, GradientSync, ParallelPlan, apply_plan, build_layout,
                         create_process_groups)

TIMEOUT_S = 30
SAMPLES_PER_RANK = 3


class Shift(nn.Module):
    """x + a learned vector: a module so that, registered last, its parameter comes last in
    named_parameters (a module's own parameters come before its children's) and first in bucket order."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.randn(16) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.shift


class Branchy(nn.Module):
    """Dense layers and one branch (``extra``) that only some ranks' batches use; ``late`` (when
    present) is registered last, so its bucket comes first, but used first, so its gradient comes last."""

    def __init__(self, extra_dim: int, with_late: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(16, 16)
        self.extra = nn.Linear(16, extra_dim)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.late = Shift() if with_late else None

    def forward(self, x: torch.Tensor, use_extra: bool, use_late: bool) -> torch.Tensor:
        h = self.embed(self.late(x) if use_late else x).tanh()
        if use_extra:
            h = h + self.extra(h).tanh()[:, :16].sum(1, keepdim=True)
        return self.head(self.mid(h).tanh()).sum()


# (extra_dim, with_late, per rank (use_extra, use_late))
CASES = [
    (16, False, [(True, False), (False, False)]),  # misordered all-reduces of equal sizes: silently wrong sums
    (24, True, [(True, True), (False, True)]),  # of different sizes: a mismatched collective
    (24, True, [(False, False), (True, True)]),  # extra and late unused on rank 0 only
    (24, True, [(False, False), (False, False)]),  # unused on every rank
]


def _inputs(world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)  # the same global batch on every rank
    return torch.randn(world, SAMPLES_PER_RANK, 16, generator=g, dtype=torch.float64)


def _reference_grads(case: tuple, world: int) -> dict[str, torch.Tensor]:
    """One process, the global batch: the sum of every rank's loss with that rank's branches."""
    extra_dim, with_late, uses = case
    model = Branchy(extra_dim, with_late).double()
    x = _inputs(world)
    sum(model(x[r], *uses[r]) for r in range(world)).backward()
    # No rank reached it: the sync sums zeros (a single process would leave it without a gradient).
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _sync_branchy(rank: int, world: int, groups, case: tuple, prepare: bool, max_in_flight: int) -> None:
    extra_dim, with_late, uses = case
    model = Branchy(extra_dim, with_late).double()
    sharded = apply_plan(model, ParallelPlan(), groups)
    # One byte per bucket: every tensor is a bucket of its own, so orders are easy to get wrong.
    sync = GradientSync(sharded, bucket_bytes=1, max_in_flight=max_in_flight)
    x = _inputs(world)[rank]

    sync.enabled = False  # local gradients first: the reference the sync must sum bitwise
    model(x, *uses[rank]).backward()
    expected = flat_bucket_sums(sync)
    model.zero_grad(set_to_none=True)

    sync.enabled = True
    loss = model(x, *uses[rank])
    if prepare:
        sync.prepare(loss)
    loss.backward()
    sync.finish()
    reference = _reference_grads(case, world)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, expected[id(p)]), (rank, name)
        torch.testing.assert_close(p.grad, reference[name], rtol=1e-12, atol=1e-12, msg=f"rank {rank} {name}")
    assert all(b.flat is None and b.work is None for b in sync.buckets)


def _unused_on_some_ranks(rank: int, world: int) -> None:
    groups = create_process_groups(build_layout(world, rank, 1, 1))
    for case in CASES:
        for prepare, max_in_flight in ((False, 2), (True, 1), (True, 3)):
            _sync_branchy(rank, world, groups, case, prepare, max_in_flight)
    # A rank that built another model: every rank fails at construction, naming it, instead of
    # reducing mismatched buckets later.
    model = Branchy(16 if rank != 1 else 24, True).double()
    sharded = apply_plan(model, ParallelPlan(), groups)
    with pytest.raises(GradientLayoutError, match=r"rank 1\b.*extra\.bias"):
        GradientSync(sharded, bucket_bytes=1)


def test_parameter_unused_on_one_rank_gives_the_global_gradient_and_layouts_are_checked():
    run_distributed(_unused_on_some_ranks, 2, timeout_s=TIMEOUT_S)


class MoEBranchy(nn.Module):
    """Embedding -> MoE layer (experts split: an all-to-all in forward and in backward) -> ``post``
    -> head. ``post`` and ``late`` are used only on some ranks; ``late`` is registered last (its
    bucket comes first) and used first (its gradient comes last, after the all-to-all)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(16, 16)
        self.moe = MoELayer(16, 32, 4, top_k=2, capacity_factor=None, min_capacity=1, aux_loss_coef=0.1,
                            z_loss_coef=0.01)
        self.post = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.late = Shift()

    def embedded(self, x: torch.Tensor, use_late: bool) -> torch.Tensor:
        return self.embed(self.late(x) if use_late else x).tanh()

    def out(self, y: torch.Tensor, use_post: bool) -> torch.Tensor:
        return self.head(y + self.post(y).tanh() if use_post else y).sum()

    def forward(self, x: torch.Tensor, use_post: bool, use_late: bool) -> torch.Tensor:
        y, aux = self.moe(self.embedded(x, use_late))
        return self.out(y, use_post) + aux


def _moe_unused_on_some_ranks(rank: int, world: int) -> None:
    uses = [(True, True), (False, False), (True, False), (False, True)]  # (post, late) per rank
    model = MoEBranchy().double()
    layout = build_layout(world, rank, 2, 4)
    sharded = apply_plan(model, ParallelPlan(split=[model.moe]), create_process_groups(layout))
    assert sharded.expert_params and layout.expert_data_parallel_size == 2
    # Wait for a bucket before launching the next: had a rank whose graph skips ``late`` (its
    # first bucket, complete at once) waited inside backward for a rank that launches that
    # bucket only after an all-to-all, neither would move.
    sync = GradientSync(sharded, bucket_bytes=1, max_in_flight=1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world, 5, 16, generator=g, dtype=torch.float64)

    sync.enabled = False
    model(x[rank], *uses[rank]).backward()
    expected = flat_bucket_sums(sync)
    model.zero_grad(set_to_none=True)
    sync.enabled = True
    for prepare in (True, False):
        loss = model(x[rank], *uses[rank])
        if prepare:
            sync.prepare(loss)
        loss.backward()
        sync.finish()
        for name, p in model.named_parameters():
            assert torch.equal(p.grad, expected[id(p)]), (rank, prepare, name)
        model.zero_grad(set_to_none=True)

    # The single-process gradient of the global batch: one MoE call over every rank's tokens (the
    # aux loss is formed from global routing statistics; dropless, so routing does not depend on
    # the split).
    ref = MoEBranchy().double()
    y, aux = ref.moe(torch.cat([ref.embedded(x[r], uses[r][1]) for r in range(world)]))
    (sum(ref.out(y_r, uses[r][0]) for r, y_r in enumerate(y.split(5))) + aux).backward()
    loss = model(x[rank], *uses[rank])
    sync.prepare(loss)
    loss.backward()
    sync.finish()
    first, count = layout.first_local_expert, layout.experts_per_rank
    for name, p in model.named_parameters():
        want = ref.get_parameter(name).grad
        if name in sharded.expert_params:
            want = want[first:first + count]
        torch.testing.assert_close(p.grad, want, rtol=1e-10, atol=1e-12, msg=f"rank {rank} {name}")


def test_parameter_unused_on_some_ranks_with_experts_split():
    run_distributed(_moe_unused_on_some_ranks, 4, timeout_s=TIMEOUT_S)
