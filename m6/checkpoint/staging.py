"""Host memory an asynchronous save copies the state into, so training can go on changing it while
a background thread writes the files: one buffer per rank, allocated at the first save, sized
exactly, reused by every later save (the manager finishes a save before the next one stages).

Tensors on a CUDA device go into a part of the buffer that is page-locked once with
``cudaHostRegister`` (the device -> host copies then run as DMA, non-blocking), the way torch's own
``StateDictStager`` pins its staging storages; not through ``pin_memory=True``, whose caching host
allocator rounds every request up to a power of two and never gives the memory back. Tensors
already in host memory (offloaded masters and moments, the optimizer's step counts, a CPU run) are
copied into a pageable part: the host optimizer updates them in place during the next step, which
would otherwise race the background write.

Each staged tensor is a view of exactly its own bytes (its storage is a slice of the buffer), so
DCP writes it as it is instead of cloning a view of a larger storage.

The registration ends with the buffer, also when its owner is dropped without closing (a Trainer
made and let go from Python): memory freed while still registered keeps its range registered in
CUDA, so the next buffer the host allocator places there fails to register ("already mapped",
seen on an H100 in one test process that made many Trainers), and any host tensor placed there is
page-locked without knowing it (its device copies turn asynchronous). That process also saw
weights off after a resume in two tests that pass alone; stale registrations would explain it, but
that was not shown.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

# Every staged tensor starts at a multiple of this many bytes (a cache line: any dtype's alignment,
# whole-line copies). m6.memory.estimate mirrors it (STAGING_ALIGN).
ALIGN = 64


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the staging alignment."""
    return -(-nbytes // ALIGN) * ALIGN


def _on_device(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


@dataclass(frozen=True)
class _Slot:
    pinned: bool  # in the page-locked part (the tensor lives on a CUDA device)
    offset: int  # bytes into its part
    shape: torch.Size
    dtype: torch.dtype


def _layout(state: dict[str, Any]) -> tuple[dict[str, _Slot], int, int]:
    """Where each tensor of ``state`` goes: (key -> slot, bytes of the pinned part, of the pageable part)."""
    slots, ends = {}, {True: 0, False: 0}
    for key, value in state.items():
        if not torch.is_tensor(value):
            continue
        pinned = _on_device(value)
        slots[key] = _Slot(pinned, ends[pinned], value.shape, value.dtype)
        ends[pinned] += aligned(value.numel() * value.element_size())
    return slots, ends[True], ends[False]


class StagingBuffer:
    """One rank's host copy of its checkpoint state for asynchronous saves (see the module docstring)."""

    def __init__(self) -> None:
        self.slots: Optional[dict[str, _Slot]] = None
        self.pinned: Optional[torch.Tensor] = None  # uint8, page-locked while registered
        self.pageable: Optional[torch.Tensor] = None
        self.registered = False
        self._unregister: Optional[weakref.finalize] = None  # ends the registration once, at release or collection
        self.allocations = 0  # times the buffer was (re)allocated: once per run unless the state's tensors change

    @property
    def nbytes(self) -> int:
        """Host bytes the buffer holds (both parts)."""
        return sum(t.numel() for t in (self.pinned, self.pageable) if t is not None)

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of the flat ``state`` that training may change under a background write: tensors
        copied into the buffer (one synchronisation with the device), python values deep-copied.
        Valid until the next ``stage`` or ``release``."""
        slots, pinned_bytes, pageable_bytes = _layout(state)
        if slots != self.slots:
            self._allocate(slots, pinned_bytes, pageable_bytes)
        staged, devices = {}, set()
        for key, value in state.items():
            if not torch.is_tensor(value):
                staged[key] = copy.deepcopy(value)
                continue
            slot = self.slots[key]
            out = self._view(slot)
            out.copy_(value.detach(), non_blocking=slot.pinned and self.registered)
            if slot.pinned:
                devices.add(value.device)
            staged[key] = out
        for device in devices:
            torch.cuda.synchronize(device)
        return staged

    def release(self) -> None:
        """Unpin and free the buffer (the manager's close, or before a re-allocation)."""
        if self.registered:
            _check(self._unregister(), "cudaHostUnregister")  # runs the finalizer now, once
            self.registered, self._unregister = False, None
        self.slots = self.pinned = self.pageable = None

    def _allocate(self, slots: dict[str, _Slot], pinned_bytes: int, pageable_bytes: int) -> None:
        self.release()
        # torch.empty on the CPU allocates exactly (64-byte aligned): no caching allocator rounds it.
        self.pinned = torch.empty(pinned_bytes, dtype=torch.uint8) if pinned_bytes else None
        self.pageable = torch.empty(pageable_bytes, dtype=torch.uint8) if pageable_bytes else None
        if self.pinned is not None:
            cudart = torch.cuda.cudart()
            error = int(cudart.cudaHostRegister(self.pinned.data_ptr(), pinned_bytes, 0))
            if error == 0:
                self.registered = True
                # Holds the tensor until it is unregistered: the memory is not freed while registered.
                # Unregistered through the runtime that registered it, whatever torch.cuda.cudart()
                # returns when the buffer is collected (on an H100, a buffer collected while a test
                # had replaced it was never unregistered, and later copies into its range failed).
                self._unregister = weakref.finalize(self, _unregister, cudart, self.pinned)
            else:  # the save still works from pageable memory, only its device copies are slower
                read_last_error(error)
                warnings.warn(f"checkpoint staging: cudaHostRegister of {pinned_bytes:,} bytes failed (cudaError "
                              f"{error}); staging device tensors through pageable host memory")
        self.slots = slots
        self.allocations += 1

    def _view(self, slot: _Slot) -> torch.Tensor:
        part = self.pinned if slot.pinned else self.pageable
        nbytes = slot.shape.numel() * slot.dtype.itemsize
        storage = part.untyped_storage()[slot.offset:slot.offset + nbytes]  # shares the buffer's memory
        return torch.empty(0, dtype=slot.dtype).set_(storage, 0, slot.shape)


def _unregister(cudart: Any, pinned: torch.Tensor) -> int:
    return int(cudart.cudaHostUnregister(pinned.data_ptr()))


def read_last_error(error: int, launch: Optional[Callable[[], object]] = None) -> None:
    """Clear a failed runtime call's ``error`` from this thread's last CUDA error. CUDA keeps it
    there, and torch reads the last error after every kernel it launches: left there, it fails the
    next, unrelated op (seen on an H100: a reshape in the model's forward raised cudaHostRegister's
    "already mapped"). One tiny launch (``launch``; default a one-element fill on the current
    device) reads it here; an error other than ``error`` is raised."""
    expected = torch.cuda.cudart().cudaGetErrorString(error)
    try:
        (launch or (lambda: torch.ones(1, device="cuda")))()
    except RuntimeError as e:
        if expected not in str(e):
            raise


def _check(error: Any, call: str) -> None:
    if int(error) != 0:
        raise RuntimeError(f"checkpoint staging: {call} failed with cudaError {int(error)}")
