"""DeepSpeed's CPU Adam in AdamW mode, keeping torch AdamW's optimizer state, for the host update.

DeepSpeedCPUAdam (deepspeed.ops.adam) runs the update in C++ (SIMD, OpenMP threads: torch's
thread count, since the op shares torch's OpenMP runtime). Its ``step`` is replaced here for
checkpoints, the update math is the op's own:

- the step count is a float32 0-dim tensor, as in torch's AdamW, where DeepSpeed keeps a python
  int (which the checkpoint's tensor state would drop): the two state layouts are the same, so a
  checkpoint moves between ``memory.host_optimizer`` settings;
- the bias corrections depend on the step count only. The C++ optimizer multiplies beta^t up one
  factor per step while calls arrive in step order and takes ``pow`` otherwise, so a resumed run
  (a fresh C++ object) would compute beta^t by ``pow`` where the uninterrupted one had the running
  product, differing in the last bit. Recreating the C++ object (a few scalars) before each call
  puts every step on the ``pow`` path: a resumed run continues bitwise.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
from torch.distributed.tensor import DTensor

from m6.memory.cpu_info_once import install as install_cpu_info_once

install_cpu_info_once()  # DeepSpeedCPUAdam asks py-cpuinfo (~1 s) in every constructor


class DeepSpeedHostAdamW(DeepSpeedCPUAdam):
    """AdamW on host (CPU, fp32, contiguous) tensors through DeepSpeed's cpu_adam op.

    Hyper-parameters per param group as in torch.optim.AdamW (lr, betas, eps, weight_decay); an
    LR scheduler drives ``group["lr"]``; stepping with a group's ``params`` narrowed to a subset
    (m6.memory.grouped_apply) updates that subset only. A DTensor parameter (FSDP2's shards on the
    host, parallel.shard with CPU offload) keeps DTensor moments, as torch's AdamW would, and the op
    updates their local shards in place.
    """

    def __init__(self, params: Iterable, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=True)

    def _fresh_op_state(self, group: dict) -> None:
        """A new C++ optimizer under this one's id, its step counter at 0 (see the module docstring);
        the hyper-parameters given here are overridden by each update call."""
        beta1, beta2 = group["betas"]
        self.ds_opt_adam.destroy_adam(self.opt_id)
        self.ds_opt_adam.create_adam(self.opt_id, group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                                     True, False)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One AdamW update of every parameter (in the groups as they are now) that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                tensors = [_local(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                # The op updates contiguous CPU copies of non-contiguous tensors: the update would be lost.
                assert all(t.device.type == "cpu" and t.is_contiguous() for t in tensors), p.shape
                state["step"] += 1
                self._fresh_op_state(group)
                self.ds_opt_adam.adam_update(self.opt_id, int(state["step"].item()), group["lr"], beta1, beta2,
                                             group["eps"], group["weight_decay"], group["bias_correction"],
                                             *tensors)
        return loss


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view of its storage: updated in place), or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t
