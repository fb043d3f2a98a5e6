"""Preemption: SIGTERM (a Slurm time limit or preemption, a cluster scheduler draining a node,
torchrun stopping its workers) asks the run to stop after the current step with a checkpoint.

The handler only records the signal; the loop asks ``requested()`` once per step, which agrees
across ranks (any rank signalled -> every rank stops at the same step), because the final save is
a collective that every rank must enter.
"""

from __future__ import annotations

import signal
import threading
from typing import Optional

import torch
import torch.distributed as dist


class StopOnSignal:
    """Records SIGTERM while the run trains; ``close()`` restores the previous handler."""

    def __init__(self, group=None, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.group = group  # a CPU (gloo) group: the flag is a host tensor
        self.received: Optional[int] = None
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():  # signal.signal works only there
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._record)

    def _record(self, signum: int, frame) -> None:
        self.received = signum

    def requested(self) -> bool:
        """True on every rank when any rank received a stop signal (one tiny all-reduce per call)."""
        flag = torch.tensor([0 if self.received is None else 1], dtype=torch.int32)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "a stop signal on another rank"

    def keep_holding(self) -> None:
        """Leave the handler installed for the rest of the process (``close`` becomes a no-op)."""
        self._previous.clear()

    def close(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
