"""memory.offload=zero with parallel.shard=optimizer: ZeRO-Offload's partitioned host states.

Each trainable parameter is split along dim 0 over its gradient group, the group m6's bucketed
gradient sync reduces it over: a replicated (dense) parameter over the data-parallel ranks
(``world``), an expert tensor over the ranks holding the same experts (``expert_data``). The split
is FSDP2's (torch.chunk order: chunks of ceil(rows / n) rows, the last ones shorter or empty), so
rank r of the group owns rows [r * c, min((r + 1) * c, rows)) and a checkpoint's row shards are
those of parallel.shard=optimizer without offload. A parameter whose group is this rank alone (every
parameter at world 1; the experts at expert-data-parallel size 1) is not split.

What rank r keeps of a split parameter: on the host the fp32 master and the optimizer state of its
chunk only (host bytes / n); on the device the whole 16-bit weight (ZeRO-2: weights resident), in
a storage padded to n * c rows so that chunk r is a contiguous slice and one all-gather into the
padded storage rebuilds the weight (``all_gather_into_tensor`` in place: the input is chunk r of
the output). The gradient buckets reduce-scatter (m6.parallel.grad_sync) and hand each rank its
reduced chunk, which leaves for the host.

The weights back: after the host update the rank copies its 16-bit chunks into its slice of each
padded storage (m6.memory.half_weight_push) and ``WeightGathers.issue`` all-gathers every split
parameter, in forward order (segment by segment), asynchronously, from the training thread (every rank
issues the same collectives in the same order; the forward issues its own, routing statistics on the
world group, so no collective ever starts from another thread). Each forward waits for the
gathers of its own weights only: the model's pre-hook for the weights outside the blocks, block
i's for block i's, so on NCCL block i's forward runs while block i + 1's gathers are in flight. On
gloo (CPU) the same calls run and complete in order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Chunk:
    """One split parameter's place on this rank: ``group`` of ``size`` ranks, this rank ``index``
    in it, ``rows`` global dim-0 rows cut in chunks of ``chunk_rows``, this rank's rows
    [``first``, ``first`` + ``count``) (``count`` may be 0 when rows < size * chunk_rows)."""

    group: object
    group_name: str
    size: int
    index: int
    rows: int
    chunk_rows: int
    first: int
    count: int

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``t`` (a view)."""
        return t[self.first:self.first + self.count]


def chunk_of(rows: int, size: int, index: int, group=None, group_name: str = "") -> Chunk:
    """torch.chunk's split of ``rows`` into ``size`` pieces, as FSDP2 shards dim 0: piece ``index``."""
    per = math.ceil(rows / size)
    first = min(index * per, rows)
    return Chunk(group, group_name, size, index, rows, per, first, min(per, rows - first))


class ZeroPartition:
    """Which parameters are split, over which group, and this rank's chunk of each."""

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], expert_ids: set[int], groups) -> None:
        """``named_params``: the trainable parameters; ``expert_ids``: ids of the expert tensors;
        ``groups``: m6.parallel's ProcessGroups (``data`` and ``expert_data``, as the sync uses)."""
        layout = groups.layout
        self.chunks: dict[int, Chunk] = {}  # id(param) -> its chunk (split params only)
        self.names: dict[int, str] = {}
        self.padded: dict[int, torch.Tensor] = {}  # id(param) -> its padded device storage (pad_resident)
        for name, p in named_params:
            if id(p) in expert_ids:
                group, group_name, size = groups.expert_data, "expert_data", layout.expert_data_parallel_size
            else:
                group, group_name, size = groups.data, "world", layout.data_parallel_size
            if size == 1:
                continue
            if p.dim() == 0:
                raise ValueError(f"memory.offload=zero with parallel.shard=optimizer splits parameters along dim 0; "
                                 f"{name} is a scalar")
            self.chunks[id(p)] = chunk_of(p.shape[0], size, dist.get_rank(group), group, group_name)
            self.names[id(p)] = name

    def of(self, p: nn.Parameter) -> Chunk | None:
        return self.chunks.get(id(p))

    def by_name(self) -> dict[str, Chunk]:
        """parameter name (its first, for a shared one) -> its chunk, for the checkpoint's row shards."""
        return {self.names[i]: c for i, c in self.chunks.items()}

    def host_rows(self, p: nn.Parameter, t: torch.Tensor) -> torch.Tensor:
        """The part of ``t`` (shaped like ``p``) that this rank's host keeps: its chunk, or all of it."""
        chunk = self.chunks.get(id(p))
        return t if chunk is None else chunk.local(t)

    def pad_resident(self, p: nn.Parameter) -> None:
        """Move ``p``'s device weight into a storage of size * chunk_rows rows (the padding rows
        zero), ``p.data`` its first ``rows`` rows, so the all-gather can write the storage whole."""
        chunk = self.chunks[id(p)]
        padded = torch.zeros((chunk.size * chunk.chunk_rows, *p.shape[1:]), dtype=p.dtype, device=p.device)
        padded[:chunk.rows].copy_(p.data)
        p.data = padded[:chunk.rows]
        self.padded[id(p)] = padded

    def device_rows(self, p: nn.Parameter) -> torch.Tensor:
        """This rank's rows of ``p``'s device weight, where its master's chunk is copied back."""
        return self.host_rows(p, p.data)

    def gather(self, p: nn.Parameter):
        """All-gather ``p``'s chunks into its padded storage (async); returns the work."""
        chunk, padded = self.chunks[id(p)], self.padded[id(p)]
        mine = padded[chunk.index * chunk.chunk_rows:(chunk.index + 1) * chunk.chunk_rows]
        return dist.all_gather_into_tensor(padded, mine, group=chunk.group, async_op=True)


