"""Uneven expert parallelism: how many experts each expert-parallel (EP) rank holds when the ranks
are of unequal speed (parallel.balance), so a slow rank also computes fewer experts.

Each EP rank owns a contiguous range of global expert ids, in EP rank order; the counts are in
proportion to the ranks' weights. Rounding rule: rank i first gets floor(E * w_i / sum(w)), the
experts left over go one each to the ranks with the largest remainders (ties to the lower rank),
and then a rank left with none takes one from the rank holding the most (the lowest such rank),
until every rank holds at least one. E = 4 at weights [2, 1] gives [3, 1]; E = 8 gives [5, 3].

Ranks holding the same experts (an expert-data-parallel group: ranks i, i + ep, i + 2 ep, ...)
must hold the same range, so the weight of EP position i is the sum of those ranks' weights.
"""

from __future__ import annotations

import math
from itertools import accumulate


def even_counts(num_experts: int, expert_parallel_size: int) -> list[int]:
    """The even layout: ``num_experts / expert_parallel_size`` experts on every EP rank."""
    if num_experts % expert_parallel_size:
        raise ValueError(f"model.moe.num_experts ({num_experts}) must be divisible by "
                         f"parallel.expert_parallel_size ({expert_parallel_size})")
    return [num_experts // expert_parallel_size] * expert_parallel_size


def weighted_counts(num_experts: int, weights: list[float]) -> list[int]:
    """Experts per EP rank in proportion to ``weights`` (the module's rounding rule), each >= 1."""
    n = len(weights)
    if num_experts < n:
        raise ValueError(f"model.moe.num_experts ({num_experts}) is smaller than parallel.expert_parallel_size "
                         f"({n}): every expert-parallel rank must hold at least one expert")
    if any(not (w > 0) or not math.isfinite(w) for w in weights):
        raise ValueError(f"expert weights must be finite and > 0, got {weights}")
    total = float(sum(weights))
    exact = [num_experts * w / total for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(n), key=lambda r: (-(exact[r] - counts[r]), r))
    for r in by_remainder[:num_experts - sum(counts)]:
        counts[r] += 1
    for r in range(n):
        if counts[r] == 0:
            donor = max(range(n), key=lambda d: (counts[d], -d))
            counts[donor] -= 1
            counts[r] = 1
    return counts


def ep_position_weights(rank_weights: list[float], expert_parallel_size: int) -> list[float]:
    """The weight of each EP position: the sum over the ranks that hold its experts (one per EP group)."""
    if len(rank_weights) % expert_parallel_size:
        raise ValueError(f"{len(rank_weights)} rank weights cannot be laid out in expert-parallel groups of "
                         f"{expert_parallel_size}")
    return [sum(rank_weights[i::expert_parallel_size]) for i in range(expert_parallel_size)]


def first_experts(counts: list[int]) -> list[int]:
    """The global id of each EP rank's first expert (the offsets table of a contiguous layout)."""
    return [0, *accumulate(counts)][:-1]


def describe_ranges(counts: list[int]) -> list[str]:
    """Each EP rank's experts as text: ``0-2`` (three experts) or ``3`` (one)."""
    return [f"{a}-{a + c - 1}" if c > 1 else f"{a}" for a, c in zip(first_experts(counts), counts)]
