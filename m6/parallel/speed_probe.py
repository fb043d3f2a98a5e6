"""The model ``parallel.balance: auto`` times at expert parallelism, before the real one is built.

auto sizes each rank's share of the batch AND, at expert parallelism, its range of experts from
the ranks' measured speeds, so the speeds must be known before the model is laid out. Each rank
times its compute alone: a model holding this rank's experts at the even layout, the all-to-all
looped back (m6.moe.loopback: the permutes, casts and expert GEMMs kept, the exchange skipped, as
if the rank received what it sends). Timed with the exchanges, a fast rank would wait for a slow
one inside every MoE layer and the two would measure the same speed.
"""

from __future__ import annotations

import torch

from m6.config import Config
from m6.model import M6Model
from m6.moe.loopback import LoopbackDispatcher
from m6.parallel.launch import DistEnv
from m6.parallel.layout import build_layout
from m6.parallel.plan import default_plan, keep_local_experts


def resolved_expert_parallel_size(cfg: Config, env: DistEnv) -> int:
    """parallel.expert_parallel_size at this job's world size (auto resolved as the layout does)."""
    return build_layout(env.world_size, env.rank, cfg.parallel.expert_parallel_size, cfg.model.moe.num_experts,
                        env.local_world_size).expert_parallel_size


def speed_probe_model(cfg: Config, env: DistEnv, expert_parallel_size: int, device: torch.device) -> M6Model:
    """This rank's experts at the even layout (initialised from the run's seed on ``device``), every
    MoE layer's exchange looped back; no process group is touched."""
    with torch.device("meta"):
        model = M6Model(cfg.model)
    layout = build_layout(env.world_size, env.rank, expert_parallel_size, cfg.model.moe.num_experts,
                          env.local_world_size)
    keep_local_experts(default_plan(model), layout)
    model.materialize(device, cfg.run.seed)
    wire = torch.bfloat16 if cfg.model.moe.a2a_dtype == "bf16" else None
    for layer in model.moe_layers().values():
        layer.dispatcher = LoopbackDispatcher(cfg.model.moe.num_experts, expert_parallel_size, wire)
    return model
