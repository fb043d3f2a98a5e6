"""How one global batch is split over data-parallel ranks of unequal speed (parallel.balance).

Each rank takes a contiguous run of whole samples of every global batch, as many as its weight
asks (largest remainder, at least one each). Every rank then runs the SAME number of micro-batches,
as many as the largest share needs at train.micro_batch_size rows: the MoE layers issue collectives
per micro-batch (the global routing statistics' all-reduce, the expert all-to-all), so the ranks
must meet the same number of times; a smaller share is cut into that many smaller micro-batches,
so a slow rank does less work in each of them.
"""

from __future__ import annotations

import math


def batch_shares(global_batch: int, weights: list[float]) -> list[int]:
    """Samples per rank, summing to ``global_batch``, proportional to ``weights`` (largest
    remainder; ties to the lower rank), each at least one."""
    n = len(weights)
    if not weights or any(not (w > 0) or not math.isfinite(w) for w in weights):
        raise ValueError(f"balance weights must be finite and > 0, got {weights}")
    if global_batch < n:
        raise ValueError(f"a global batch of {global_batch} cannot give each of {n} ranks a sample")
    total = float(sum(weights))
    # One sample to every rank first, the rest in proportion: no rank is ever left with none.
    rest = global_batch - n
    exact = [rest * w / total for w in weights]
    shares = [math.floor(x) for x in exact]
    by_remainder = sorted(range(n), key=lambda r: (-(exact[r] - shares[r]), r))
    for r in by_remainder[:rest - sum(shares)]:
        shares[r] += 1
    return [s + 1 for s in shares]


def num_micro_batches(shares: list[int], micro_batch: int | None) -> int:
    """Micro-batches every rank runs per step: enough for the largest share at ``micro_batch`` rows
    (None: one micro-batch each, the whole share)."""
    if micro_batch is None:
        return 1
    return max(math.ceil(s / micro_batch) for s in shares)


def micro_batch_sizes(share: int, num_micro: int) -> list[int]:
    """Rows of each of a rank's ``num_micro`` micro-batches: ``share`` split as evenly as possible
    (the first ones one row larger)."""
    if share < num_micro:
        raise ValueError(f"a share of {share} samples cannot fill {num_micro} micro-batches")
    base, extra = divmod(share, num_micro)
    return [base + 1] * extra + [base] * (num_micro - extra)
