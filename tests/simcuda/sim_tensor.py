"""Simulated CUDA on a CPU-only torch: SimTensor reports device cuda:0 and holds real CPU data.

Needs the preload library (fakecuda.cpp) in the process, so torch accepts cuda:0 tensors and
autograd runs their backward on a device thread. Every aten op that touches a SimTensor, or asks for
a cuda tensor, or moves data between host and device, runs twice:

1. on FakeTensors with the same devices, shapes, strides and dtypes, inside torch's FakeTensorMode.
   That is torch's own device propagation and meta kernels: a cpu/cuda mix raises there as it would
   on a GPU (a DEVICE finding), and so does a check that only the CUDA kernel makes, e.g. the grouped
   GEMM's bf16 requirement (a META finding). An op whose output size depends on the data raises there
   too: that is a host sync on a GPU (the device must finish before the host can size the output).
2. on the CPU data, for real; the outputs are wrapped on the devices the replay gave them.

Host syncs are recorded with their call site in the project (file, function, line): item / tolist /
float() of a device value, data-dependent output sizes (nonzero, boolean-mask indexing), copies a
GPU would make the host wait for (device-to-host unless asynchronous into pinned memory,
host-to-device unless asynchronous from pinned memory: a blocking copy synchronises the stream, and
CUDA stages pageable memory synchronously), torch.cuda.synchronize, Event/Stream.synchronize.
Findings are recorded, not raised, so one run reports all of them; ``Recorder.capture`` collects
what one scenario produced.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode, UnsupportedOperatorException)
from torch.utils._python_dispatch import TorchDispatchMode

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
aten = torch.ops.aten

REPO = str(Path(__file__).resolve().parents[2]) + os.sep
# Frames in these files are the harness's machinery, never a call site.
_MACHINERY = tuple(str(Path(__file__).resolve().parent / name) for name in
                   ("sim_tensor.py", "fake_cuda_api.py", "mirror_world.py", "run_phases.py", "sim_adaptations.py"))


# ---- call sites and findings -----------------------------------------------------------------
@dataclass(frozen=True)
class Site:
    """Where the project called what was found: the innermost project frame, and the chain above it."""

    key: str  # "m6/moe/dispatch.py:host_ints": file and function (stable across line edits)
    chain: str  # "m6/moe/dispatch.py:45 <- m6/moe/dispatch.py:221 <- m6/moe/layer.py:153"


def call_site(depth: int = 3) -> Site:
    """The project frames (files under the repository, harness machinery excluded) on this stack."""
    frames = []
    f = sys._getframe(1)
    while f is not None and len(frames) < depth:
        name = f.f_code.co_filename
        if name.startswith(REPO) and not name.startswith(_MACHINERY) and "/.venv/" not in name:
            frames.append((name[len(REPO):], f.f_code.co_name, f.f_lineno))
        f = f.f_back
    if not frames:
        return Site("<no project frame>", "<no project frame>")
    path, func, _ = frames[0]
    return Site(f"{path}:{func}", " <- ".join(f"{p}:{line}" for p, _, line in frames))


@dataclass
class Findings:
    """What simulated CUDA saw while a scenario ran."""

    problems: collections.Counter = field(default_factory=collections.Counter)  # (kind, detail, site) -> n
    syncs: collections.Counter = field(default_factory=collections.Counter)  # (what, site, phase) -> n
    unchecked_ops: collections.Counter = field(default_factory=collections.Counter)  # op -> n (no fake kernel)

    def to_json(self) -> dict:
        return {
            "problems": [{"kind": k, "detail": d, "site": s.key, "chain": s.chain, "count": n}
                         for (k, d, s), n in sorted(self.problems.items(), key=lambda kv: kv[0][2].key)],
            "syncs": [{"what": w, "site": s.key, "phase": phase, "chain": s.chain, "count": n}
                      for (w, s, phase), n in sorted(self.syncs.items(), key=lambda kv: (kv[0][1].key, kv[0][0]))],
            "unchecked_ops": dict(self.unchecked_ops),
        }


class Recorder:
    """Collects findings from every thread; ``capture()`` scopes them to one scenario."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current = Findings()
        self.phase: Callable[[], str] = lambda: "run"  # what the run is doing (run_phases.current)
        # Host buffers whose copies are logged (storage address -> name), and the log: (name,
        # "read device" | "write device" | "write host", the current stream's number or None).
        self.watched: dict[int, str] = {}
        self.copies: list[tuple[str, str, int | None]] = []

    def problem(self, kind: str, detail: str) -> None:
        site = call_site()
        with self._lock:
            self.current.problems[(kind, detail, site)] += 1

    def sync(self, what: str) -> None:
        site = call_site()
        thread = threading.current_thread()
        if thread is not threading.main_thread() and not thread.name.startswith("Dummy"):
            what = f"{what} [thread {thread.name}]"  # waits there do not stall the training loop
        phase = self.phase()
        with self._lock:
            self.current.syncs[(what, site, phase)] += 1

    def watched_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``: logged when either is a watched host buffer; a copy to or from the
        device with the stream it was issued on (one stream runs its copies in issue order)."""
        for t, other, role in ((src, dst, "read"), (dst, src, "write")):
            if on_device(t):
                continue
            name = self.watched.get((t.elem if isinstance(t, SimTensor) else t).untyped_storage().data_ptr())
            if name is None or (role == "read" and not on_device(other)):
                continue
            stream = getattr(torch.cuda.current_stream(), "number", None) if on_device(other) else None
            with self._lock:
                self.copies.append((name, f"{role} {'device' if on_device(other) else 'host'}", stream))

    def unchecked(self, func) -> None:
        with self._lock:
            self.current.unchecked_ops[str(func)] += 1

    @contextlib.contextmanager
    def capture(self) -> Iterator[Findings]:
        with self._lock:
            outer, self.current = self.current, Findings()
        found = self.current
        try:
            yield found
        finally:
            with self._lock:
                outer.problems.update(found.problems)
                outer.syncs.update(found.syncs)
                outer.unchecked_ops.update(found.unchecked_ops)
                self.current = outer


RECORD = Recorder()


# ---- pinned host memory ------------------------------------------------------------------------
class PinnedRegistry:
    """Host buffers allocated as pinned (by storage address, forgotten when the storage dies)."""

    def __init__(self) -> None:
        self._ptrs: set[int] = set()
        self._ranges: dict[int, int] = {}  # start -> size of host memory registered with cudaHostRegister
        self._lock = threading.Lock()

    def register(self, ptr: int, size: int) -> None:
        """cudaHostRegister: page-lock [ptr, ptr + size) of an existing host allocation."""
        with self._lock:
            self._ranges[ptr] = size

    def unregister(self, ptr: int) -> bool:
        with self._lock:
            return self._ranges.pop(ptr, None) is not None

    def add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        with self._lock:
            self._ptrs.add(ptr)
        # A storage freed and its address reused by an ordinary allocation must not look pinned.
        weakref.finalize(t, self._forget_if_last, ptr, storage._weak_ref())

    def _forget_if_last(self, ptr: int, weak_storage: int) -> None:
        if torch.UntypedStorage._expired(weak_storage):
            with self._lock:
                self._ptrs.discard(ptr)
        torch.UntypedStorage._free_weak_ref(weak_storage)

    def __contains__(self, t: torch.Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        with self._lock:
            return ptr in self._ptrs or any(start <= ptr < start + size for start, size in self._ranges.items())


PINNED = PinnedRegistry()


# ---- the tensor ------------------------------------------------------------------------------------
class SimTensor(torch.Tensor):
    """A tensor on cuda:0 whose data is the CPU tensor ``elem``.

    A SimTensor may also report ``cpu`` (``on_device`` False): a host tensor that must be able to
    become a device tensor in place, as a parameter does when CPU offload assigns ``p.data`` to a
    device buffer and back (a wrapper's storage cannot be swapped for a plain tensor's, so in a
    simulated run such a parameter is a host SimTensor, see ``host_parameters``).
    """

    elem: torch.Tensor
    on_device: bool
    __slots__ = ("elem", "on_device", "_fake_cache")

    @staticmethod
    def __new__(cls, elem: torch.Tensor, device: torch.device = CUDA) -> "SimTensor":
        assert type(elem) is torch.Tensor and elem.device.type == "cpu", (type(elem), elem.device)
        r = torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                layout=elem.layout, device=device, requires_grad=False)
        r.elem = elem
        r.on_device = device.type == "cuda"
        r._fake_cache = None
        return r

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"SimTensor({tuple(self.shape)}, {self.dtype}, {self.device})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    # Python-level readers of device memory that bypass the dispatcher:
    def tolist(self):
        if self.on_device:
            RECORD.sync("tolist")
        return self.elem.tolist()

    def numpy(self, *args, **kwargs):
        if not self.on_device:
            return self.elem.numpy(*args, **kwargs)
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                        "to host memory first.")

    def untyped_storage(self):
        return self.elem.untyped_storage()

    def data_ptr(self) -> int:
        return self.elem.data_ptr()

    @property
    def data(self):
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        # p.data = t: the wrapper takes t's metadata and device, and its elem takes t's data.
        if not isinstance(value, SimTensor):
            value = SimTensor(value, device=value.device)
        torch._C.TensorBase.data.__set__(self, value)
        self.elem, self.on_device, self._fake_cache = value.elem, value.on_device, None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs or {})


def on_device(x) -> bool:
    """Whether ``x`` is a (simulated) cuda tensor."""
    return isinstance(x, SimTensor) and x.on_device


def host_parameters(module: torch.nn.Module) -> None:
    """Replace ``module``'s host parameters by host SimTensors (same data, requires_grad, identity
    of nothing else yet): code that later points ``p.data`` at a device tensor then works as on a GPU."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None and not isinstance(p, SimTensor) and p.device.type == "cpu":
                sub._parameters[name] = torch.nn.Parameter(SimTensor(p.detach(), device=CPU),
                                                           requires_grad=p.requires_grad)


