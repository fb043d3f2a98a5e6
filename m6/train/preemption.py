"""Preemption and Ctrl-C: SIGTERM (a Slurm time limit, preemption or scancel, a cluster scheduler
draining a node, torchrun stopping its workers) or SIGINT (Ctrl-C; torchrun forwards it too) asks
the run to stop after the current step with a checkpoint, and exit 0.

The handler only records the signal; the loop asks ``requested()`` once per step, which agrees
across ranks (any rank signalled -> every rank stops at the same step), because the final save is
a collective that every rank must enter. Launchers signal whole process groups (torchrun each
worker's group, Slurm every process of the step, a terminal its foreground group), so the data
loader's worker processes receive the same signal: they ignore it (m6.data.loader), and the main
process owns the shutdown.

A second SIGINT while the run is stopping ends the process at once (exit 130, no checkpoint of
this step): the way out of a save that takes too long. A second SIGTERM changes nothing: a
launcher and a scheduler may both deliver one for the same stop.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_AT_ONCE = 128 + signal.SIGINT  # the shell's code for a process ended by Ctrl-C


class StopOnSignal:
    """Records SIGTERM and SIGINT while the run trains; ``close()`` restores the previous handlers."""

    def __init__(self, group=None, signals: tuple[int, ...] = STOP_SIGNALS) -> None:
        self.group = group  # a CPU (gloo) group: the flag is a host tensor
        self.received: Optional[int] = None
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():  # signal.signal works only there
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._record)

    def _record(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.received is not None:
            # os._exit: no finally block may wait on a save or a peer now; buffered lines first.
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, RuntimeError, ValueError):  # a reentrant flush (the handler interrupted a print), a closed pipe
                    pass
            os.write(2, b"SIGINT again: stopped at once, without a checkpoint of the current step\n")
            os._exit(EXIT_AT_ONCE)
        if self.received is None:
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
        """Leave the handlers installed for the rest of the process (``close`` becomes a no-op)."""
        self._previous.clear()

    def close(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
