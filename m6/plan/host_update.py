"""The offloaded host update the planner times: the optimizer the run will choose (optim.name,
memory.host_optimizer, and whether DeepSpeed's cpu_adam op or m6's C++ Adafactor builds on this
host, decided as the trainer decides it) and that optimizer built over probe tensors."""

from __future__ import annotations

from typing import Callable

import torch

from m6.config import Config
from m6.memory.host_adafactor import build_host_adafactor, choose_host_adafactor, probe_adafactor_op
from m6.memory.host_optimizer import choose_host_optimizer, probe_cpu_adam

# (optim.name, resolved host optimizer) -> what runs the host update
HOST_UPDATE_NAMES = {("adamw", "torch"): "torch's foreach AdamW", ("adamw", "deepspeed"): "DeepSpeed's CPU Adam",
                     ("adafactor", "torch"): "torch's foreach Adafactor", ("adafactor", "cpp"): "m6's C++ Adafactor"}


def resolve_host_update(cfg: Config, log: Callable[[str], None]) -> str:
    """"torch", "deepspeed" or "cpp": what m6.train.update.agree_on_host_optimizer resolves
    ``memory.host_optimizer`` to for this config on this host (probing, and building, the op as
    the run would; a deepspeed that cannot build is the run's config error here too)."""
    choice, name = cfg.memory.host_optimizer, cfg.optim.name
    if choice == "torch":
        return "torch"
    if name == "adafactor":
        failure = probe_adafactor_op(log)
        return choose_host_adafactor(choice, {} if failure is None else {0: failure}, log)
    failure = probe_cpu_adam(log)
    return choose_host_optimizer(choice, {} if failure is None else {0: failure}, log)


def probe_optimizer(params: list[torch.Tensor], optimizer: str, host: str) -> torch.optim.Optimizer:
    """``optimizer`` ("adamw" or "adafactor") as ``host`` runs it, over fp32 host ``params``."""
    if optimizer == "adafactor":
        return build_host_adafactor([{"params": params}], 1e-3, host)
    if host == "deepspeed":
        from m6.memory.deepspeed_adam import DeepSpeedHostAdamW  # imports deepspeed (~2 s)
        return DeepSpeedHostAdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    assert host == "torch", host
    return torch.optim.AdamW(params, lr=1e-3, foreach=True)
