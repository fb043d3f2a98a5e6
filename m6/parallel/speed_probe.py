"""The model ``parallel.balance: auto`` times at expert parallelism, before the real one is built.

auto sizes each rank's share of the batch AND, at expert parallelism, its range of experts from
the ranks' measured speeds, so the speeds must be known before the model is laid out. Each rank
times its compute alone: a model holding this rank's experts at the even layout, the all-to-all
looped back (m6.moe.loopback: the permutes, casts and expert GEMMs kept, the exchange skipped, as
if the rank received what it sends). Timed with the exchanges, a fast rank would wait for a slow
one inside every MoE layer and the two would measure the same speed.

Under ``parallel.shard`` the probe is timed at any EP size, EP 1 included: the sharded model
all-gathers its parameters inside every forward and backward, so timed as it trains every rank
would measure the slowest one's speed. There the speeds size the batch shares only, never the
experts (they stay even): sharding refuses uneven experts, and whether a run starts must not hang
on a timing. The probe holds this rank's compute unsharded (its parameters and their gradients).
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


def times_a_probe(cfg: Config, expert_parallel_size: int) -> bool:
    """parallel.balance=auto times the probe (not the model it trains): at expert parallelism (the
    speeds lay out the experts, so they are needed before the model is built) and under
    parallel.shard (the sharded model's all-gathers tie every rank to the slowest)."""
    return cfg.parallel.balance == "auto" and (expert_parallel_size > 1 or cfg.parallel.shard != "none")


def speeds_size_experts(cfg: Config, expert_parallel_size: int) -> bool:
    """parallel.balance=auto lays the experts out from the measured speeds: at expert parallelism
    without parallel.shard. Decided by the config alone, so a layout never depends on a timing."""
    return cfg.parallel.balance == "auto" and expert_parallel_size > 1 and cfg.parallel.shard == "none"


def rank_layout_model(cfg: Config, env: DistEnv, expert_parallel_size: int,
                      rank_weights: list[float] | None = None) -> M6Model:
    """This rank's share of the model on ``meta``: every dense parameter and the experts this rank
    holds at the layout ``rank_weights`` gives (None: even). For sizing, e.g. the memory estimate."""
    with torch.device("meta"):
        model = M6Model(cfg.model)
    layout = build_layout(env.world_size, env.rank, expert_parallel_size, cfg.model.moe.num_experts,
                          env.local_world_size, rank_weights)
    keep_local_experts(default_plan(model), layout)
    return model


def speed_probe_model(cfg: Config, env: DistEnv, expert_parallel_size: int, device: torch.device) -> M6Model:
    """This rank's experts at the even layout (initialised from the run's seed on ``device``), every
    MoE layer's exchange looped back; no process group is touched."""
    model = rank_layout_model(cfg, env, expert_parallel_size)
    model.materialize(device, cfg.run.seed)
    wire = torch.bfloat16 if cfg.model.moe.a2a_dtype == "bf16" else None
    for layer in model.moe_layers().values():
        layer.dispatcher = LoopbackDispatcher(cfg.model.moe.num_experts, expert_parallel_size, wire)
    return model
