"""Peak live bytes of the tensors allocated inside a region, counted exactly on any device; the
bytes of the gradients parameters hold.

Used to measure the optimizer step's temporaries (group-wise apply) in tests and bench/memory.py,
and the device gradient bytes at the end of backward (the ``grad_mb`` metric).
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def grad_bytes(params) -> int:
    """Bytes of the live ``.grad`` tensors of ``params`` (each storage once): with offload, a
    parameter's ``.grad`` is its device gradient (the host sum hangs off its master instead)."""
    storages = {}
    for p in params:
        if p.grad is None:
            continue
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad  # FSDP2: this rank's shard
        storages[grad.untyped_storage().data_ptr()] = grad.untyped_storage().nbytes()
    return sum(storages.values())


def _storage_key(t: torch.Tensor):
    """The identity of ``t``'s storage (its StorageImpl, stable across ``resize_``), None for a
    tensor without a storage of its own (a DTensor wrapper: its local shard is a tensor of its own)."""
    try:
        return t.untyped_storage()._cdata
    except RuntimeError:
        return None


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of tensors created inside the mode that are still alive, and their peak.

    Only storages an op allocated (not its inputs' storages, so in-place updates count nothing);
    each is subtracted when Python frees it. Storages given bytes by ``UntypedStorage.resize_``
    inside the mode count too, from the resize on: FSDP2 gathers a parameter into its unsharded
    storage that way and frees it with ``resize_(0)``, and m6's parameter offload does the same
    with its device buffers; neither is an op the dispatch mode sees. A storage that held bytes
    before the mode and is resized inside it is left alone (its bytes belong to what was live at
    the start).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._counted: dict[int, int] = {}  # storage key -> bytes counted for it

    def _free(self, key: int) -> None:
        self.live -= self._counted.pop(key, 0)

    def _count(self, storage: torch.UntypedStorage, key: int, nbytes: int) -> None:
        self.live += nbytes - self._counted.get(key, 0)
        if key not in self._counted:
            weakref.finalize(storage, self._free, key)
        self._counted[key] = nbytes
        self.peak = max(self.peak, self.live)

    def include(self, storages) -> None:
        """Count ``storages`` (alive before the region) as live from its start: each one freed
        inside the region then lowers the count, so the peak is the region's true high-water mark
        rather than the bytes at its start plus its allocations' peak."""
        for storage in storages:
            key = storage._cdata
            if key not in self._counted and storage.nbytes():
                self._count(storage, key, storage.nbytes())

    def __enter__(self) -> "LiveBytes":
        self._resize = resize = torch.UntypedStorage.resize_
        counter = self

        def counted_resize(storage, size):
            key, before = storage._cdata, storage.nbytes()
            out = resize(storage, size)
            if key in counter._counted or before == 0:
                counter._count(storage, key, storage.nbytes())
            return out

        torch.UntypedStorage.resize_ = counted_resize
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            key = _storage_key(t) if torch.is_tensor(t) else None
            if key is None or key in inputs or key in self._counted:
                continue
            storage = t.untyped_storage()
            if storage.nbytes() == 0:
                continue
            self._count(storage, key, storage.nbytes())
        return out
