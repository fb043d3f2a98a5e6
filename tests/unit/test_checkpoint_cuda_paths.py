"""The CUDA branches of the checkpoint code, run on a CPU-only machine: the torch.cuda functions they
call are replaced by a recorder (``FakeCuda``) that keeps a current device per thread, as CUDA does
(a new thread starts on device 0), and a tensor may claim to live on ``cuda:3``
(``OnDevice``: CPU memory, so every copy really runs). The code under test is m6's, unchanged; so
is DCP's writer, whose CUDA stream calls the recorder sees.

What only a GPU can show, not run here: that no CUDA context appears on GPU 0 for the other ranks
of a node (nvidia-smi during a multi-GPU run), that the device -> host copies into the staging
buffer overlap as non-blocking DMA, and, through bench/gpu_suite.py running
tests/unit/test_checkpoint.py with --device cuda, that cudaHostRegister really page-locks the
buffer and a restored CUDA generator draws the same numbers as the saved one.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

from m6.checkpoint import CheckpointManager, read_checkpoint, sharded_io
from m6.checkpoint.rng import rng_state, set_rng_state
from m6.checkpoint.staging import StagingBuffer, aligned


ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


@dataclass(frozen=True)
class Call:
    thread: str
    device: int  # the calling thread's current device when it called
    name: str
    args: tuple


class FakeCuda:
    """Stands in for the torch.cuda functions m6 and DCP's writer call; records each call."""

    def __init__(self, device_count: int = 8) -> None:
        self.local = threading.local()
        self.lock = threading.Lock()
        self.calls: list[Call] = []
        self.num_devices = device_count
        self.registered: dict[int, int] = {}  # host pointer -> bytes page-locked
        self.generators = {d: torch.full((16,), d, dtype=torch.uint8) for d in range(device_count)}
        self.streams: dict[int, FakeStream] = {}

    def install(self, monkeypatch: pytest.MonkeyPatch) -> "FakeCuda":
        for name in ("is_available", "is_initialized", "device_count", "current_device", "set_device",
                     "current_stream", "stream", "synchronize", "get_rng_state", "get_rng_state_all",
                     "set_rng_state", "cudart"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        return self

    def current(self) -> int:
        return getattr(self.local, "device", 0)  # CUDA: a new host thread's current device is 0

    def record(self, name: str, *args) -> None:
        with self.lock:
            self.calls.append(Call(threading.current_thread().name, self.current(), name, args))

    def on_thread(self, thread: str) -> list[Call]:
        return [c for c in self.calls if c.thread == thread]

    def named(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]

    @staticmethod
    def index(device) -> int:
        if isinstance(device, str):
            device = torch.device(device)
        return device.index if isinstance(device, torch.device) else int(device)

    # ---- the torch.cuda functions
    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.num_devices

    def current_device(self) -> int:
        self.record("current_device")
        return self.current()

    def set_device(self, device) -> None:
        self.record("set_device", self.index(device))
        self.local.device = self.index(device)

    def current_stream(self, device=None) -> "FakeStream":
        self.record("current_stream")
        return self.streams.setdefault(self.current(), FakeStream(self, self.current()))

    @contextmanager
    def stream(self, stream):
        self.record("stream", stream.device)
        yield

    def synchronize(self, device=None) -> None:
        self.record("synchronize", None if device is None else self.index(device))

    def get_rng_state(self, device="cuda") -> torch.Tensor:
        d = self.current() if device == "cuda" else self.index(device)
        self.record("get_rng_state", d)
        return self.generators[d].clone()

    def get_rng_state_all(self) -> list[torch.Tensor]:
        self.record("get_rng_state_all")
        return [self.generators[d].clone() for d in range(self.num_devices)]

    def set_rng_state(self, state: torch.Tensor, device="cuda") -> None:
        d = self.current() if device == "cuda" else self.index(device)
        self.record("set_rng_state", d, state.clone())
        self.generators[d] = state.clone()

    def cudart(self) -> "FakeCuda":
        return self

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        self.record("cudaHostRegister", ptr, size)
        if any(ptr < p + n and p < ptr + size for p, n in self.registered.items()):
            return ALREADY_REGISTERED  # as CUDA: a range that overlaps a registered one
        self.registered[ptr] = size
        return 0

    def cudaGetErrorString(self, error: int) -> str:  # noqa: N802
        return {ALREADY_REGISTERED: "part or all of the requested memory range is already mapped"}.get(error, "?")

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.record("cudaHostUnregister", ptr)
        del self.registered[ptr]
        return 0


class FakeStream:
    def __init__(self, cuda: FakeCuda, device: int) -> None:
        self.cuda, self.device = cuda, device

    def synchronize(self) -> None:
        self.cuda.record("stream.synchronize", self.device)

    def wait_stream(self, other) -> None:
        self.cuda.record("stream.wait_stream", self.device)


class OnDevice(torch.Tensor):
    """A CPU tensor that says it lives on cuda:3: what staging reads to put it in the pinned part."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 3)

    @property
    def is_cuda(self) -> bool:
        return True


def on_device(t: torch.Tensor) -> OnDevice:
    return torch.Tensor._make_subclass(OnDevice, t)


def test_the_writer_thread_uses_the_ranks_device(tmp_path, monkeypatch):
    """Rank 3 of a node (its device set at start-up, as m6.parallel does): the background writer
    thread sets device 3 first, and no CUDA call of the save runs on another device. Before: the
    thread started on device 0 and DCP's writer asked for device 0's current stream (a CUDA
    context on GPU 0 for every rank of the node)."""
    cuda = FakeCuda().install(monkeypatch)
    torch.cuda.set_device(3)
    manager = CheckpointManager(tmp_path, keep=2)
    weights = torch.randn(64, 32)
    for step in (1, 2):
        manager.save(step, {"w": weights * step, "step": step}, asynchronous=True)
        manager.wait()
    assert all(c.device == 3 for c in cuda.calls if c.name != "set_device"), cuda.calls
    writer = cuda.on_thread("m6-checkpoint-writer")
    assert [c.args for c in writer if c.name == "set_device"] == [(3,), (3,)]  # one per save's thread
    loaded = manager.load()
    assert loaded["step"] == 2 and torch.equal(loaded["w"], weights * 2)
    assert manager.staging.allocations == 1  # the second save reused the first one's buffer


def test_async_staging_is_one_exact_buffer_reused_across_saves(tmp_path, monkeypatch):
    """Device tensors are staged into one page-locked buffer registered once (exact size, never the
    power-of-two caching host allocator), host tensors into a pageable one; the next save reuses
    both; release unpins. Before: every save allocated each tensor anew with pin_memory=True
    through torch's caching host allocator. (sharded_io.write directly: the manager refuses a
    tensor subclass such as OnDevice, which torch.load(weights_only=True) could not read back.)"""
    cuda = FakeCuda().install(monkeypatch)
    torch.cuda.set_device(3)
    pinned_allocations = []
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        if pin_memory:
            pinned_allocations.append(args)  # the caching host allocator (CPU build: no pinning)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    device_state = {"w_in": torch.randn(3, 5, 7), "w_out": torch.randn(33), "exp_avg": torch.randn(5, 5)}
    host_state = {"master": torch.randn(10, 3), "count": torch.tensor(4.0)}  # offloaded / AdamW's step

    def state(scale: float) -> dict:
        return {**{k: on_device(v * scale) for k, v in device_state.items()},
                **{k: v * scale for k, v in host_state.items()}, "step": int(scale)}

    staging = StagingBuffer()

    def save(step: int, state: dict) -> None:
        sharded_io.write(tmp_path / f"step{step}", state, {}, None, staging).commit()

    save(1, state(1.0))
    pinned, pageable = staging.pinned, staging.pageable
    assert pinned.numel() == sum(aligned(v.nbytes) for v in device_state.values())  # exact, 64-byte slots
    assert pageable.numel() == sum(aligned(v.nbytes) for v in host_state.values())
    assert cuda.registered == {pinned.data_ptr(): pinned.numel()}
    assert [c.args for c in cuda.named("synchronize")] == [(3,)]  # one wait, on the rank's device
    save(2, state(2.0))  # training changed the state since
    assert staging.allocations == 1 and staging.pinned is pinned and staging.pageable is pageable
    assert len(cuda.named("cudaHostRegister")) == 1
    assert pinned_allocations == []
    for step, scale in ((1, 1.0), (2, 2.0)):
        loaded = read_checkpoint(tmp_path / f"step{step}")
        assert loaded["step"] == step
        for k, v in {**device_state, **host_state}.items():
            assert torch.equal(loaded[k], v * scale), (step, k)

    # Each staged tensor owns exactly its bytes: DCP writes it without cloning a larger storage.
    staged = staging.stage(state(3.0))
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in staged.values() if torch.is_tensor(t))
    assert all(staged[k].untyped_storage().data_ptr() - pinned.data_ptr() in range(pinned.numel())
               for k in device_state)

    # Another set of tensors (a key more): a new buffer of the new size; the old one is unpinned.
    save(4, {**state(4.0), "extra": on_device(torch.ones(100))})
    assert staging.allocations == 2 and cuda.named("cudaHostUnregister")[0].args == (pinned.data_ptr(),)
    assert list(cuda.registered.values()) == [pinned.numel() + aligned(400)]
    assert torch.equal(read_checkpoint(tmp_path / "step4")["extra"], torch.ones(100))
    staging.release()
    assert cuda.registered == {} and staging.nbytes == 0


def test_cuda_rng_is_the_ranks_own_device_only(monkeypatch):
    """Rank 1 of a 2-GPU node saves only its own device's CUDA generator; resumed as the only rank
    of its node (its device now 0), that stream goes onto device 0 and nothing else is set. Before:
    every visible device's generator was saved, and the resume put device 0's (another rank's
    device, never this rank's stream) onto this rank's device."""
    two_per_node = FakeCuda(device_count=2).install(monkeypatch)
    torch.cuda.set_device(1)
    two_per_node.generators[1] = torch.arange(16, dtype=torch.uint8)  # this rank's stream after training
    saved = rng_state()

    one_per_node = FakeCuda(device_count=1).install(monkeypatch)
    torch.cuda.set_device(0)
    set_rng_state(saved)
    restored = one_per_node.named("set_rng_state")
    assert [c.args[0] for c in restored] == [0]
    assert torch.equal(restored[0].args[1], torch.arange(16, dtype=torch.uint8)), restored[0].args[1]
    assert [c.args for c in two_per_node.named("get_rng_state")] == [(1,)]
    assert two_per_node.named("get_rng_state_all") == []

    # The same layout again: device 1 gets its stream back, device 0 is left alone.
    same = FakeCuda(device_count=2).install(monkeypatch)
    torch.cuda.set_device(1)
    set_rng_state(saved)
    assert [c.args[0] for c in same.named("set_rng_state")] == [1]

    # A checkpoint of an older m6 (every device's generator, none marked as this rank's): restores none.
    older = {**saved, "cuda": [torch.zeros(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8)]}
    with pytest.warns(UserWarning, match="without naming this rank's own"):
        set_rng_state(older)
    assert [c.args[0] for c in same.named("set_rng_state")] == [1]


def test_a_staging_buffer_let_go_without_release_unregisters_its_memory(monkeypatch):
    """A Trainer dropped without closing drops its buffer: the registration ends with it. Before,
    the freed range stayed registered; on an H100 the next buffer placed there failed to register
    (cudaError 712) and pageable tensors placed there got asynchronous copies."""
    import gc

    gc.collect()  # earlier tests' buffers go now, not inside this test
    cuda = FakeCuda().install(monkeypatch)
    staging = StagingBuffer()
    staging.stage({"w": on_device(torch.randn(64, 64))})
    assert len(cuda.registered) == 1
    del staging
    gc.collect()
    assert cuda.registered == {}
    # release() unregisters once; the collection after it does not unregister again
    staging = StagingBuffer()
    staging.stage({"w": on_device(torch.randn(64, 64))})
    staging.release()
    del staging
    gc.collect()
    assert len(cuda.named("cudaHostUnregister")) == 2 and cuda.registered == {}


def test_a_buffer_unregisters_through_the_runtime_that_registered_it(monkeypatch):
    """A buffer collected while torch.cuda.cudart() answers with another runtime still unregisters
    where it registered. On an H100 a test's fake runtime took the unregistration of real buffers
    earlier tests had dropped: their ranges stayed registered and later host-to-device copies there
    failed ("invalid argument")."""
    import gc

    gc.collect()  # earlier tests' buffers go now, not inside this test
    first = FakeCuda().install(monkeypatch)
    staging = StagingBuffer()
    staging.stage({"w": on_device(torch.randn(64, 64))})
    second = FakeCuda().install(monkeypatch)
    del staging
    gc.collect()
    assert first.registered == {} and len(first.named("cudaHostUnregister")) == 1
    assert second.named("cudaHostUnregister") == []


def test_a_failed_registration_is_read_off_the_last_cuda_error(monkeypatch):
    """A failed cudaHostRegister stays this thread's last CUDA error, which torch raises at its next
    kernel launch (an unrelated reshape, on the H100): staging reads it at once and goes on with
    pageable memory; an error other than the registration's is not swallowed."""
    from m6.checkpoint import staging as staging_module

    cuda = FakeCuda().install(monkeypatch)
    read = []
    monkeypatch.setattr(staging_module, "read_last_error", lambda error: read.append(error))
    cuda.registered[0] = 2**62  # everything is "already mapped"
    buffer = StagingBuffer()
    with pytest.warns(UserWarning, match="cudaHostRegister of .* bytes failed \\(cudaError 712\\)"):
        staged = buffer.stage({"w": on_device(torch.ones(8))})
    assert read == [ALREADY_REGISTERED] and not buffer.registered and torch.equal(staged["w"], torch.ones(8))
    monkeypatch.undo()

    FakeCuda().install(monkeypatch)

    def launch_raising(message):
        def launch():
            raise RuntimeError(f"CUDA error: {message}")
        return launch

    staging_module.read_last_error(ALREADY_REGISTERED, launch_raising("part or all of the requested memory range is already mapped"))
    with pytest.raises(RuntimeError, match="an illegal memory access"):
        staging_module.read_last_error(ALREADY_REGISTERED, launch_raising("an illegal memory access was encountered"))
