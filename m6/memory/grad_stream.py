"""Adding a device gradient into its fp32 host buffer: gradient streaming across micro-batches.

With ``memory.offload`` and accumulation, a gradient no other rank shares leaves the device at the
end of every micro-batch's backward; from the second micro-batch on it is added into the host
buffer that already holds the step's sum, so the device never keeps more than the gradients still
in flight. The host sum is the device's: fp32 ``((g1 + g2) + g3)`` in micro-batch order, as
autograd accumulates ``.grad`` (bitwise on CPU).

On CPU the add reads the gradient in place. On CUDA a host tensor cannot be added to from device
memory, so the gradient is copied (copy stream, asynchronous) into a pinned staging ring and the
host adds each staged piece into its buffer once that copy's event has completed: whenever an add
finds finished copies, when the ring needs the piece's room again (the one place the host waits
for the device inside backward, only once the ring is full), and at ``flush``. The ring bounds the
pinned memory (``capacity`` fp32 elements) whatever the parameters' sizes: a larger gradient goes
through it in pieces of at most a quarter of it.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple, Optional

import torch


class _Staged(NamedTuple):
    done: torch.cuda.Event
    start: int  # offset in the ring
    count: int
    out: torch.Tensor  # the host buffer's slice it adds into


class HostGradAccumulator:
    """Adds device gradients into host fp32 buffers; ``flush()`` before the host reads the sums."""

    def __init__(self, device: torch.device, copy_stream: Optional[torch.cuda.Stream],
                 capacity: int = 1 << 26) -> None:
        self.device = device
        self.copy_stream = copy_stream
        self.capacity = capacity  # fp32 elements of the pinned ring (256 MiB by default)
        self._ring: Optional[torch.Tensor] = None  # allocated at the first add on CUDA
        self._pending: deque[_Staged] = deque()  # in ring order: oldest first
        self._head = 0

    def add(self, grad: torch.Tensor, dst: torch.Tensor) -> None:
        """``dst += grad`` (``dst``: fp32 host buffer of ``grad``'s shape); on CUDA it lands by ``flush()``."""
        if self.copy_stream is None:
            dst.add_(grad.detach())
            return
        if self._ring is None:
            self._ring = torch.empty(self.capacity, dtype=torch.float32, pin_memory=True)
        src, out = grad.detach().reshape(-1), dst.view(-1)
        piece = max(1, self.capacity // 4)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        for offset in range(0, src.numel(), piece):
            count = min(piece, src.numel() - offset)
            while self._pending and self._pending[0].done.query():  # land what is done, without waiting
                self._land_oldest(wait=False)
            start = self._reserve(count)
            staged = self._ring[start:start + count]
            with torch.cuda.stream(self.copy_stream):
                staged.copy_(src[offset:offset + count], non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            self._pending.append(_Staged(done, start, count, out[offset:offset + count]))
        grad.record_stream(self.copy_stream)  # the allocator keeps the gradient until its copies are done

    def _reserve(self, count: int) -> int:
        """The ring offset of ``count`` free elements, landing the oldest pieces until there is room."""
        start = self._head if self._head + count <= self.capacity else 0
        while any(p.start < start + count and start < p.start + p.count for p in self._pending):
            self._land_oldest()
        self._head = start + count
        return start

    def _land_oldest(self, wait: bool = True) -> None:
        staged = self._pending.popleft()
        if wait:
            staged.done.synchronize()
        staged.out.add_(self._ring[staged.start:staged.start + staged.count])

    @property
    def pending(self) -> bool:
        """Whether some add has not landed yet."""
        return bool(self._pending)

    def flush(self, copies_done: bool = False) -> None:
        """Every add so far has landed in its host buffer (in the order they were made).
        ``copies_done``: the caller has waited for the copy stream, so no copy needs a wait."""
        while self._pending:
            self._land_oldest(wait=not copies_done)