class WeightGathers:
    """The all-gathers that rebuild the split 16-bit weights, issued at once in forward order,
    each forward waiting for its own: segment 0 (weights outside ``blocks``) before the model's
    forward, segment i + 1 before block i's."""

    def __init__(self, model: nn.Module, blocks: Sequence[nn.Module], partition: ZeroPartition) -> None:
        self.partition = partition
        segment_of: dict[int, int] = {}
        for i, block in enumerate(blocks):
            for p in block.parameters():
                segment_of.setdefault(id(p), i + 1)
        self.segment_of = segment_of  # id(param) -> its block's segment; absent: segment 0
        # Issued segment by segment (stable in parameter order: the same on every rank), so the gathers
        # complete in the order the forward waits for them: the model's pre-hook waits for segment 0
        # only (a final norm registered after the blocks must not put every block's gathers first).
        split = [p for p in model.parameters() if partition.of(p) is not None]
        self.order = sorted(split, key=lambda p: segment_of.get(id(p), 0))
        self.segment = [segment_of.get(id(p), 0) for p in self.order]
        self.works: list[list] = [[] for _ in range(len(blocks) + 1)]
        model.register_forward_pre_hook(lambda module, args: self.wait(0))
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda module, args, i=i: self.wait(i + 1))

    def issue(self) -> None:
        """All-gather every split weight (after this rank's chunks are on the device)."""
        self.settle()  # a round never overlaps the one before it
        for p, segment in zip(self.order, self.segment):
            self.works[segment].append(self.partition.gather(p))

    def by_segment(self, pairs: Sequence[tuple[nn.Parameter, torch.Tensor]]) -> list[list]:
        """``pairs`` (param, master) grouped by segment, in forward order: the copy back pushes one
        segment at a time, so its 16-bit staging is sized by the largest segment's chunks, not by
        the whole model's (as the unsplit zero's block copy-back)."""
        groups: list[list] = [[] for _ in self.works]
        for p, m in pairs:
            groups[self.segment_of.get(id(p), 0)].append((p, m))
        return [g for g in groups if g]

    def wait(self, segment: int) -> None:
        for work in self.works[segment]:
            work.wait()
        self.works[segment] = []

    def settle(self) -> None:
        """Every gather done: before the weights are read outside a forward (checkpoint, run end)."""
        for segment in range(len(self.works)):
            self.wait(segment)


def partition_line(partition: ZeroPartition, offload, layout) -> str:
    """The start-up line: what is split over which group, and the bytes this rank's host keeps for
    its masters and their AdamW moments (3 fp32 tensors per master) against an unsplit copy's."""
    mine = sum(m.numel() for m in offload.masters.values())
    whole = sum(p.numel() for p in offload.params)
    mib = lambda elements: f"{elements * 12 / 2**20:.1f} MiB"  # noqa: E731  fp32 master + exp_avg + exp_avg_sq
    groups = {c.group_name for c in partition.chunks.values()}
    words = []
    if "world" in groups:
        words.append(f"dense parameters over the {layout.data_parallel_size} data-parallel ranks")
    if "expert_data" in groups:
        words.append(f"experts over their {layout.expert_data_parallel_size} expert-data-parallel ranks")
    elif layout.expert_data_parallel_size == 1:
        words.append("experts whole on their one rank (expert-data-parallel size 1)")
    split = ", ".join(words) if partition.chunks else "nothing (every gradient group is this rank alone)"
    return (f"zero partitioned (parallel.shard=optimizer): split {split}; this rank's host keeps {mine / whole:.1%} "
            f"of the masters: {mib(mine)} of masters + AdamW moments (unsplit {mib(whole)})")
