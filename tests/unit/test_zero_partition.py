"""The partitioned zero's dim-0 split (m6.memory.zero_partition) is torch.chunk's, FSDP2's rule,
so its checkpoints' row shards are parallel.shard=optimizer's: chunks of ceil(rows / n) rows, the
last ones shorter, and those past the end empty (first at ``rows``)."""

from __future__ import annotations

import torch
from torch import nn

from m6.memory.zero_partition import WeightGathers, chunk_of


def test_chunks_are_torch_chunk_order_with_empty_tails():
    for rows in range(1, 12):
        for size in range(1, 6):
            pieces = torch.arange(rows).chunk(size)
            covered = []
            for index in range(size):
                c = chunk_of(rows, size, index)
                assert c.chunk_rows == -(-rows // size)
                want = pieces[index].tolist() if index < len(pieces) else []
                assert list(range(c.first, c.first + c.count)) == want, (rows, size, index)
                assert c.local(torch.arange(rows)).tolist() == want
                covered += want
            assert covered == list(range(rows))


class _EveryParamSplit:
    def of(self, p):
        return object()


def test_gathers_are_issued_in_the_order_the_forward_waits_for_them():
    """A norm registered after the blocks is in segment 0, which the model's pre-hook waits for:
    its gather goes first, not after every block's (which would make the first wait a wait for all)."""
    model = nn.Module()
    model.embed = nn.Linear(2, 2)
    model.blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    model.final_norm = nn.LayerNorm(2)
    gathers = WeightGathers(model, list(model.blocks), _EveryParamSplit())
    names = {id(p): n for n, p in model.named_parameters()}
    assert [names[id(p)] for p in gathers.order] == [
        "embed.weight", "embed.bias", "final_norm.weight", "final_norm.bias",
        "blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "blocks.1.bias"]
    assert gathers.segment == [0, 0, 0, 0, 1, 1, 2, 2]
