"""Group-wise optimizer apply: the update runs over N size-balanced, contiguous parameter groups.

Why: torch's multi-tensor (foreach) AdamW allocates temporaries (sqrt of the second moment) for
every tensor it updates at once; stepping one group at a time bounds them to the largest group.
The update of each parameter is the same kernel on the same values, so the result equals a single
apply bitwise. Expert and replicated parameters never share a group (under expert parallelism
their sizes differ per layout, and offload streams them from different buckets).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def _fits(sizes: Sequence[int], capacity: int, num_groups: int) -> bool:
    """Can ``sizes`` be cut into at most ``num_groups`` contiguous runs of sum <= capacity?"""
    groups, current = 1, 0
    for s in sizes:
        if current + s > capacity:
            groups, current = groups + 1, 0
        current += s
    return groups <= num_groups


def partition_contiguous(sizes: Sequence[int], num_groups: int) -> list[list[int]]:
    """Indices of ``sizes`` cut into min(num_groups, len(sizes)) contiguous runs minimising the largest sum.

    Binary search on the largest group sum (each probe a greedy pass), then runs with two or more
    items are split until there are exactly that many groups: splitting never raises the maximum.
    """
    if num_groups < 1:
        raise ValueError(f"optim.apply_groups must be >= 1, got {num_groups}")
    n = len(sizes)
    if n == 0:
        return []
    target = min(num_groups, n)
    low, high = max(sizes), sum(sizes)
    while low < high:
        mid = (low + high) // 2
        if _fits(sizes, mid, target):
            high = mid
        else:
            low = mid + 1
    runs, current, current_sum = [], [], 0
    for i, s in enumerate(sizes):
        if current and current_sum + s > low:
            runs.append(current)
            current, current_sum = [], 0
        current.append(i)
        current_sum += s
    runs.append(current)
    while len(runs) < target:
        # Split the largest splittable run where its two halves are most even.
        k = max((j for j in range(len(runs)) if len(runs[j]) > 1), key=lambda j: sum(sizes[i] for i in runs[j]))
        run = runs[k]
        total, best, acc = sum(sizes[i] for i in run), 1, 0
        best_gap = None
        for cut in range(1, len(run)):
            acc += sizes[run[cut - 1]]
            gap = abs(total - 2 * acc)
            if best_gap is None or gap < best_gap:
                best, best_gap = cut, gap
        runs[k:k + 1] = [run[:best], run[best:]]
    return runs


def split_apply_groups(replicated: Sequence[torch.Tensor], experts: Sequence[torch.Tensor],
                       num_groups: int) -> list[list[torch.Tensor]]:
    """Replicated params then expert params, each cut into contiguous size-balanced groups.

    The N groups are shared between the two kinds in proportion to their element counts, each
    non-empty kind getting at least one; fewer tensors than groups gives one group per tensor.
    """
    kinds = [list(k) for k in (replicated, experts) if len(k) > 0]
    if not kinds:
        return []
    totals = [sum(p.numel() for p in k) for k in kinds]
    if len(kinds) == 1 or num_groups == 1:
        shares = [num_groups] * len(kinds) if len(kinds) == 1 else [1, 1]
    else:
        first = round(num_groups * totals[0] / sum(totals))
        first = min(max(first, 1), num_groups - 1)
        shares = [first, num_groups - first]
    groups = []
    for params, share in zip(kinds, shares):
        for run in partition_contiguous([p.numel() for p in params], share):
            groups.append([params[i] for i in run])
    return groups


def _step_subset(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
    """One optimizer.step() restricted to ``params``, keeping every param group's hyperparameters.

    The groups' "params" lists are narrowed for the call and restored after it, so the optimizer's
    state, its state_dict layout (what checkpoints store) and the LR scheduler see one optimizer.
    """
    keep = {id(p) for p in params}
    full = [g["params"] for g in optimizer.param_groups]
    try:
        for g, all_params in zip(optimizer.param_groups, full):
            g["params"] = [p for p in all_params if id(p) in keep]
        optimizer.step()
    finally:
        for g, all_params in zip(optimizer.param_groups, full):
            g["params"] = all_params


class GroupedApply:
    """Runs ``optimizer``'s update group by group; each parameter is updated once per step()."""

    def __init__(self, optimizer: torch.optim.Optimizer, replicated: Sequence[torch.Tensor],
                 experts: Sequence[torch.Tensor], num_groups: int,
                 forward_order: Sequence[torch.Tensor] = ()) -> None:
        """``forward_order``: the tensors in the order the model's forward reads their weights;
        given, the groups update in the order of their first tensor there (memory.offload=zero: a
        group's weights go back as it finishes, so the first blocks' are on the device first).
        Each tensor's update is its own, so the order changes no value."""
        self.optimizer = optimizer
        optimized = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [i for i, p in enumerate([*replicated, *experts]) if id(p) not in optimized]
        assert not missing, f"{len(missing)} params to group are not in the optimizer"
        self.groups = split_apply_groups(replicated, experts, num_groups) if num_groups > 1 else \
            [[*replicated, *experts]]
        if forward_order:
            position = {id(t): i for i, t in enumerate(forward_order)}
            self.groups.sort(key=lambda group: min(position.get(id(t), len(position)) for t in group))

    def step(self, after_group: Callable[[int], None] | None = None,
             before_group: Callable[[int], None] | None = None) -> None:
        """Update every group in order; ``after_group(i)`` lets offload start copying group i's new
        weights back to the device while group i + 1 updates; ``before_group(i)`` gives group i its
        gradients (16-bit host gradients read back in fp32)."""
        if len(self.groups) == 1 and after_group is None and before_group is None:
            self.optimizer.step()
            return
        for i, params in enumerate(self.groups):
            if before_group is not None:
                before_group(i)
            _step_subset(self.optimizer, params)
            if after_group is not None:
                after_group(i)
