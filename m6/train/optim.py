"""AdamW (torch's, or DeepSpeed's CPU Adam for the offloaded host update) or torch's Adafactor
(optim.name), with decay only on matrices, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from m6.config import OptimConfig
from m6.model.param_groups import no_decay_ids  # noqa: F401  (re-exported: the optimizer's groups)


def build_optimizer(model: nn.Module, cfg: OptimConfig,
                    master: Callable[[nn.Parameter], torch.Tensor] | None = None,
                    host_optimizer: str = "torch") -> torch.optim.Optimizer:
    """The optimizer of ``cfg.name`` over two parameter groups: weight-decayed matrices and everything else.

    ``master`` maps a model parameter to the tensor the optimizer updates instead (CPU offload's
    host copy); the groups and their order stay those of the model, so checkpoints keep one layout.
    AdamW's kernels by ``optim.implementation`` (OptimConfig.adamw_kernel: fused on CUDA, foreach elsewhere by
    default; foreach's temporaries are what ``optim.apply_groups`` bounds); or, for
    host masters with ``host_optimizer="deepspeed"``, DeepSpeed's CPU Adam (same hyper-parameters
    and state layout, m6.memory.deepspeed_adam). ``optim.name=adafactor``: torch.optim.Adafactor
    (foreach), on the device or on the host masters alike; lr and weight_decay as for AdamW.
    """
    skip = no_decay_ids(model)
    target = master if master is not None else (lambda p: p)
    decay = [target(p) for p in model.parameters() if p.requires_grad and id(p) not in skip]
    no_decay = [target(p) for p in model.parameters() if p.requires_grad and id(p) in skip]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    betas = (cfg.beta1, cfg.beta2)
    if cfg.name == "adafactor":
        assert host_optimizer == "torch", "DeepSpeed's CPU op is Adam only (config.py refuses the combination)"
        return torch.optim.Adafactor(groups, lr=cfg.lr, foreach=True)
    if host_optimizer == "deepspeed":
        assert all(t.device.type == "cpu" for t in decay + no_decay), "DeepSpeed's CPU Adam updates host tensors only"
        # Imported here: it imports deepspeed (~2 s), which runs without it do not pay.
        from m6.memory.deepspeed_adam import DeepSpeedHostAdamW
        return DeepSpeedHostAdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    assert host_optimizer == "torch", host_optimizer
    tensors = decay + no_decay
    if cfg.adamw_kernel(on_cuda=bool(tensors) and all(t.is_cuda for t in tensors)) == "fused":
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


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over lr_at, so its state (last_epoch) travels in checkpoints."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg, max_steps) / cfg.lr)
