"""The per-process memory report of a config on a model: the layout's own estimate.
m6.memory.estimate sizes the unsharded, sharded (FSDP2) and zero layouts; the partitioned zero
(m6.memory.zero_partition_estimate) builds on zero's report, so the choice between them sits here,
above both, instead of the base module importing its own extension."""

from __future__ import annotations

from typing import Optional

from torch import nn

from m6.config import Config
from m6.memory.estimate import MemoryReport, ModelFacts, layout_memory
from m6.memory.zero_partition_estimate import partitioned, zero_partitioned_memory


def estimate_memory(cfg: Config, model: nn.Module, no_decay: set[int], world_size: int = 1,
                    expert_parallel_size: Optional[int] = None, device_type: str = "cuda",
                    facts: Optional[ModelFacts] = None) -> MemoryReport:
    """Per-process estimate for ``cfg`` with ``model`` (meta or real) holding this process's params
    (arguments as m6.memory.estimate.layout_memory's): ZeRO-Offload with partitioned host states
    (memory.offload=zero + parallel.shard=optimizer) from m6.memory.zero_partition_estimate, every
    other layout from m6.memory.estimate."""
    if partitioned(cfg):
        facts = facts if facts is not None else ModelFacts(model)
        return zero_partitioned_memory(cfg, model, facts, no_decay, world_size, expert_parallel_size or 1,
                                       device_type)
    return layout_memory(cfg, model, no_decay, world_size, expert_parallel_size, device_type, facts)
