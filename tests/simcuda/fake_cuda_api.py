"""torch.cuda's Python API for simulated CUDA: one H100-like device, streams and events that only
record what the code asks of them (nothing runs asynchronously: the simulation cannot show a race),
and every call that makes the host wait for the device recorded as a host sync.

``simulated_cuda()`` installs it together with SimCudaMode for the duration of a ``with`` block.
"""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace
from typing import Iterator

import torch

from sim_tensor import PINNED, RECORD, SimCudaMode, SimTensor

# What a device reports; a scenario may change the capability (e.g. (12, 0) for a Blackwell
# workstation part, (8, 0) for an A100) to exercise code that branches on it.
DEVICE = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 * 2**30,
                         multi_processor_count=132)
_RNG_STATE_BYTES = 16  # CUDA's Philox state: seed and offset, 8 bytes each


class FakeStream(torch.Stream):
    """A CUDA stream that orders nothing (ops run when called); waits are accepted and do nothing."""

    _count = 0

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        FakeStream._count += 1
        return super().__new__(cls, stream_id=FakeStream._count, device_index=0, device_type=1)

    def __init__(self, device=None, priority: int = 0, **kwargs) -> None:
        self.number = FakeStream._count

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        event = event or FakeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        RECORD.sync("Stream.synchronize")

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"FakeStream({self.number})"


class FakeEvent:
    """A CUDA event: ``synchronize`` makes the host wait (a host sync); ``wait`` only orders streams."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.recorded = False

    def record(self, stream=None) -> None:
        self.recorded = True

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        RECORD.sync("Event.synchronize")

    def elapsed_time(self, end: "FakeEvent") -> float:
        RECORD.sync("Event.elapsed_time")
        return 0.0


_DEFAULT_STREAM = FakeStream()
_current = threading.local()


def _current_stream(device=None) -> FakeStream:
    return getattr(_current, "stream", _DEFAULT_STREAM)


@contextlib.contextmanager
def _stream(stream) -> Iterator[None]:
    previous = _current_stream()
    _current.stream = stream or previous
    try:
        yield
    finally:
        _current.stream = previous


def _synchronize(device=None) -> None:
    RECORD.sync("torch.cuda.synchronize")


def _get_rng_state(device=None) -> torch.Tensor:
    return torch.zeros(_RNG_STATE_BYTES, dtype=torch.uint8)


def _set_rng_state(new_state: torch.Tensor, device=None) -> None:
    # torch.cuda.set_rng_state takes a host ByteTensor (it copies it into the generator).
    if isinstance(new_state, SimTensor) or new_state.dtype != torch.uint8 or new_state.device.type != "cpu":
        RECORD.problem("DEVICE", f"torch.cuda.set_rng_state needs a host uint8 tensor, got {new_state.dtype} "
                                 f"on {new_state.device}")


def _set_rng_state_all(states) -> None:
    for s in states:
        _set_rng_state(s)


class FakeCudart:
    """The two runtime calls m6 makes directly (checkpoint staging page-locks its buffer once)."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        PINNED.register(ptr, size)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        return 0 if PINNED.unregister(ptr) else 1  # cudaErrorInvalidValue: never registered


_CUDART = FakeCudart()


def _capability(device=None) -> tuple[int, int]:
    return DEVICE.major, DEVICE.minor


_PATCHES = dict(
    is_available=lambda: True, is_initialized=lambda: True, init=lambda: None, device_count=lambda: 1,
    current_device=lambda: 0, set_device=lambda device: None, device=lambda device=None: contextlib.nullcontext(),
    get_device_capability=_capability, get_device_name=lambda device=None: DEVICE.name,
    get_device_properties=lambda device=None: DEVICE, is_bf16_supported=lambda *a, **k: True,
    synchronize=_synchronize, Stream=FakeStream, Event=FakeEvent, stream=_stream, current_stream=_current_stream,
    default_stream=lambda device=None: _DEFAULT_STREAM, set_stream=lambda stream: None,
    max_memory_allocated=lambda device=None: 0, memory_allocated=lambda device=None: 0,
    max_memory_reserved=lambda device=None: 0, memory_reserved=lambda device=None: 0,
    reset_peak_memory_stats=lambda device=None: None, memory_stats=lambda device=None: {},
    mem_get_info=lambda device=None: (DEVICE.total_memory, DEVICE.total_memory), empty_cache=lambda: None,
    get_rng_state=_get_rng_state, get_rng_state_all=lambda: [_get_rng_state()], set_rng_state=_set_rng_state,
    set_rng_state_all=_set_rng_state_all, manual_seed=lambda seed: None, manual_seed_all=lambda seed: None,
    seed=lambda: None, seed_all=lambda: None, initial_seed=lambda: 0,
    set_sync_debug_mode=lambda mode: None, get_sync_debug_mode=lambda: 0, cudart=lambda: _CUDART,
)
_ACCELERATOR_PATCHES = dict(synchronize=_synchronize)


@contextlib.contextmanager
def simulated_cuda() -> Iterator[None]:
    """torch.cuda faked and SimCudaMode active (this thread; other threads see SimTensors' own dispatch)."""
    saved = {name: getattr(torch.cuda, name, None) for name in _PATCHES}
    saved_acc = {name: getattr(torch.accelerator, name, None) for name in _ACCELERATOR_PATCHES}
    for name, value in _PATCHES.items():
        setattr(torch.cuda, name, value)
    for name, value in _ACCELERATOR_PATCHES.items():
        setattr(torch.accelerator, name, value)
    # module.to("cuda") must give new Parameters around SimTensors, not swap .data in place
    # (a SimTensor and a CPU tensor cannot share one TensorImpl).
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    lift = torch._C._only_lift_cpu_tensors()
    torch._C._set_only_lift_cpu_tensors(True)  # torch.tensor(..., device="cuda") builds on the host, then copies
    try:
        with SimCudaMode():
            yield
    finally:
        torch._C._set_only_lift_cpu_tensors(lift)
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
        for name, value in saved_acc.items():
            setattr(torch.accelerator, name, value)
