"""Exact bytes of the tensors autograd keeps for backward, counted with saved-tensor hooks.

Every tensor an op saves for backward passes through ``pack``; we wrap it in a small holder whose
lifetime is the saved slot's, so at any moment the live holders are exactly what is still kept.
Bytes are counted per *storage* (device, address), once: a view saved by three ops, or a block
input saved by both its norm and the checkpoint wrapper, is one allocation. Parameters are not
activations and are left out, but low-precision copies of them (autocast's casts) are counted,
and reported on their own, because they are memory the forward created.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Hashable, Iterable, Optional

import torch
from torch.distributed.tensor import DTensor
from torch import nn

StorageKey = Hashable  # (device, data_ptr), or a caller-chosen key for short-lived storages

# Backward nodes of pure casts and views: a saved tensor reached from a parameter through only
# these is a copy (or a view of a copy) of that parameter, not a computed activation.
_CAST_OR_VIEW = {"ToCopyBackward0", "TBackward0", "ViewBackward0", "UnsafeViewBackward0", "PermuteBackward0",
                 "TransposeBackward0", "ExpandBackward0", "SliceBackward0", "SelectBackward0",
                 "UnsqueezeBackward0", "SqueezeBackward0", "AsStridedBackward0", "AliasBackward0",
                 "CloneBackward0", "ReshapeAliasBackward0", "_ReshapeAliasBackward0"}


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identity of the allocation behind ``t`` (a DTensor, e.g. a parameter sharded by
    parallel.shard: its local shard's)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    return (str(t.device), t.untyped_storage().data_ptr())


def is_parameter_cast(t: torch.Tensor) -> bool:
    """True when ``t`` is a cast of a parameter to another dtype (or a view of such a cast)."""
    node, crossed_cast = t.grad_fn, False
    for _ in range(8):
        if node is None:
            return False
        name = type(node).__name__
        if name == "AccumulateGrad":
            return crossed_cast and isinstance(node.variable, nn.Parameter)
        if name not in _CAST_OR_VIEW:
            return False
        crossed_cast |= name == "ToCopyBackward0"
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return False


class _Saved:
    """What autograd stores instead of the tensor; dies when the saved slot is released."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


@dataclass
class _Record:
    holder: weakref.ref
    key: StorageKey
    nbytes: int
    region: Optional[str]
    parameter_cast: bool


class SavedActivationMeter(torch.autograd.graph.saved_tensors_hooks):
    """``with SavedActivationMeter(model.parameters()) as m: loss = f(x)`` then ``m.held_bytes()``.

    ``region`` (set by the caller while a part of the model runs) labels what is saved meanwhile.
    ``shared_keys``: storages already known to an outer meter keep their real key, any other gets
    a key private to this meter (``private_prefix``), so storages freed and reallocated at the
    same address by successive short-lived measurements are not mistaken for one another.
    Only the innermost saved-tensor hooks see a tensor: inside torch.utils.checkpoint the
    checkpoint's own hooks take over, and this meter sees just the inputs the checkpoint keeps.
    """

    def __init__(self, parameters: Iterable[torch.Tensor], shared_keys: Optional[set] = None,
                 private_prefix: Optional[str] = None) -> None:
        self._param_keys = {storage_key(p) for p in parameters}
        self._shared, self._prefix = shared_keys, private_prefix
        self._records: list[_Record] = []
        # Live count per storage and their byte total, kept as slots die (weakref callbacks, which
        # may run on autograd's device threads): held_bytes() is O(1), cheap enough to ask often.
        self._lock = threading.Lock()
        self._refs: dict[StorageKey, int] = {}
        self._total = 0
        self.region: Optional[str] = None
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> "SavedActivationMeter":
        super().__enter__()
        return self

    def _key(self, t: torch.Tensor) -> StorageKey:
        key = storage_key(t)
        if self._shared is not None and key not in self._shared:
            return (self._prefix, *key)
        return key

    def _pack(self, t: torch.Tensor) -> _Saved:
        # Kept detached: an op that saves its own output hands us that output with its grad_fn,
        # and holding it would close a cycle through C++ (grad_fn -> saved slot -> holder ->
        # output -> grad_fn) that no gc can break, so a graph dropped without backward (the
        # recompute profile's forwards) would never be freed. Lossless: on unpack autograd
        # re-attaches the grad_fn it recorded when the tensor was saved.
        saved = _Saved(t.detach() if t.grad_fn is not None else t)
        key = storage_key(t)
        # By storage, and by object for weights whose storage changes (streamed by offload).
        is_param = key in self._param_keys or isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)
        if not is_param:
            low_precision_cast = t.is_floating_point() and t.element_size() < 4 and is_parameter_cast(t)
            key, nbytes = self._key(t), t.untyped_storage().nbytes()
            with self._lock:
                if key not in self._refs:
                    self._refs[key] = 0
                    self._total += nbytes
                self._refs[key] += 1
            holder = weakref.ref(saved, lambda _, key=key, nbytes=nbytes: self._release(key, nbytes))
            self._records.append(_Record(holder, key, nbytes, self.region, low_precision_cast))
        return saved

    def _release(self, key: StorageKey, nbytes: int) -> None:
        with self._lock:
            self._refs[key] -= 1
            if not self._refs[key]:
                del self._refs[key]
                self._total -= nbytes

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _live(self) -> list[_Record]:
        self._records = [r for r in self._records if r.holder() is not None]
        return self._records

    def held(self) -> dict[StorageKey, int]:
        """Storage key -> bytes of everything still kept for backward."""
        return {r.key: r.nbytes for r in self._live()}

    def held_by_region(self) -> dict[Optional[str], dict[StorageKey, int]]:
        """The same, grouped by the ``region`` that was set when each tensor was saved."""
        out: dict[Optional[str], dict[StorageKey, int]] = {}
        for r in self._live():
            out.setdefault(r.region, {})[r.key] = r.nbytes
        return out

    def held_bytes(self) -> int:
        """Bytes of all distinct storages still kept for backward."""
        return self._total

    def parameter_cast_bytes(self) -> int:
        """Bytes of low-precision parameter copies still kept for backward (autocast's weight casts)."""
        return sum({r.key: r.nbytes for r in self._live() if r.parameter_cast}.values())
