"""TensorSplit.pieces: where a tp rank's tensor (and, under parallel.shard, an FSDP2 row shard
of it) lies in the global tensor, the chunks a checkpoint writes."""

from __future__ import annotations

import torch

from m6.parallel.tensor_parallel import TensorSplit


def _assemble(split: TensorSplit, global_t: torch.Tensor, tp: int, dp: int) -> torch.Tensor:
    """Write every (tp rank, dp rank)'s rows into a blank global tensor through its pieces."""
    out = torch.full_like(global_t, float("nan"))
    for tp_rank in range(tp):
        parts, start = [], 0
        for size in split.sections:  # the tp rank's tensor: its share of every section, stacked
            share = size // tp
            parts.append(global_t.narrow(split.dim, start + tp_rank * share, share))
            start += size
        local = torch.cat(parts, dim=split.dim)
        rows = -(-local.shape[0] // dp)  # FSDP2's dim-0 shards: ceil, the last ones shorter or empty
        for dp_rank in range(dp):
            first = min(dp_rank * rows, local.shape[0])
            count = max(0, min(rows, local.shape[0] - first))
            held = local.narrow(0, first, count)
            for g, l_, n in split.pieces(local.shape, tp, tp_rank, (first, count)):
                target, source = out, held
                for dim in range(local.dim()):
                    target = target.narrow(dim, g[dim], n[dim])
                    source = source.narrow(dim, l_[dim], n[dim])
                assert torch.isnan(target).all(), "two pieces write the same element"
                target.copy_(source)
    return out


def test_fused_qkv_rows_cut_by_tp_and_fsdp_cover_the_global_tensor_once():
    # q 8 rows, k and v 4 each; tp 2 -> 8 local rows; dp 3 -> shards of 3, 3, 2 rows crossing sections.
    split = TensorSplit(0, (8, 4, 4))
    weight = torch.arange(16 * 5, dtype=torch.float32).view(16, 5)
    assert torch.equal(_assemble(split, weight, 2, 3), weight)
    bias = torch.arange(16, dtype=torch.float32)
    assert torch.equal(_assemble(split, bias, 2, 3), bias)


def test_row_parallel_columns_cut_by_fsdp_rows():
    split = TensorSplit(1, (8,))
    weight = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)
    assert torch.equal(_assemble(split, weight, 2, 4), weight)  # dp 4 over 6 rows: 2, 2, 2, 0


def test_unsharded_pieces_are_one_per_section():
    split = TensorSplit(0, (8, 4, 4))
    assert split.pieces(torch.Size([8, 5]), 2, 1) == [((4, 0), (0, 0), (4, 5)), ((10, 0), (4, 0), (2, 5)),
                                                       ((14, 0), (6, 0), (2, 5))]
