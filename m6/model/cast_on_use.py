"""Cast-on-use mixed precision (train.precision=bf16): low-precision compute from fp32 master
weights, where the low-precision copy of a weight exists only while its op runs.

Why plain autocast does not give that: torch.autocast caches every weight's cast for the whole
forward (unless cache_enabled=False), and even uncached, the matmul's backward needs the weight,
so autograd saves the cast copy: one bf16 copy of every weight lives from its use in forward
until backward. The ops here save the fp32 weight itself (the parameter: no new memory) and cast
it again in backward. They run the same kernels on the same bf16 operands as autocast, so the
results are the same; the cost is one extra weight cast per use in backward.

Active only when the module's ``cast_on_use`` is set (``set_cast_on_use``) and an autocast region
is active; the autocast dtype is the compute dtype. Otherwise these are the plain torch ops.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def _compute_dtype(x: torch.Tensor, enabled: bool) -> Optional[torch.dtype]:
    """The autocast dtype when cast-on-use applies to this call, else None."""
    if not enabled or not torch.is_autocast_enabled(x.device.type):
        return None
    return torch.get_autocast_dtype(x.device.type)


class _CastOnUseLinear(torch.autograd.Function):
    """y = x @ w.T + b in ``dtype``; saves the low-precision x (as autocast does) and the fp32 w."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        with torch.autocast(x.device.type, enabled=False):
            x_c = x.to(dtype)
            y = F.linear(x_c, weight.to(dtype), None if bias is None else bias.to(dtype))
        ctx.save_for_backward(x_c, weight)
        ctx.dtype, ctx.x_dtype, ctx.bias_dtype = dtype, x.dtype, None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x_c, weight = ctx.saved_tensors
        dy_2d = dy.reshape(-1, dy.shape[-1])
        x_2d = x_c.reshape(-1, x_c.shape[-1])
        dx = dw = db = None
        # The formulas of aten::linear's backward (addmm / mm), on the same bf16 operands.
        if ctx.needs_input_grad[0]:
            dx = dy_2d.mm(weight.to(ctx.dtype)).view(x_c.shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = x_2d.t().mm(dy_2d).t().to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy_2d.sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None


class _CastOnUseConv2d(torch.autograd.Function):
    """conv2d in ``dtype`` that saves the low-precision input and the fp32 weight."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype, stride, padding, dilation, groups):
        with torch.autocast(x.device.type, enabled=False):
            x_c = x.to(dtype)
            y = F.conv2d(x_c, weight.to(dtype), None if bias is None else bias.to(dtype),
                         stride, padding, dilation, groups)
        ctx.save_for_backward(x_c, weight)
        ctx.dtype, ctx.x_dtype, ctx.bias_dtype = dtype, x.dtype, None if bias is None else bias.dtype
        ctx.conv = (stride, padding, dilation, groups)
        return y

    @staticmethod
    def backward(ctx, dy):
        x_c, weight = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.conv
        has_bias = ctx.bias_dtype is not None
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], has_bias and ctx.needs_input_grad[2]]
        dx, dw, db = torch.ops.aten.convolution_backward(
            dy, x_c, weight.to(ctx.dtype), [weight.shape[0]] if has_bias else None, stride, padding, dilation,
            False, [0, 0], groups, mask)
        return (None if dx is None else dx.to(ctx.x_dtype), None if dw is None else dw.to(weight.dtype),
                None if db is None else db.to(ctx.bias_dtype), None, None, None, None, None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           cast_on_use: bool = False) -> torch.Tensor:
    """F.linear ([..., in] -> [..., out]); cast-on-use under autocast when ``cast_on_use``."""
    dtype = _compute_dtype(x, cast_on_use)
    if dtype is None:
        return F.linear(x, weight, bias)
    return _CastOnUseLinear.apply(x, weight, bias, dtype)


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) with the cast-on-use switch."""

    cast_on_use: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.cast_on_use)


class Conv2d(nn.Conv2d):
    """nn.Conv2d (same parameters and names) with the cast-on-use switch; zero padding mode only."""

    cast_on_use: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(x, self.cast_on_use)
        if dtype is None:
            return super().forward(x)
        if self.padding_mode != "zeros" or isinstance(self.padding, str):
            raise ValueError(f"cast-on-use Conv2d needs padding_mode='zeros' and numeric padding, got "
                             f"{self.padding_mode!r}, {self.padding!r}")
        return _CastOnUseConv2d.apply(x, self.weight, self.bias, dtype, self.stride, self.padding,
                                      self.dilation, self.groups)


def set_cast_on_use(model: nn.Module, enabled: bool) -> int:
    """Turn cast-on-use on or off in every module of ``model`` that has the switch; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(getattr(type(module), "cast_on_use", None), bool):
            module.cast_on_use = enabled
            count += 1
    return count
