"""The rank- and worker-sharded, resumable training loader.

One seeded global stream of items (MixtureSampler) is cut into global batches; each data-parallel
rank takes its contiguous slice of every global batch and splits it into micro-batches; the
DataLoader hands micro-batches to its workers in turn. So over a source's epoch every record is
read exactly once, by exactly one (rank, worker), and the split never changes which samples the
job sees (a run on 1, 2 or 4 ranks trains on the same global batches).

Resuming: workers read ahead, so the position saved is the one *consumed* by the trainer, kept by a
second MixtureSampler advanced one global batch per step; a restored loader starts its stream there.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from m6.data.batch import MultimodalBatch, collate, encode_sample_text
from m6.data.sampler import MixtureSampler
from m6.data.sources import SkipExample


@dataclass
class LoadedBatch:
    """A collated micro-batch, its real (non-padding) token count, and the records skipped in it."""

    batch: MultimodalBatch
    real_tokens: int
    skips: list[SkipExample] = field(default_factory=list)
    origins: list[tuple[str, str]] = field(default_factory=list)  # (file, key) of each row's record

    def pin_memory(self) -> LoadedBatch:
        return LoadedBatch(self.batch.pin_memory(), self.real_tokens, self.skips, self.origins)


class BatchCollator:
    """DataLoader collate_fn: LoadedItems -> LoadedBatch, on the host (picklable for workers)."""

    def __init__(self, tokenizer, seq_len: int, image_shape: tuple[int, int, int], patches_per_image: int) -> None:
        self.tokenizer, self.seq_len, self.image_shape = tokenizer, seq_len, image_shape
        self.patches_per_image = patches_per_image

    def __call__(self, items: list) -> LoadedBatch:
        samples = [it.sample for it in items]
        skips = [it.skip for it in items if it.skip is not None]
        try:
            batch = collate(samples, self.tokenizer, self.seq_len, self.image_shape)
        except ValueError:
            # Rare path: find the samples whose source leaves no room for a target, count them as skipped.
            for i, sample in enumerate(samples):
                if sample is None:
                    continue
                try:
                    encode_sample_text(sample.source, sample.target, self.tokenizer, self.seq_len)
                except ValueError as e:
                    samples[i] = None
                    skips.append(SkipExample(items[i].origin[0], items[i].origin[1], "too_long", str(e)))
            batch = collate(samples, self.tokenizer, self.seq_len, self.image_shape)
        real = int((batch.segment_ids != 0).sum()) + int(batch.has_image.sum()) * self.patches_per_image
        return LoadedBatch(batch, real, skips, [it.origin for it in items])


class RankBatchSampler:
    """Yields this rank's micro-batches of items, global batch after global batch, without end."""

    def __init__(self, stream: MixtureSampler, global_batch: int, micro_batch: int, rank: int,
                 world_size: int) -> None:
        if global_batch % world_size or (global_batch // world_size) % micro_batch:
            raise ValueError(f"global batch {global_batch} does not split into {world_size} ranks x micro-batches "
                             f"of {micro_batch}")
        self.stream, self.global_batch, self.micro_batch = stream, global_batch, micro_batch
        self.rank, self.per_rank = rank, global_batch // world_size

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        while True:
            items = self.stream.take(self.global_batch)
            mine = items[self.rank * self.per_rank:(self.rank + 1) * self.per_rank]
            for i in range(0, self.per_rank, self.micro_batch):
                yield mine[i:i + self.micro_batch]


class TrainLoader:
    """Micro-batches for each optimizer step, the time spent waiting for them, and a resumable position."""

    def __init__(self, dataset, sizes: list[int], weights: list[float], seed: int, global_batch: int,
                 micro_batch: int, rank: int, world_size: int, collator: BatchCollator, num_workers: int = 0,
                 prefetch_factor: int = 2, pin_memory: bool = False) -> None:
        self.dataset, self.sizes, self.weights, self.seed = dataset, sizes, weights, seed
        self.global_batch, self.micro_batch, self.rank, self.world_size = global_batch, micro_batch, rank, world_size
        self.collator, self.num_workers, self.prefetch_factor = collator, num_workers, prefetch_factor
        self.pin_memory = pin_memory
        self.steps_per_global_batch = global_batch // world_size // micro_batch
        self.consumed = MixtureSampler(sizes, weights, seed)  # the position a checkpoint records
        self.skip_counts: Counter[str] = Counter()
        self._iterator = None
        self._loader = None

    def _start(self) -> None:
        stream = MixtureSampler(self.sizes, self.weights, self.seed)
        stream.load_state_dict(self.consumed.state_dict())
        sampler = RankBatchSampler(stream, self.global_batch, self.micro_batch, self.rank, self.world_size)
        extra = {"prefetch_factor": self.prefetch_factor, "persistent_workers": True} if self.num_workers else {}
        # Own generator: DataLoader draws worker base seeds from it, and drawing them from the global
        # RNG would shift the model's dropout masks by the point at which the loader (re)started.
        self._loader = torch.utils.data.DataLoader(self.dataset, batch_sampler=sampler, collate_fn=self.collator,
                                                   num_workers=self.num_workers, pin_memory=self.pin_memory,
                                                   generator=torch.Generator().manual_seed(self.seed), **extra)
        self._iterator = iter(self._loader)

    def next_step(self) -> tuple[list[LoadedBatch], float]:
        """This rank's micro-batches of the next global batch, and the seconds spent waiting for them."""
        if self._iterator is None:
            self._start()
        t0 = time.perf_counter()
        batches = [next(self._iterator) for _ in range(self.steps_per_global_batch)]
        wait = time.perf_counter() - t0
        self.consumed.take(self.global_batch)
        for b in batches:
            self.skip_counts.update(s.reason for s in b.skips)
        return batches, wait

    def state_dict(self) -> dict:
        return {"stream": self.consumed.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position (any world size: the stream is global)."""
        self.close()
        self.consumed.load_state_dict(state["stream"])

    def close(self) -> None:
        """Stop the workers; the next ``next_step`` starts new ones at the consumed position."""
        self._iterator = None
        self._loader = None
