"""Per-rank memory of a candidate layout: this rank's share of the model on ``meta``, sharded
by m6.parallel's own code, sized by m6.memory.estimate (the one memory model)."""

from __future__ import annotations

import dataclasses

import torch

from m6.config import Config
from m6.memory.estimate import MemoryReport, ModelFacts
from m6.memory.memory_report import estimate_memory
from m6.memory.zero_partition_estimate import partitioned, zero_partitioned_memory
from m6.model.host_drawn_init import HostDrawnInit
from m6.model.m6_model import M6Model
from m6.model.param_groups import no_decay_ids
from m6.parallel.layout import build_layout
from m6.parallel.plan import default_plan, keep_local_experts
from m6.plan.offload_layouts import ZERO, zero_memory


def rank_model(cfg: Config, world_size: int, expert_parallel_size: int, rank: int = 0,
               rank_weights: list[float] | None = None) -> M6Model:
    """The model ``rank`` holds at this layout, on ``meta`` (its experts only; nothing allocated);
    ``rank_weights``: parallel.balance's weights, which size each EP rank's experts."""
    # HostDrawnInit skips the random fills of meta tensors (they hold no values): through torch's
    # decompositions they took a third of a large search, which builds a model per layout.
    with torch.device("meta"), HostDrawnInit():
        model = M6Model(cfg.model)
    layout = build_layout(world_size, rank, expert_parallel_size, cfg.model.moe.num_experts, world_size,
                          rank_weights=rank_weights)
    keep_local_experts(default_plan(model), layout)
    return model


class RankMemory:
    """Memory of any candidate at one (world size, EP size): the rank model is built and walked once."""

    def __init__(self, cfg: Config, world_size: int, expert_parallel_size: int, device_type: str) -> None:
        self.world_size, self.expert_parallel_size, self.device_type = world_size, expert_parallel_size, device_type
        self.model = rank_model(cfg, world_size, expert_parallel_size)
        self.no_decay = no_decay_ids(self.model)
        self.facts = ModelFacts(self.model)

    def report(self, cfg: Config) -> MemoryReport:
        """m6.memory.estimate for ``cfg`` (its train/memory/optim/moe settings) at this layout;
        memory.offload=zero: the planner's model of ZeRO-Offload's layout (m6.plan.offload_layouts), with
        parallel.shard=optimizer its partitioned host states (m6.memory.zero_partition_estimate)."""
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel,
                                                                    expert_parallel_size=self.expert_parallel_size))
        if partitioned(cfg):
            return zero_partitioned_memory(cfg, self.model, self.facts, self.no_decay, self.world_size,
                                           self.expert_parallel_size, self.device_type)
        if cfg.memory.offload == ZERO:
            return zero_memory(cfg, self.model, self.facts, self.no_decay, self.world_size,
                               self.expert_parallel_size, self.device_type)
        return estimate_memory(cfg, self.model, self.no_decay, self.world_size, self.expert_parallel_size,
                               self.device_type, self.facts)
