"""The rank- and worker-sharded, resumable training loader.

One seeded global stream of items (MixtureSampler) is cut into global batches; each data-parallel
rank takes its contiguous slice of every global batch (equal, or by parallel.balance's shares,
m6.data.shares) and splits it into micro-batches; the
DataLoader hands micro-batches to its workers in turn. So over a source's epoch every record is
read exactly once, by exactly one (rank, worker), and the split never changes which samples the
job sees (a run on 1, 2 or 4 ranks trains on the same global batches).

Stop signals: launchers signal whole process groups (torchrun each worker's group, Slurm every
process of the job step, a terminal its foreground group on Ctrl-C), which holds the worker
processes too. The workers ignore SIGTERM and SIGINT: the main process decides when the run stops
(m6.train.preemption) and shuts them down; a worker killed by the signal would fail the run
("DataLoader worker ... is killed by signal") before its stop checkpoint.

Resuming: workers read ahead, so the position saved is the one *consumed* by the trainer, kept by a
second MixtureSampler advanced one global batch per step; a restored loader starts its stream there.
"""

from __future__ import annotations

import atexit
import signal
import time
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from m6.data.batch import MultimodalBatch, collate, encode_sample_text
from m6.data.sampler import MixtureSampler
from m6.data.shares import micro_batch_sizes
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
    """Yields this rank's micro-batches of items, global batch after global batch, without end:
    the contiguous run of ``shares[rank]`` items after the lower ranks' shares, cut into
    micro-batches of ``micro_sizes`` rows."""

    def __init__(self, stream: MixtureSampler, shares: list[int], micro_sizes: list[int], rank: int) -> None:
        assert sum(micro_sizes) == shares[rank], (shares, micro_sizes, rank)
        self.stream, self.global_batch, self.micro_sizes = stream, sum(shares), micro_sizes
        self.start = sum(shares[:rank])
        self.stop = self.start + shares[rank]

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        while True:
            mine = self.stream.take(self.global_batch)[self.start:self.stop]
            i = 0
            for size in self.micro_sizes:
                yield mine[i:i + size]
                i += size


