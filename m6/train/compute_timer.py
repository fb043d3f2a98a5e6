"""The seconds each rank computes in a step's micro-batch loop (``compute_s/rank<r>``), measured
without a host sync of its own.

On the host the loop's wall time, taken before the gradient sync's wait for the other ranks. On
CUDA the loop only queues kernels, so two events bracket them; they are read once the step has
synchronized (``end_step``) and reported with the next step's scalars, none at a run's first step
(the same step on every rank, so every rank's list has the same length for the all-reduce).

    timer.start(); <micro-batches>; timer.stop()
    ... timer.rank_slots() rides on the step's scalar all-reduce ...
    timer.end_step()   # CUDA: wait for the step's kernels, read this step's events
"""

from __future__ import annotations

import time

import torch

from m6.train.balance import rank_slots


class ComputeTimer:
    """Times the micro-batch loop of each step on ``device``, for rank ``rank`` of ``world_size``."""

    def __init__(self, device: torch.device, rank: int, world_size: int) -> None:
        self.device, self.rank, self.world_size = device, rank, world_size
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._t0 = 0.0
        self._wall_s = 0.0  # this step's loop, on the host clock
        self._last_events_s: float | None = None  # CUDA: the previous step's, from its events

    def start(self) -> None:
        self._t0 = time.perf_counter()
        if self.device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()

    def stop(self) -> None:
        """After the last micro-batch's backward is queued, before the gradient sync waits."""
        self._wall_s = time.perf_counter() - self._t0
        if self._events is not None:
            self._events[1].record()

    def rank_slots(self) -> list[float]:
        """This rank's compute seconds in its slot of a per-rank list, summed over ranks with the
        step's scalars: this step's on the host; on CUDA the previous step's; [] on one process."""
        if self.device.type == "cpu":
            return rank_slots(self._wall_s, self.rank, self.world_size)
        if self._last_events_s is None:
            return []
        return rank_slots(self._last_events_s, self.rank, self.world_size)

    def end_step(self) -> None:
        """CUDA: wait for the step's kernels (the step's wall time is then the device's too) and
        read its events, complete by then: no wait of their own."""
        if self.device.type != "cuda":
            return
        torch.cuda.synchronize(self.device)
        if self._events is not None:
            self._last_events_s = self._events[0].elapsed_time(self._events[1]) / 1e3
