"""AdamW (torch's, or DeepSpeed's CPU Adam for the offloaded host update) or torch's Adafactor
(optim.name), with decay only on matrices, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math
from typing import Callable, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from m6.config import OptimConfig
from m6.memory.adamw_copy import AdamWWithCopy
from m6.model.param_groups import no_decay_ids  # noqa: F401  (re-exported: the optimizer's groups)
from m6.parallel.sharded_adafactor import ShardedAdafactor


def build_optimizer(model: nn.Module, cfg: OptimConfig,
                    master: Callable[[nn.Parameter], torch.Tensor] | None = None,
                    host_optimizer: str = "torch", copies: Mapping[int, torch.Tensor] | None = None,
                    copy_kernel: str = "torch") -> torch.optim.Optimizer:
    """The optimizer of ``cfg.name`` over two parameter groups: weight-decayed matrices and everything else.

    ``master`` maps a model parameter to the tensor the optimizer updates instead (CPU offload's
    host copy); the groups and their order stay those of the model, so checkpoints keep one layout.
    AdamW's kernels by ``optim.implementation`` (OptimConfig.adamw_kernel: fused on CUDA, foreach elsewhere by
    default; foreach's temporaries are what ``optim.apply_groups`` bounds); or, for
    host masters with ``host_optimizer="deepspeed"``, DeepSpeed's CPU Adam (same hyper-parameters
    and state layout, m6.memory.deepspeed_adam). ``optim.name=adafactor``: torch.optim.Adafactor
    (foreach), on the device or on the host masters alike, or on FSDP2's shards (parallel.shard) its
    exact sharded form (m6.parallel.sharded_adafactor), or for host masters with
    ``host_optimizer="cpp"`` m6's C++ Adafactor (the same math and state,
    m6.memory.host_adafactor); lr and weight_decay as for AdamW.

    ``copies`` (train.weight_copy=per_step: id(master) -> its bf16 copy): AdamW writes them in its
    step (m6.memory.adamw_copy; ``copy_kernel`` "triton" or "torch").
    """
    skip = no_decay_ids(model)
    target = master if master is not None else (lambda p: p)
    decay = [target(p) for p in model.parameters() if p.requires_grad and id(p) not in skip]
    no_decay = [target(p) for p in model.parameters() if p.requires_grad and id(p) in skip]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    betas = (cfg.beta1, cfg.beta2)
    if cfg.name == "adafactor":
        assert host_optimizer in ("torch", "cpp"), "DeepSpeed's CPU op is Adam only (config.py refuses the combination)"
        if any(isinstance(t, DTensor) for t in decay + no_decay):  # parallel.shard: FSDP2's dim-0 shards
            return ShardedAdafactor(groups, lr=cfg.lr)
        if host_optimizer == "cpp":  # m6's C++ Adafactor on the host masters (m6.memory.host_adafactor)
            from m6.memory.host_adafactor import build_host_adafactor
            return build_host_adafactor(groups, cfg.lr, "cpp")
        return torch.optim.Adafactor(groups, lr=cfg.lr, foreach=True)
    if host_optimizer == "deepspeed":
        assert all(t.device.type == "cpu" for t in decay + no_decay), "DeepSpeed's CPU Adam updates host tensors only"
        # Imported here: it imports deepspeed (~2 s), which runs without it do not pay.
        from m6.memory.deepspeed_adam import DeepSpeedHostAdamW
        return DeepSpeedHostAdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    assert host_optimizer == "torch", host_optimizer
    tensors = decay + no_decay
    fused = cfg.adamw_kernel(on_cuda=bool(tensors) and all(t.is_cuda for t in tensors)) == "fused"
    if copies is not None:
        return AdamWWithCopy(groups, copies, copy_kernel, fused=fused, lr=cfg.lr, betas=betas, eps=cfg.eps)
    if fused:
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, fused=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, foreach=True)



def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Linear warmup from 0 to lr over warmup_steps, then cosine (or constant) down to min_lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


class ScheduledLR(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR whose restored state is its position (last_epoch): the learning rate of the next
    update is recomputed from this run's schedule, not taken from the checkpoint (LambdaLR's own
    load keeps the saved rate, and the optimizer's saved param_groups carry it, so a resume with
    another train.max_steps would make its first update at the saved run's rate). With the same
    schedule the recomputed rate is the saved one, bit for bit (the same expression)."""

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        rates = [base_lr * rate(self.last_epoch) for rate, base_lr in zip(self.lr_lambdas, self.base_lrs)]
        for group, rate in zip(self.optimizer.param_groups, rates):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(rate)
            else:
                group["lr"] = rate
        self._last_lr = rates  # what get_last_lr() reports


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int) -> ScheduledLR:
    """LambdaLR over lr_at, so its state (last_epoch) travels in checkpoints."""
    return ScheduledLR(optimizer, lambda step: lr_at(step, cfg, max_steps) / cfg.lr)


def schedule_change_note(cfg: OptimConfig, saved_max_steps: int | None, max_steps: int, step: int) -> str | None:
    """The line a resume prints when train.max_steps differs from the saved run's: the schedule is
    that of the new max_steps from the resumed step on (LambdaLR recomputes it), so a cosine decay
    is stretched or squeezed and the learning rate jumps at the resume. None when nothing changes
    (same max_steps, or a constant schedule, whose warmup does not depend on max_steps)."""
    if saved_max_steps is None or saved_max_steps == max_steps or cfg.schedule == "constant":
        return None
    before, after = lr_at(step, cfg, saved_max_steps), lr_at(step, cfg, max_steps)
    at_step = (f"the learning rate at step {step} is {after:.3g} where the saved run's schedule had {before:.3g}"
               if step >= cfg.warmup_steps else f"the warmup is unchanged (to step {cfg.warmup_steps})")
    return (f"train.max_steps changed from {saved_max_steps} (the checkpoint's run) to {max_steps}: the cosine "
            f"schedule is recomputed over {max_steps} steps ({'stretched' if max_steps > saved_max_steps else 'squeezed'}): "
            f"{at_step}, and it reaches optim.min_lr={cfg.min_lr:g} at step {max_steps}. To keep the saved "
            f"schedule, resume with train.max_steps={saved_max_steps}")
