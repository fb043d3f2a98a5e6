"""m6.parallel.tp_rng: split regions draw per-tp-rank masks without moving the default stream
apart (the replicated regions' masks stay one per tp group), and reproduce them from the same
default state (a recompute's)."""

from __future__ import annotations

import torch

from m6.parallel.tp_rng import split_region_rng

CPU = torch.device("cpu")


def _split_region(tp_rank: int, count: int) -> torch.Tensor:
    with split_region_rng(tp_rank, CPU):
        return torch.rand(count)


def test_ranks_draw_their_own_masks_and_the_default_stream_stays_in_step():
    outs, after = [], []
    for rank, count in ((0, 48), (1, 47)):  # sequence parallel: chunks of uneven length
        torch.manual_seed(3)
        outs.append(_split_region(rank, count))
        after.append(torch.rand(16))  # the next replicated region's draw
    assert not torch.equal(outs[0][:47], outs[1])  # each tp rank its own mask
    assert torch.equal(after[0], after[1])  # one mask per tp group where activations are replicated


def test_the_same_default_state_gives_the_same_mask():
    torch.manual_seed(5)
    state = torch.get_rng_state()
    first = _split_region(1, 32)
    torch.set_rng_state(state)  # what torch.utils.checkpoint restores before a recompute
    assert torch.equal(_split_region(1, 32), first)
    torch.manual_seed(5)
    plain = torch.rand(32)
    assert not torch.equal(first, plain)  # not the default stream's own draws
