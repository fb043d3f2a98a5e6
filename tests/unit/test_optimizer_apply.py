"""Group-wise optimizer apply (optim.apply_groups): the partition, bitwise equality with a single
apply, and the measured drop in the update's temporaries."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from m6.config import ConfigError, OptimConfig
from m6.memory.live_bytes import LiveBytes
from m6.memory.grouped_apply import GroupedApply, partition_contiguous, split_apply_groups
from m6.train.optim import build_optimizer, build_scheduler


# ---------------------------------------------------------------------------------------------
# The partition


def best_max_sum(sizes: list[int], k: int) -> int:
    """The smallest achievable largest-group sum over every contiguous cut into k runs (brute force)."""
    n = len(sizes)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_partition_is_contiguous_complete_and_optimally_balanced(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([1, 3, 16, 100, 1000]) * rng.randint(1, 9) for _ in range(rng.randint(1, 9))]
    k = rng.randint(1, 6)
    runs = partition_contiguous(sizes, k)
    assert [i for run in runs for i in run] == list(range(len(sizes)))  # contiguous, in order, each once
    assert all(runs) and len(runs) == min(k, len(sizes))
    assert max(sum(sizes[i] for i in run) for run in runs) == best_max_sum(sizes, min(k, len(sizes)))


def test_partition_more_groups_than_tensors_and_bad_counts():
    assert partition_contiguous([5, 1, 7], 10) == [[0], [1], [2]]
    assert partition_contiguous([], 4) == []
    with pytest.raises(ValueError, match="optim.apply_groups"):
        partition_contiguous([1, 2], 0)


def test_expert_and_replicated_params_never_share_a_group():
    replicated = [torch.zeros(n) for n in (300, 10, 10, 280, 5)]
    experts = [torch.zeros(n) for n in (400, 400, 400)]
    groups = split_apply_groups(replicated, experts, 5)
    assert len(groups) == 5
    rep_ids, exp_ids = {id(p) for p in replicated}, {id(p) for p in experts}
    for g in groups:
        kinds = {id(p) in exp_ids for p in g}
        assert len(kinds) == 1
    flat = [p for g in groups for p in g]
    assert [id(p) for p in flat] == [id(p) for p in replicated + experts]
    # 605 replicated vs 1200 expert elements: the 5 groups are shared 2 : 3.
    assert sum(all(id(p) in rep_ids for p in g) for g in groups) == 2
    only_rep = split_apply_groups(replicated, [], 3)
    assert len(only_rep) == 3 and max(sum(p.numel() for p in g) for g in only_rep) == 300
    assert len(split_apply_groups(replicated, experts, 100)) == len(replicated) + len(experts)


# ---------------------------------------------------------------------------------------------
# The step


class ManyTensors(nn.Module):
    """Parameters spread over many tensors: 24 linear layers (weight + bias) and a norm."""

    def __init__(self, width: int = 48, depth: int = 24) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.norm(x)


def make(num_groups: int, seed: int = 0, implementation: str = "auto"):
    torch.manual_seed(seed)
    model = ManyTensors()
    cfg = OptimConfig(lr=1e-2, warmup_steps=2, weight_decay=0.1, apply_groups=num_groups,
                      implementation=implementation)
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg, max_steps=10)
    params = list(model.parameters())
    apply = GroupedApply(opt, params[:-8], params[-8:], num_groups)  # the last 4 layers play "experts"
    return model, opt, sched, apply


def train_steps(model, opt, sched, apply, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 48, generator=gen)
        model(x).square().mean().backward()
        apply.step()
        opt.zero_grad(set_to_none=True)
        sched.step()


@pytest.mark.parametrize("num_groups", [2, 8, 1000])
def test_grouped_apply_equals_a_single_apply_bitwise(num_groups):
    ref = make(1)
    train_steps(*ref)
    model, opt, sched, apply = make(num_groups)
    calls = []
    opt.register_step_post_hook(lambda *_: calls.append(1))
    train_steps(model, opt, sched, apply)
    expected_groups = min(num_groups, len(list(model.parameters())))
    assert len(apply.groups) == expected_groups
    assert len(calls) == 3 * expected_groups  # the optimizer really ran once per group per step
    for a, b in zip(ref[0].parameters(), model.parameters()):
        assert torch.equal(a, b)
    ref_sd, sd = ref[1].state_dict(), opt.state_dict()
    assert ref_sd["param_groups"] == sd["param_groups"]  # same layout: checkpoints interchangeable
    for k, state in sd["state"].items():
        assert float(state["step"]) == 3.0  # the step counter advanced once per step, not per group
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[name], ref_sd["state"][k][name])
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert sched.get_last_lr() == ref[2].get_last_lr()


def step_temporaries(num_groups: int, implementation: str = "auto") -> tuple[int, GroupedApply]:
    """Peak live bytes allocated during the second update (moments exist already)."""
    model, opt, sched, apply = make(num_groups, implementation=implementation)
    train_steps(model, opt, sched, apply, steps=1)
    model(torch.randn(16, 48)).square().mean().backward()
    with LiveBytes() as counter:
        apply.step()
    return counter.peak, apply


def largest_foreach_call_bytes(apply: GroupedApply) -> int:
    """Bytes of the largest set of tensors one foreach AdamW call updates: torch runs each param
    group (decay / no-decay) separately, so within an apply group the larger of the two parts."""
    parts = []
    for group in apply.groups:
        ids = {id(p) for p in group}
        for pg in apply.optimizer.param_groups:
            parts.append(sum(p.numel() * 4 for p in pg["params"] if id(p) in ids))
    return max(parts)


def test_apply_groups_cut_the_update_temporaries():
    peak_1, apply_1 = step_temporaries(1)
    peak_8, apply_8 = step_temporaries(8)
    # foreach AdamW's one tensor-sized temporary is sqrt(exp_avg_sq): 4 B per element of a call,
    # plus a few scalar tensors (< 1 KiB).
    for peak, apply in ((peak_1, apply_1), (peak_8, apply_8)):
        expected = largest_foreach_call_bytes(apply)
        assert expected <= peak <= expected + 1024, (peak, expected)
        # The memory report's estimate (4 B x the largest apply group) is an upper bound within 5 %.
        bound = 4 * max(sum(p.numel() for p in g) for g in apply.groups)
        assert peak <= bound <= 1.05 * peak
    assert peak_8 <= 0.4 * peak_1, (peak_1, peak_8)  # >= 60 % less


# ---------------------------------------------------------------------------------------------
# optim.implementation: the fused AdamW kernel


def test_auto_takes_fused_adamw_on_cuda_and_foreach_on_the_host():
    assert OptimConfig().adamw_kernel(on_cuda=True) == "fused"
    assert OptimConfig().adamw_kernel(on_cuda=False) == "foreach"
    assert OptimConfig(implementation="foreach").adamw_kernel(on_cuda=True) == "foreach"
    assert OptimConfig(implementation="fused").adamw_kernel(on_cuda=False) == "fused"
    assert OptimConfig(name="adafactor").adamw_kernel(on_cuda=True) == "foreach"
    with pytest.raises(ConfigError, match="optim.implementation=fused is AdamW's"):
        OptimConfig(name="adafactor", implementation="fused").validate()
    # The optimizer built: the CPU test model's tensors are on the host (auto: foreach).
    assert make(1)[1].defaults["foreach"] and not make(1)[1].defaults["fused"]
    assert make(1, implementation="fused")[1].defaults["fused"]


def test_fused_adamw_trains_like_foreach_and_keeps_no_temporaries():
    """torch's fused AdamW (here its CPU kernel; auto takes the CUDA one on a GPU) reaches the
    foreach update's weights to fp32 rounding, with the same state layout, and allocates nothing
    tensor-sized during the step, so the memory report counts no step temporaries for it."""
    ref = make(8)
    train_steps(*ref)
    fused = make(8, implementation="fused")
    train_steps(*fused)
    for a, b in zip(ref[0].parameters(), fused[0].parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)  # 0.1% of one update (lr 1e-2)
    assert ref[1].state_dict()["param_groups"][0].keys() == fused[1].state_dict()["param_groups"][0].keys()
    peak, apply = step_temporaries(1, implementation="fused")
    assert peak <= 0.05 * largest_foreach_call_bytes(apply), peak
