"""fp32 host masters -> 16-bit device weights (``memory.offload=zero``): cast on the host, one copy.

After the host update each master is cast to the compute dtype on the host, into a pinned 16-bit
staging buffer, and that buffer is copied to the device in one transfer (half the bytes of
copying the fp32 master and casting on the device, and no fp32 copy of the weight on the device).

Two staging buffers of ``chunk_numel`` elements each, used in turn (double buffering): while the
copy stream moves chunk k to the device, the host casts chunk k + 1 into the other buffer. A
buffer is written again only once its last copy has completed (its event, queried first: the host
waits for the device only when it casts faster than the link moves). Tensors are packed into the
chunks back to back, a tensor larger than what is left in a chunk in pieces, so the pinned memory
is bounded (2 x ``chunk_numel`` x 2 bytes) whatever the model's size. Each push ends in its own
copy and the next push casts into the other buffer, so back-to-back pushes (the block copy-back's
segments, m6.memory.block_copy_back) overlap too; both buffers take the size of the largest push
so far, up to a chunk (a model under ``chunk_numel`` elements pins two buffers of its largest push).

On a CPU device (``copy_stream`` None) the same path runs synchronously: staging, then the copy.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

DEFAULT_CHUNK_NUMEL = 1 << 25  # 64 MiB of bf16 per staging buffer


class HalfWeightPush:
    """Copies fp32 host tensors into 16-bit device tensors through two pinned staging buffers."""

    def __init__(self, dtype: torch.dtype, device: torch.device, copy_stream: Optional[torch.cuda.Stream],
                 chunk_numel: int = DEFAULT_CHUNK_NUMEL) -> None:
        self.dtype, self.device, self.copy_stream = dtype, device, copy_stream
        self.chunk_numel = chunk_numel
        self._buffers: list[Optional[torch.Tensor]] = [None, None]
        self._copied: list[Optional[torch.cuda.Event]] = [None, None]
        self._current = 0
        self._size = 0  # elements of each buffer: the largest push so far, up to a chunk
        self._fill = 0  # elements of the current buffer written since its last copy
        self._pieces: list[tuple[torch.Tensor, int, int]] = []  # (flat device slice, offset in buffer, count)
        self.max_staged_numel = 0  # the largest staging buffer allocated (bytes: x the dtype's size)

    def push(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``dst.copy_(master)`` for each (dst: 16-bit, on the device; master: fp32, on the host);
        on CUDA asynchronous (the copy stream), ordered after the compute stream's queued work."""
        if not pairs:
            return
        if self.copy_stream is not None:
            # Kernels still queued may read these weights (the backward's): overwrite them after those.
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        total = sum(master.numel() for _, master in pairs)
        for dst, master in pairs:
            assert dst.dtype == self.dtype and dst.is_contiguous(), (dst.dtype, self.dtype)
            out, src = dst.view(-1), master.detach().reshape(-1)
            done = 0
            while done < src.numel():
                buffer = self._buffer(total)
                count = min(src.numel() - done, buffer.numel() - self._fill)
                # The cast runs on the host: the fp32 master never crosses the link.
                buffer[self._fill:self._fill + count].copy_(src[done:done + count])
                self._pieces.append((out[done:done + count], self._fill, count))
                self._fill += count
                done += count
                total -= count
                if self._fill == buffer.numel():
                    self._send()  # the rest is cast into the other buffer during this copy
        self._send()  # and the next push's too

    def reserve(self, numel: int) -> None:
        """Allocate both buffers for pushes of up to ``numel`` elements (a chunk at most) now, on
        the calling thread: the block copy-back's thread then never allocates pinned memory."""
        numel = min(max(numel, 1), self.chunk_numel)
        for index, buffer in enumerate(self._buffers):
            if buffer is None or buffer.numel() < numel:
                self._wait(index)
                self._buffers[index] = torch.empty(numel, dtype=self.dtype, pin_memory=self.copy_stream is not None)
        self._size = max(self._size, numel)
        self.max_staged_numel = max(self.max_staged_numel, numel)

    def _buffer(self, wanted: int) -> torch.Tensor:
        """The current staging buffer, ready to be written (its earlier copy completed); sized for
        ``wanted`` elements up to a chunk (a small model's pushes pin no more than they need)."""
        buffer = self._buffers[self._current]
        # ``wanted``: what is left of this push; an empty buffer smaller than it or than the other
        # buffer is replaced (both end at the largest push's size).
        numel = max(self._size, min(max(wanted, 1), self.chunk_numel))
        if buffer is None or (self._fill == 0 and buffer.numel() < numel):
            self._wait(self._current)
            buffer = torch.empty(numel, dtype=self.dtype, pin_memory=self.copy_stream is not None)
            self._buffers[self._current] = buffer
            self._size = numel
            self.max_staged_numel = max(self.max_staged_numel, numel)
        elif self._fill == 0:
            self._wait(self._current)
        return buffer

    def _wait(self, index: int) -> None:
        event, self._copied[index] = self._copied[index], None
        if event is not None and not event.query():
            event.synchronize()  # the copy still reads this pinned buffer: the host may not overwrite it

    def _send(self) -> None:
        """Copy the current buffer's pieces to the device; the next ones are cast into the other buffer."""
        if not self._pieces:
            return
        buffer = self._buffers[self._current]
        if self.copy_stream is not None:
            with torch.cuda.stream(self.copy_stream):
                for out, offset, count in self._pieces:
                    out.copy_(buffer[offset:offset + count], non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            self._copied[self._current] = event
        else:
            for out, offset, count in self._pieces:
                out.copy_(buffer[offset:offset + count])
        self._pieces = []
        self._fill = 0
        self._current = 1 - self._current

    def staging_bytes(self) -> int:
        """Host bytes the staging buffers hold now."""
        return sum(b.numel() * b.element_size() for b in self._buffers if b is not None)
