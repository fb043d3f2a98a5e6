"""AdamW over fp32 masters that also writes each master's compute-dtype (bf16) copy
(train.weight_copy=per_step), in one of two ways, chosen once and named in the banner:

- ``triton``: m6's kernel (m6.memory.triton_adamw_copy), one pass per tensor that reads the
  master, its gradient and both moments and writes the master, the moments and the bf16 copy: the
  copy costs one 2-byte store per element, no extra read of the master. Used on CUDA when Triton
  is importable; CPU tests run it under TRITON_INTERPRET=1.
- ``torch``: torch's AdamW (its fused or foreach kernels, optim.implementation) and then one
  multi-tensor copy (``torch._foreach_copy_``) of the updated masters into the copies: the plain
  reference of the same math, and the path everywhere else.

The kernel follows torch's foreach AdamW op by op in fp32 (decoupled decay, the first moment's
lerp as one FMA, the second moment's mul then addcmul as one FMA, sqrt / sqrt(1 - beta2^t) + eps,
addcdiv as (-step_size x m) / denom), with the same fp32 scalars computed the same way on the host:
both moments come out bitwise torch's CPU ones. Its sqrt and divisions are correctly rounded,
while torch's vectorised CPU sqrt is not (1 ulp off on ~20% of inputs here), so the masters agree
with torch's CPU AdamW to about one fp32 ulp, not bitwise; each copy is exactly its own master
rounded to bf16 (nearest, ties to even: torch's rounding). The optimizer state (step, exp_avg, exp_avg_sq) is torch's AdamW's, so
checkpoints are interchangeable with a torch AdamW's.
"""

from __future__ import annotations

from typing import Literal, Mapping

import torch

from m6.moe.fused_experts import triton_available

AdamWCopyKernel = Literal["triton", "torch"]


def choose_adamw_copy_kernel(device: torch.device, implementation: str,
                             compute_dtype: torch.dtype = torch.bfloat16) -> AdamWCopyKernel:
    """``triton`` for bf16 copies on CUDA with Triton importable and optim.implementation=auto;
    else ``torch`` (an explicit optim.implementation foreach or fused asks for torch's kernels;
    fp16 copies are written by the foreach copy)."""
    return "triton" if (device.type == "cuda" and implementation == "auto" and compute_dtype == torch.bfloat16
                        and triton_available()) else "torch"


class AdamWWithCopy(torch.optim.AdamW):
    """torch.optim.AdamW (same groups, state and state_dict) whose step also writes
    ``copies[id(master)]`` from each updated master; a master without an entry is updated only."""

    def __init__(self, params, copies: Mapping[int, torch.Tensor], kernel: AdamWCopyKernel, fused: bool = False,
                 **kwargs) -> None:
        if kernel == "triton":
            fused = False  # the kernel keeps torch's foreach state layout (the step count on the host)
        super().__init__(params, fused=fused, foreach=not fused, **kwargs)
        self.copies, self.kernel = copies, kernel

    def describe(self) -> str:
        """The banner's words for the update."""
        if self.kernel == "triton":
            return "update: m6's Triton AdamW writing the bf16 copy in the same pass"
        how = "fused" if self.defaults.get("fused") else "foreach"
        dtypes = sorted({str(c.dtype).removeprefix("torch.") for c in self.copies.values()}) or ["bf16"]
        return f"update: torch's AdamW ({how}), then one foreach copy to {'/'.join(dtypes)}"

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "AdamWWithCopy takes no closure"
        if self.kernel == "torch":
            super().step()
            pairs = [(self.copies[id(p)], p) for g in self.param_groups for p in g["params"]
                     if p.grad is not None and id(p) in self.copies]
            if pairs:
                copies, masters = zip(*pairs)
                torch._foreach_copy_(list(copies), list(masters))
            return None
        from m6.memory.triton_adamw_copy import adamw_copy_
        for group in self.param_groups:
            lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            assert not (group["amsgrad"] or group["maximize"]), "m6 builds AdamW without amsgrad and maximize"
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # as torch's AdamW initialises it (non-fused, non-capturable)
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                step_t = state["step"]
                if step_t.device.type != "cpu":  # loaded from a fused AdamW's state: moved once, read without syncs after
                    step_t = state["step"] = step_t.to("cpu", torch.float32)
                step_t += 1
                step = float(step_t)  # a host tensor: no device sync
                assert p.is_contiguous() and state["exp_avg"].is_contiguous(), "the kernel reads flat tensors"
                adamw_copy_(p, p.grad.contiguous(), state["exp_avg"], state["exp_avg_sq"], self.copies.get(id(p)),
                            decay=1 - lr * weight_decay, beta1=beta1, beta2=beta2, step_size=lr / (1 - beta1 ** step),
                            bc2_sqrt=(1 - beta2 ** step) ** 0.5, eps=eps)
        return None
