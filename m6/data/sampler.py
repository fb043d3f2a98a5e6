"""Seeded, resumable order over a map-style dataset: the position is part of a checkpoint."""

from __future__ import annotations

import torch


class ResumableSampler:
    """Yields indices epoch after epoch, each epoch a fresh permutation seeded by (seed, epoch).

    ``state_dict()`` / ``load_state_dict()`` capture (epoch, position) so a resumed run continues
    with exactly the indices an uninterrupted run would have drawn.
    """

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True) -> None:
        if num_samples <= 0:
            raise ValueError(f"dataset is empty (num_samples={num_samples})")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=g).tolist()

    def take(self, n: int) -> list[int]:
        """The next ``n`` indices, crossing epoch boundaries as needed."""
        out = []
        while len(out) < n:
            if self.position == self.num_samples:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            k = min(n - len(out), self.num_samples - self.position)
            out.extend(self._order[self.position:self.position + k])
            self.position += k
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "num_samples": self.num_samples, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["num_samples"] != self.num_samples:
            raise ValueError(f"checkpoint's data position is for {state['num_samples']} samples, "
                             f"this run has {self.num_samples} (data.num_samples changed?)")
        self.seed = state["seed"]
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)


class MixtureSampler:
    """A seeded, resumable stream of (source, record, epoch) over weighted sources.

    Each source keeps its own epochs (a fresh permutation each), so within a source's epoch every
    record comes exactly once. Which source serves the next position is deterministic and keeps the
    realised shares as close as possible to the weights: position p goes to the source furthest
    behind its share, argmax_s(w_s * (p + 1) - taken_s) (ties to the lower index).
    """

    def __init__(self, sizes: list[int], weights: list[float], seed: int) -> None:
        if len(sizes) != len(weights) or not sizes:
            raise ValueError(f"need one weight per source, got sizes {sizes} and weights {weights}")
        total = float(sum(weights))
        if not total > 0 or any(w < 0 for w in weights):
            raise ValueError(f"source weights must be >= 0 with a positive sum, got {weights}")
        self.shares = [w / total for w in weights]
        # Source 0 keeps the run seed, so a single source has the same order as ResumableSampler(seed).
        self.sources = [ResumableSampler(n, seed + 7919 * s) for s, n in enumerate(sizes)]
        self.taken = [0] * len(sizes)

    def take(self, n: int) -> list[tuple[int, int, int]]:
        """The next ``n`` (source, record, epoch) triples."""
        out = []
        for _ in range(n):
            p = sum(self.taken) + 1
            s = max(range(len(self.sources)), key=lambda i: (self.shares[i] * p - self.taken[i], -i))
            self.taken[s] += 1
            sampler = self.sources[s]
            record = sampler.take(1)[0]
            out.append((s, record, sampler.epoch))
        return out

    def state_dict(self) -> dict:
        return {"taken": list(self.taken), "sources": [s.state_dict() for s in self.sources]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["sources"]) != len(self.sources):
            raise ValueError(f"checkpoint's data position has {len(state['sources'])} sources, this run has "
                             f"{len(self.sources)} (data.sources changed?)")
        for sampler, s in zip(self.sources, state["sources"]):
            sampler.load_state_dict(s)
        self.taken = list(state["taken"])
