"""The delayed parameter update (``optim.delayed_update``, ZeRO-Offload's DPU) of the offloaded host
update: the host optimizer's step of step t runs in a background thread while step t+1's
forward and backward run on the device.

    step t:    fwd/bwd on w[t-2] | finish: wait for update t-1, copy w[t-1] to the device,
               attach g[t] | clip, agree | launch update t: w[t] = U(w[t-1], g[t]) in the thread
    step t+1:  fwd/bwd on w[t-1]  (one step stale)  ... while the thread computes w[t]

What is stale: the gradient of step t+1 is taken at w[t-1], the weights from before step t's
update, and applied to w[t]. Everything else is step t's own: the clip norm and the non-finite /
fp16-overflow decision are computed (and all-reduced) before the launch, so every rank launches or
skips together, and the learning rate is step t's (the thread advances the schedule after its
optimizer step; the main thread reads the rate only after waiting).

Gradient buffers: step t+1's backward streams into a second set of host gradient buffers
(HostOffload.hand_over_grads): double buffering, one more gradient per trainable parameter on the
host (4 bytes fp32, 2 with memory.host_grad_dtype=compute; pinned when CUDA is present), allocated
at the first delayed step. 16-bit gradients go to the update with fp16's divisors (a second set of
host scalars for the next backward) and the clip's multiplier (HostOffload.background_step).

Threads: torch's CPU ops and DeepSpeed's CPU Adam release the GIL, so the update runs beside the
main thread's forward and backward (on a CPU device they share the cores). One worker thread is
kept for the run (its OpenMP team is made once).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from m6.memory.offload import HostOffload


class DelayedUpdate:
    """Runs the offloaded host update of one step in a background thread; ``wait`` joins it,
    ``catch_up`` (after the next step's backward) also copies its weights to the device. Steps up
    to ``after`` (counted from 1) are synchronous."""

    def __init__(self, offload: HostOffload, after: int) -> None:
        if after < 0:
            raise ValueError(f"optim.delayed_update_after must be >= 0, got {after}")
        self.offload, self.after = offload, after
        offload.defer_grads = True  # the masters' .grad may belong to the update in flight: attach at finish
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="m6-delayed-update")
        self._pending: Future | None = None
        self._pending_step = 0
        # The device weights are behind the masters (an update was launched, or a checkpoint's
        # next-step weights were loaded): the next ``catch_up`` copies the masters over.
        self.stale = False

    def is_delayed(self, step: int) -> bool:
        """Whether step ``step`` (counted from 1) updates in the background."""
        return step > self.after

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def launch(self, step: int, update: Callable[[], None]) -> None:
        """Run ``update`` (the optimizer step over the host masters and their attached gradients,
        then the schedule) in the background; the gradients' buffers go with it and the next
        backward streams into the other set."""
        assert self._pending is None, "an update is already in flight"
        pushed = self.offload.weights_pushed_event()
        read = self.offload.masters_read()

        def run() -> None:
            if pushed is not None:  # the last copy of the masters to the device reads them: let it finish
                pushed.synchronize()
            if read is not None:  # zero's block copy-back casts them on its thread: until it has
                read.result()
            with torch.no_grad():
                update()

        self.offload.hand_over_grads()
        self._pending, self._pending_step = self._worker.submit(run), step
        self.stale = True

    def wait(self) -> None:
        """Join the update in flight, re-raising its error; the masters' .grad it read are dropped.
        The device keeps its weights (the next step's forward uses them): a checkpoint save or the
        run's end waits here without changing the run."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        try:
            pending.result()
        except BaseException as e:
            raise RuntimeError(f"the delayed host update of step {self._pending_step} failed: "
                               f"{type(e).__name__}: {e}") from e
        self.offload.release_update_grads()

    def catch_up(self) -> None:
        """After a step's backward: wait for the update in flight and copy the masters it wrote to
        the device, for the next step's forward."""
        self.wait()
        if self.stale:
            self.offload.push_weights()
            self.stale = False
