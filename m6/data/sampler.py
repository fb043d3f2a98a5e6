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
