"""The partitioned zero's dim-0 split (m6.memory.zero_partition) is torch.chunk's, FSDP2's rule,
so its checkpoints' row shards are parallel.shard=optimizer's: chunks of ceil(rows / n) rows, the
last ones shorter, and those past the end empty (first at ``rows``)."""

from __future__ import annotations

import torch

from m6.memory.zero_partition import chunk_of


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