# ---- one op --------------------------------------------------------------------------------------
_local = threading.local()


def _fake_mode() -> FakeTensorMode:
    # One mode per thread: backward runs on autograd's device thread, checkpoints on a writer thread.
    mode = getattr(_local, "fake_mode", None)
    if mode is None:
        mode = _local.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    return mode


def _fake_of(t: torch.Tensor, device: torch.device, mode: FakeTensorMode) -> FakeTensor:
    """A FakeTensor with ``t``'s shape, strides, offset and dtype on ``device``."""
    if t.numel():
        extent = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
        meta = torch.empty(extent, dtype=t.dtype, device="meta").as_strided(t.shape, t.stride(), t.storage_offset())
    else:
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return FakeTensor(mode, meta, device)


def _fake_of_sim(s: SimTensor, mode: FakeTensorMode) -> FakeTensor:
    elem = s.elem
    meta = (mode, elem.shape, elem.stride(), elem.storage_offset(), elem.dtype)
    cached = s._fake_cache
    if cached is not None and cached[0] == meta:
        return cached[1]
    fake = _fake_of(elem, CUDA, mode)
    s._fake_cache = (meta, fake)
    return fake


def _map(fn: Callable, args):
    """fn applied to every tensor of aten-op arguments (tensors, lists/tuples of tensors, others)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(fn(a))
        elif isinstance(a, (list, tuple)):
            out.append(type(a)(fn(x) if isinstance(x, torch.Tensor) else x for x in a))
        else:
            out.append(a)
    return out


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor):
                    yield x


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


# Ops the replay skips: they read or mark memory rather than compute (answered below).
_NOT_REPLAYED = {aten._local_scalar_dense.default, aten.record_stream.default, aten.is_pinned.default,
                 aten._pin_memory.default, aten.set_.source_Storage_storage_offset, aten.set_.source_Storage}


_REPLAY_OK, _REPLAY_SYNC, _REPLAY_PROBLEM, _REPLAY_UNCHECKED = range(4)
# (op, input metadata, other arguments) -> what the replay gave: training repeats the same ops on
# the same shapes every step, and the fake tensors cost most of the simulation's time.
_replay_cache: dict = {}


def _signature(func, args, kwargs):
    """A hashable key of everything the replay depends on, or None when an argument is not hashable."""

    def meta(x):
        if isinstance(x, torch.Tensor):
            return (x.device.type, x.shape, x.stride(), x.storage_offset(), x.dtype)
        return x

    try:
        key = (func, tuple(_map(meta, args)), tuple(kwargs), tuple(_map(meta, kwargs.values())),
               torch.are_deterministic_algorithms_enabled())
        hash(key)
    except TypeError:
        return None
    return key


def _fake_replay(func, args, kwargs) -> tuple:
    """Step 1: the op on FakeTensors, as (outcome, detail): the output devices, or what went wrong."""
    mode = _fake_mode()

    def to_fake(x):
        if on_device(x):
            return _fake_of_sim(x, mode)
        return _fake_of(x.elem if isinstance(x, SimTensor) else x, CPU, mode)

    fargs = _map(to_fake, args)
    fkwargs = dict(zip(kwargs, _map(to_fake, kwargs.values())))
    fkwargs.pop("pin_memory", None)
    try:
        with mode:
            out = func(*fargs, **fkwargs)
    except (DynamicOutputShapeException, DataDependentOutputException):
        return _REPLAY_SYNC, f"{func} (output depends on device data)"
    except UnsupportedOperatorException:
        return _REPLAY_UNCHECKED, str(func)
    except Exception as e:  # noqa: BLE001: torch's device rules and meta checks raise many types
        message = str(e).strip().splitlines()[0][:240] if str(e).strip() else type(e).__name__
        return _REPLAY_PROBLEM, ("DEVICE" if "device" in message.lower() else "META", f"{func}: {message}")
    flat = list(out) if isinstance(out, (list, tuple)) else [out]
    return _REPLAY_OK, tuple(o.device.type == "cuda" if isinstance(o, torch.Tensor) else None for o in flat)


def _replay(func, args, kwargs) -> tuple | None:
    """The replay's output devices (True = cuda, per output), or None when it did not complete;
    records what it found."""
    key = _signature(func, args, kwargs)
    result = _replay_cache.get(key) if key is not None else None
    if result is None:
        result = _fake_replay(func, args, kwargs)
        if key is not None:
            _replay_cache[key] = result
    outcome, detail = result
    if outcome == _REPLAY_OK:
        return detail
    if outcome == _REPLAY_SYNC:
        RECORD.sync(detail)
    elif outcome == _REPLAY_UNCHECKED:
        RECORD.unchecked(detail)
    else:
        RECORD.problem(*detail)
    return None


def _note_copies(func, args, kwargs) -> None:
    """Host<->device copies that make the host wait on a GPU."""
    if func is aten._to_copy.default:
        src, dev = args[0], kwargs.get("device")
        if dev is None:
            return
        if _is_cuda(dev) and not on_device(src):
            if not kwargs.get("non_blocking"):
                RECORD.sync("host-to-device copy, blocking")
            elif src not in PINNED:
                RECORD.sync("host-to-device copy, non_blocking from pageable memory (CUDA stages it synchronously)")
        elif not _is_cuda(dev) and on_device(src) and not kwargs.get("non_blocking"):
            RECORD.sync("device-to-host copy, blocking")
    elif func is aten.copy_.default:
        dst, src = args[0], args[1]
        if RECORD.watched:
            RECORD.watched_copy(dst, src)
        non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
        if on_device(src) and not on_device(dst):
            if not non_blocking:
                RECORD.sync("device-to-host copy_, blocking")
            elif dst not in PINNED:
                RECORD.sync("device-to-host copy_, non_blocking into pageable memory (CUDA waits for it)")
        elif on_device(dst) and not on_device(src):
            if not non_blocking:
                RECORD.sync("host-to-device copy_, blocking")
            elif src not in PINNED:
                RECORD.sync("host-to-device copy_, non_blocking from pageable memory (CUDA stages it synchronously)")


def dispatch(func, args, kwargs):
    """One aten op under simulated CUDA (see the module docstring)."""
    sims = [t for t in _tensors(args, kwargs) if isinstance(t, SimTensor)]
    device_sims = any(s.on_device for s in sims)
    dev = kwargs.get("device")
    to_cuda = _is_cuda(dev)
    # ---- ops answered here ------------------------------------------------------------------
    if func is aten._local_scalar_dense.default and device_sims:
        RECORD.sync("item (a device value read on the host)")
    elif func is aten.record_stream.default:
        if not on_device(args[0]):
            RECORD.problem("DEVICE", "record_stream on a host tensor")
        return None
    elif func is aten.is_pinned.default:
        return not on_device(args[0]) and args[0] in PINNED
    elif func is aten._pin_memory.default:
        if on_device(args[0]):
            RECORD.problem("DEVICE", "pin_memory of a cuda tensor")
            return args[0]
        out = (args[0].elem if isinstance(args[0], SimTensor) else args[0]).clone()
        PINNED.add(out)
        return out
    # ---- 1. replay on fake tensors -------------------------------------------------------------
    devices = None
    if (device_sims or to_cuda) and func not in _NOT_REPLAYED:
        devices = _replay(func, args, kwargs)
    _note_copies(func, args, kwargs)
    # ---- 2. run on the data ----------------------------------------------------------------------
    run_kwargs = dict(kwargs)
    if to_cuda:
        run_kwargs["device"] = CPU
    pin = run_kwargs.pop("pin_memory", None)
    if pin and to_cuda:
        RECORD.problem("DEVICE", f"{func}: pin_memory=True for a cuda tensor")
    unwrap = lambda x: x.elem if isinstance(x, SimTensor) else x  # noqa: E731
    rargs = _map(unwrap, args)
    rkwargs = dict(zip(run_kwargs, _map(unwrap, run_kwargs.values())))
    out = func(*rargs, **rkwargs)
    # ---- 3. wrap the outputs on the devices the replay gave them ------------------------------------
    if func is aten._to_copy.default and device_sims and dev is not None and not to_cuda and kwargs.get("non_blocking"):
        PINNED.add(out)  # torch allocates the host side of an asynchronous device-to-host copy pinned
    elif pin and isinstance(out, torch.Tensor):
        PINNED.add(out)
    by_elem = {id(s.elem): s for s in sims}
    default_cuda = to_cuda or (device_sims and dev is None)
    # A host SimTensor's aliases stay host SimTensors (nn.Parameter(t) and t.data detach it).
    keep_host = not device_sims and func in (aten.detach.default, aten.alias.default)

    def wrap(o, cuda):
        if not isinstance(o, torch.Tensor):
            return o
        if id(o) in by_elem:  # in-place or out=: the same SimTensor object
            return by_elem[id(o)]
        if default_cuda if cuda is None else cuda:
            return SimTensor(o)
        return SimTensor(o, device=CPU) if keep_host else o

    if isinstance(out, (list, tuple)):
        per_output = devices if devices is not None and len(devices) == len(out) else [None] * len(out)
        return type(out)(wrap(o, c) for o, c in zip(out, per_output))
    return wrap(out, devices[0] if devices else None)


class SimCudaMode(TorchDispatchMode):
    """Sees the ops no SimTensor takes part in: factories asked for cuda, host-to-device copies, pinning."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in (aten.is_pinned.default, aten._pin_memory.default) or "pin_memory" in kwargs
                or _is_cuda(kwargs.get("device")) or any(isinstance(t, SimTensor) for t in _tensors(args, kwargs))):
            return dispatch(func, args, kwargs)
        if func is aten.copy_.default and RECORD.watched:  # a host copy into a watched buffer
            RECORD.watched_copy(args[0], args[1])
        return func(*args, **kwargs)
