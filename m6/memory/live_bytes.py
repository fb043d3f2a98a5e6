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
    """The data pointer of ``t``'s storage, None for a tensor without a valid one of its own (FSDP2
    frees an unsharded parameter's storage between uses; such a tensor holds no bytes)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of tensors created inside the mode that are still alive, and their peak.

    Only storages an op allocated (not its inputs' storages, so in-place updates count nothing);
    each is subtracted when Python frees it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._tracked: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            key = _storage_key(t) if torch.is_tensor(t) else None
            if key is None:
                continue
            storage = t.untyped_storage()
            if key in inputs or key in self._tracked or storage.nbytes() == 0:
                continue
            self._tracked.add(key)
            self.live += storage.nbytes()
            weakref.finalize(storage, self._free, key, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out
