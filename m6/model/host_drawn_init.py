"""Random initialisation that does not depend on the device it fills.

torch draws ``normal_`` / ``uniform_`` from the generator of the tensor's device, and a CUDA
generator seeded alike draws other numbers than the CPU's. m6 places a model where it trains
(the device), or on the host when ``memory.offload=optimizer+params`` keeps the weights there, so
without this the same ``run.seed`` gave another model on a GPU than on a CPU, and another with
offload than without (seen on an H100: the first loss 5.60 vs 5.57). Under ``HostDrawnInit`` every
random fill of a tensor off the CPU is drawn on the host from the CPU generator, in the same order,
and copied in: the values are those a CPU run draws, bit for bit. (The experts draw from their own
CPU generators already: m6.moe.experts.)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

RANDOM_FILLS = {torch.Tensor.normal_, torch.Tensor.uniform_}


def _fills_in_place(func) -> bool:
    """A random fill: Tensor.normal_ / uniform_, or an in-place ``torch.nn.init`` function (a
    torch function mode sees ``nn.init.normal_`` itself, not the ``normal_`` it calls)."""
    return func in RANDOM_FILLS or (getattr(func, "__module__", None) == "torch.nn.init"
                                    and func.__name__.endswith("_"))


class HostDrawnInit(TorchFunctionMode):
    """Inside it, ``tensor.normal_`` / ``tensor.uniform_`` and the ``nn.init`` fills on a tensor that
    ``redirect`` picks (default: any tensor off the CPU) fill a host tensor of the same shape and
    dtype and copy it in. A ``meta`` tensor holds no values and draws nothing, unless ``draw_meta``:
    then a host tensor of its shape is drawn and dropped, so the generator advances as if it were
    filled (a pipeline stage's model, whose other stages' weights stay on meta)."""

    def __init__(self, redirect: Callable[[torch.Tensor], bool] = lambda t: t.device.type != "cpu",
                 draw_meta: bool = False) -> None:
        super().__init__()
        self.redirect = redirect
        self.draw_meta = draw_meta

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _fills_in_place(func):
            # nn.init passes its tensor by keyword (torch.overrides.handle_torch_function), Tensor methods by position.
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.device.type == "meta" and not self.draw_meta:
                return target  # holds no values: nothing to draw (the planner sizes giant models on meta)
            if isinstance(target, torch.Tensor) and (target.device.type == "meta" or self.redirect(target)):
                host = torch.empty(target.shape, dtype=target.dtype)
                with torch.no_grad():
                    if args:
                        func(host, *args[1:], **kwargs)
                    else:
                        func(**{**kwargs, "tensor": host})
                    if target.device.type != "meta":
                        target.copy_(host)
                return target
        return func(*args, **kwargs)