def even_shares(global_batch: int, micro_batch: int, world_size: int) -> tuple[list[int], int]:
    """(samples per rank, micro-batches per rank) of an even split; an error if it does not divide."""
    if global_batch % world_size or (global_batch // world_size) % micro_batch:
        raise ValueError(f"global batch {global_batch} does not split into {world_size} ranks x micro-batches "
                         f"of {micro_batch}")
    per_rank = global_batch // world_size
    return [per_rank] * world_size, per_rank // micro_batch


WORKER_IGNORED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader worker_init_fn: the worker ignores SIGTERM and SIGINT (the main process owns the
    stop), then unblocks them (TrainLoader blocks them while it starts its workers, so that a signal
    arriving before this runs stays pending, and is dropped here, instead of killing the worker)."""
    for sig in WORKER_IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, WORKER_IGNORED_SIGNALS)


class TrainLoader:
    """Micro-batches for each optimizer step, the time spent waiting for them, and a resumable position.

    ``micro_batch``: rows per micro-batch of an even split; None when ``set_shares`` gives the split."""

    def __init__(self, dataset, sizes: list[int], weights: list[float], seed: int, global_batch: int,
                 micro_batch: int | None, rank: int, world_size: int, collator: BatchCollator, num_workers: int = 0,
                 prefetch_factor: int = 2, pin_memory: bool = False) -> None:
        self.dataset, self.sizes, self.weights, self.seed = dataset, sizes, weights, seed
        self.global_batch, self.micro_batch, self.rank, self.world_size = global_batch, micro_batch, rank, world_size
        self.collator, self.num_workers, self.prefetch_factor = collator, num_workers, prefetch_factor
        self.pin_memory = pin_memory
        self.shares: list[int] | None = None  # None: even, worked out at the first step (set_shares: uneven)
        self.num_micro = 0
        self.consumed = MixtureSampler(sizes, weights, seed)  # the position a checkpoint records
        self.skip_counts: Counter[str] = Counter()
        self._iterator = None
        self._loader = None

    def _start(self) -> None:
        if self.shares is None:
            self.shares, self.num_micro = even_shares(self.global_batch, self.micro_batch, self.world_size)
        stream = MixtureSampler(self.sizes, self.weights, self.seed)
        stream.load_state_dict(self.consumed.state_dict())
        sampler = RankBatchSampler(stream, self.shares, micro_batch_sizes(self.shares[self.rank], self.num_micro),
                                   self.rank)
        extra = {"prefetch_factor": self.prefetch_factor, "persistent_workers": True} if self.num_workers else {}
        # Own generator: DataLoader draws worker base seeds from it, and drawing them from the global
        # RNG would shift the model's dropout masks by the point at which the loader (re)started.
        if self.num_workers:
            extra["worker_init_fn"] = ignore_stop_signals
        self._loader = torch.utils.data.DataLoader(self.dataset, batch_sampler=sampler, collate_fn=self.collator,
                                                   num_workers=self.num_workers, pin_memory=self.pin_memory,
                                                   generator=torch.Generator().manual_seed(self.seed), **extra)
        # The workers start inside iter(): blocked here, a stop signal that arrives before a worker
        # has set it to ignored stays pending in that worker (the mask is inherited), and pending
        # in this thread until the unblock below delivers it to the run's handler.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_IGNORED_SIGNALS) if self.num_workers else None
        try:
            self._iterator = iter(self._loader)
        finally:
            if blocked is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if self.num_workers and not self._closes_at_exit:
            # At interpreter exit multiprocessing terminates its daemonic children and joins them;
            # the workers ignore that SIGTERM, so a process that trained without fit() (which
            # closes the loader) would wait on them for ever. This handler, registered after
            # multiprocessing's and torch's, runs before them and stops the workers as close() does.
            atexit.register(_close_at_exit, weakref.ref(self))
            self._closes_at_exit = True

    def next_step(self) -> tuple[list[LoadedBatch], float]:
        """This rank's micro-batches of the next global batch, and the seconds spent waiting for them."""
        if self._iterator is None:
            self._start()
        t0 = time.perf_counter()
        batches = [next(self._iterator) for _ in range(self.num_micro)]
        wait = time.perf_counter() - t0
        self.consumed.take(self.global_batch)
        for b in batches:
            self.skip_counts.update(s.reason for s in b.skips)
        return batches, wait

    def set_shares(self, shares: list[int], num_micro: int) -> None:
        """Split each global batch unevenly (parallel.balance): ``shares[r]`` samples to rank r,
        in ``num_micro`` micro-batches on every rank. Takes effect from the next step; the saved
        position stays global, so a checkpoint resumes under any split."""
        if sum(shares) != self.global_batch or len(shares) != self.world_size:
            raise ValueError(f"shares {shares} do not split a global batch of {self.global_batch} over "
                             f"{self.world_size} ranks")
        micro_batch_sizes(shares[self.rank], num_micro)  # each rank fills every micro-batch (else ValueError)
        self.close()
        self.shares, self.num_micro = list(shares), num_micro

    def sample_batch(self, rows: int) -> LoadedBatch:
        """The next ``rows`` items of the stream collated, without consuming them (a batch of the
        run's real shapes, for timing)."""
        stream = MixtureSampler(self.sizes, self.weights, self.seed)
        stream.load_state_dict(self.consumed.state_dict())
        return self.collator([self.dataset[item] for item in stream.take(rows)])

    def state_dict(self) -> dict:
        return {"stream": self.consumed.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position (any world size: the stream is global)."""
        self.close()
        self.consumed.load_state_dict(state["stream"])

    _closes_at_exit = False

    def close(self) -> None:
        """Stop the workers; the next ``next_step`` starts new ones at the consumed position."""
        iterator, self._iterator, self._loader = self._iterator, None, None
        workers = list(getattr(iterator, "_workers", ()))
        if not workers:
            return
        iterator._shutdown_workers()  # the workers' end-of-data message, a join, then terminate()
        if not iterator._shutdown:  # the interpreter is exiting: torch leaves the workers alone
            return
        for worker in workers:
            # terminate() sends SIGTERM, which the workers ignore: a worker that did not leave by
            # itself (pytorch/pytorch#39570) is killed, or the interpreter's exit would wait on it.
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=5)


def _close_at_exit(loader_ref: weakref.ref) -> None:
    loader = loader_ref()
    if loader is not None:
        loader.close()
