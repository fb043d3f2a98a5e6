"""What the checkpoint code reads and writes, as protocols: the owner of the training loop (m6.train)
hands these in, so nothing here imports it."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from m6.checkpoint.sharded_io import Shards


class Stateful(Protocol):
    """A python piece of training state saved by value (``state_dict``) and restored in place."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> None: ...


class ModelTensors(Protocol):
    """A model's weights, layout-free: each expert tensor is this rank's rows of the global one."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """name -> tensor sharing the model's storage (a load writes straight into the weights)."""
        ...

    def global_shapes(self) -> dict[str, torch.Size]:
        """name -> shape over all ranks."""
        ...

    def shards(self, prefix: str) -> Shards:
        """``prefix + name`` -> (global shape, first row) of this rank's expert tensors."""
        ...

    def after_load(self) -> None:
        """Called once a load has written the weights (e.g. to refresh host copies)."""
        ...
