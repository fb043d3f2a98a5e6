"""A checkpoint's state as a tree: nested dicts of string keys whose leaves are tensors or python
values, flattened to DCP's flat key space (``a/b/c``), and checked at save time for values that
``torch.load(weights_only=True)`` could not read back."""

from __future__ import annotations

import collections
from typing import Any

import torch


# Exactly the types torch.load(weights_only=True) rebuilds; checked at save time so a bad value fails
# the save that wrote it (naming its key) instead of the resume hours later.
_LEAF_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.Size, torch.dtype, torch.device)
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_CONTAINER_TYPES = (dict, collections.OrderedDict, list, tuple, set)


def _find_unloadable(obj: Any, path: str) -> str | None:
    """Return the key path and type of the first value weights_only loading would refuse, else None."""
    if type(obj) in _LEAF_TYPES or type(obj) in _TENSOR_TYPES:
        return None
    if type(obj) not in _CONTAINER_TYPES:
        return f"{path}: {type(obj).__module__}.{type(obj).__qualname__}"
    if isinstance(obj, dict):
        items = ((f"{path}[{k!r}]", v) for k, v in obj.items())
        keys = ((f"{path} key {k!r}", k) for k in obj)
        for sub_path, value in (*keys, *items):
            found = _find_unloadable(value, sub_path)
            if found:
                return found
        return None
    for i, value in enumerate(obj):
        found = _find_unloadable(value, f"{path}[{i}]")
        if found:
            return found
    return None


def check_loadable(state: dict) -> None:
    """Refuse, naming its key, a value that torch.load(weights_only=True) could not read back."""
    bad = _find_unloadable(state, "state")
    if bad:
        raise TypeError(
            f"cannot checkpoint {bad}: only tensors, python primitives, dicts, lists, tuples and sets "
            "are saved (so checkpoints load with torch.load(weights_only=True)); convert it first"
        )


SEP = "/"  # joins nested keys in the flat DCP key space (module names already use ".")


def flatten(state: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dicts with string keys -> one flat dict; anything else is a leaf."""
    flat = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and all(isinstance(k, str) and SEP not in k for k in value):
            flat.update(flatten(value, name + SEP))
        else:
            flat[name] = value
    return flat


def unflatten(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split(SEP)
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out
