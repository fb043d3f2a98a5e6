"""memory.offload=zero: the 16-bit weights' copy back overlapped with the next forward, block by block.

After the host update every master is cast to 16 bits into pinned staging and copied to its device
weight (m6.memory.half_weight_push). Here those copies run in the model's forward order, in
segments: the weights outside the transformer blocks first (embeddings, final norm, head: the
forward reads the embeddings first, and a head tied to them or read by the loss outside the
blocks stays safe), then block 0, block 1, ... Each segment ends with a CUDA event on the copy
stream, and a forward pre-hook (on the model for the first segment, on block i for block i's)
makes the compute stream wait for that segment's event only: block i's forward starts as soon as
its own weights have landed, while block i + 1's are still crossing the link, instead of the
whole forward waiting for the whole copy.

On CUDA the casts and the copies are issued by one copy-back thread (the host waits there for a
staging buffer, never in the training thread), which takes the copies in the order they are handed
over: with the synchronous update, each apply group's after it updates (the group after it updates
meanwhile); with the delayed update (m6.memory.delayed_update), all of them at once when the next
step's backward has finished, the update after it waiting until the thread has read the masters.
Every copy of a round is ordered after the compute stream's work queued when it was handed over
(the backward that still reads the old weights). A pre-hook waits on the host only until the
thread has issued its segment's copies (a threading.Event, not a device sync).

Weights read outside a forward (a checkpoint of the device weights, the run's end, a test) need
``settle``: the compute stream then waits for every copy of the round (HostOffload.settle_weights).

On a CPU device the copies run synchronously when handed over (no thread), segment by segment, so
every weight is in place before anything reads it and the losses equal a whole-model copy's bitwise.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Callable, Sequence

import torch
from torch import nn

Pair = tuple[nn.Parameter, torch.Tensor]  # (device weight, fp32 host master)


class BlockCopyBack:
    """Copies of the masters to the device weights, grouped in forward-order segments, each waited
    for by the forward of the module that reads it first.

    ``pairs``: every (param, master) copied to the device each round; ``push(pairs)``: issues the
    casts and copies of some of them (on the copy stream when CUDA, called under it).
    """

    def __init__(self, model: nn.Module, blocks: Sequence[nn.Module], pairs: Sequence[Pair],
                 push: Callable[[list[Pair]], None], device: torch.device,
                 copy_stream: torch.cuda.Stream | None,
                 reserve: Callable[[list[list[Pair]]], None] | None = None) -> None:
        """``reserve(segments)``: called with each segment's pairs before the first round, on the
        training thread (the staging buffers are allocated there, not on the copy-back thread)."""
        self.device, self.copy_stream, self._push = device, copy_stream, push
        self._reserve = reserve
        # Segment 0: weights outside the blocks; segment i + 1: block i's (a weight shared by
        # several blocks belongs to the first, whose forward reads it first).
        segment_of: dict[int, int] = {}
        for i, block in enumerate(blocks):
            for p in block.parameters():
                segment_of.setdefault(id(p), i + 1)
        self._segment_of = {id(p): segment_of.get(id(p), 0) for p, _ in pairs}
        self.num_segments = len(blocks) + 1
        self._segments: list[list[Pair]] = [[] for _ in range(self.num_segments)]
        for pair in pairs:
            self._segments[self._segment_of[id(pair[0])]].append(pair)
        self._sizes = [len(segment) for segment in self._segments]
        # Per round: params of each segment not handed over yet (training thread), not issued yet
        # (copy-back thread), whether its forward still has to wait, its event and readiness.
        self._unsubmitted = [0] * self.num_segments
        self._unissued = [0] * self.num_segments
        self._armed = [False] * self.num_segments
        self._events: list[torch.cuda.Event | None] = [None] * self.num_segments
        self._ready = [threading.Event() for _ in range(self.num_segments)]
        for ready in self._ready:
            ready.set()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._last_job: Future | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="m6-copy-back") \
            if copy_stream is not None else None
        self.segment_waits = 0  # forwards that waited for a segment (the first forward of each, per round)
        self._handles = [model.register_forward_pre_hook(self._wait_hook(0))]
        self._handles += [block.register_forward_pre_hook(self._wait_hook(i + 1))
                          for i, block in enumerate(blocks) if self._sizes[i + 1]]

    def segment(self, p: nn.Parameter) -> int:
        """The segment ``p``'s copy belongs to (0: outside the blocks; i + 1: block i)."""
        return self._segment_of[id(p)]

    def event(self, segment: int) -> torch.cuda.Event | None:
        """The copy stream's event after ``segment``'s copies of the latest round (None on CPU)."""
        return self._events[segment]

    # ---- a round: every pair handed over once --------------------------------------------------
    def begin(self) -> None:
        """Start a round (before the update writes the masters): the last round's copies are all
        issued and waited for, and every segment's forward waits for its new copy."""
        self.settle()
        if self._reserve is not None:
            reserve, self._reserve = self._reserve, None
            reserve(self._segments)
        for s in range(self.num_segments):
            self._unsubmitted[s] = self._unissued[s] = self._sizes[s]
            self._armed[s] = self._sizes[s] > 0
            self._events[s] = None
            if self._sizes[s]:
                self._ready[s].clear()

    def submit(self, pairs: Sequence[Pair]) -> None:
        """Hand ``pairs`` (masters updated in this round) over to be copied, in segment order."""
        if not pairs:
            return
        ordered = sorted(pairs, key=lambda pair: self._segment_of[id(pair[0])])  # stable: model order within
        runs: list[tuple[int, list[Pair]]] = []
        for pair in ordered:
            s = self._segment_of[id(pair[0])]
            if not runs or runs[-1][0] != s:
                runs.append((s, []))
            runs[-1][1].append(pair)
        for s, run in runs:
            self._unsubmitted[s] -= len(run)
            assert self._unsubmitted[s] >= 0, f"segment {s}: a weight handed over twice in one round"
        if self._worker is None:
            self._issue(None, runs)
            return
        after = torch.cuda.Event()
        after.record(torch.cuda.current_stream(self.device))  # the backward still reading the old weights
        self._last_job = self._worker.submit(self._issue, after, runs)

    def _issue(self, after: torch.cuda.Event | None, runs: list[tuple[int, list[Pair]]]) -> None:
        try:
            # This thread's current device is cuda:0 until set: the rank's own device and copy stream.
            on_device = torch.cuda.device(self.device) if self.copy_stream is not None else nullcontext()
            with on_device, torch.cuda.stream(self.copy_stream) if self.copy_stream is not None else nullcontext():
                if after is not None:
                    self.copy_stream.wait_event(after)
                for s, run in runs:
                    self._push(run)
                    with self._lock:
                        self._unissued[s] -= len(run)
                        complete = self._unissued[s] == 0
                    if complete:
                        if self.copy_stream is not None:
                            event = torch.cuda.Event()
                            event.record(self.copy_stream)
                            self._events[s] = event
                        self._ready[s].set()
        except BaseException as e:
            self._error = e
            for ready in self._ready:  # a forward waiting for a segment must not wait forever
                ready.set()
            raise

    def masters_read(self) -> Future | None:
        """The job that issues the last copies handed over (None: none in flight): once it is done
        every master of the round has been cast, and an update may change them."""
        return self._last_job

    # ---- the waits -----------------------------------------------------------------------------
    def _wait_for(self, s: int) -> None:
        if not self._armed[s]:
            return
        assert self._unsubmitted[s] == 0, f"segment {s} is read before all its weights were handed over"
        self._ready[s].wait()
        self._raise_error()
        event = self._events[s]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        self._armed[s] = False
        self.segment_waits += 1

    def _wait_hook(self, s: int):
        def hook(module, args):
            self._wait_for(s)
        return hook

    def settle(self) -> None:
        """Every copy handed over issued (the host waits for the copy-back thread) and the compute
        stream ordered after those its forwards have not waited for yet."""
        if self._last_job is not None:
            job, self._last_job = self._last_job, None
            try:
                job.result()
            except BaseException:
                pass  # raised below, with the thread's error named
        self._raise_error()
        for s in range(self.num_segments):
            if self._armed[s] and self._unsubmitted[s] == 0:
                self._wait_for(s)

    def _raise_error(self) -> None:
        if self._error is not None:
            e = self._error
            raise RuntimeError(f"the copy of the updated weights to the device failed: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        """Remove the hooks and stop the thread (after ``settle``)."""
        self.settle()
        for handle in self._handles:
            handle.remove()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
