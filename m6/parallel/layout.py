"""Parallel layout: which ranks share experts, and the process groups that follow from it.

The ONLY place m6 creates process groups. Ranks are laid out expert-parallel (EP) first:
EP group g = ranks [g*ep, (g+1)*ep), so with ep <= processes per node the all-to-all stays
inside a node. The expert-data-parallel (EDP) groups join the ranks holding the same experts
(same position in their EP group); replicated parameters are data parallel over all ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

import torch.distributed as dist


class LayoutError(ValueError):
    """An impossible parallel layout, named by its config keys; raised before any collective."""


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees and this rank's coordinates (plain ints: no process groups)."""

    world_size: int
    rank: int
    expert_parallel_size: int
    num_experts: int
    local_world_size: int  # processes per node (torchrun's LOCAL_WORLD_SIZE)

    @property
    def ep_rank(self) -> int:
        return self.rank % self.expert_parallel_size

    @property
    def ep_group_index(self) -> int:
        return self.rank // self.expert_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        return self.world_size // self.expert_parallel_size

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.expert_parallel_size

    @property
    def first_local_expert(self) -> int:
        return self.ep_rank * self.experts_per_rank

    @property
    def node(self) -> int:
        return self.rank // self.local_world_size

    def ep_group_ranks(self) -> list[list[int]]:
        ep = self.expert_parallel_size
        return [list(range(g * ep, (g + 1) * ep)) for g in range(self.world_size // ep)]

    def edp_group_ranks(self) -> list[list[int]]:
        ep = self.expert_parallel_size
        return [list(range(i, self.world_size, ep)) for i in range(ep)]


def resolve_expert_parallel_size(setting: Union[int, str], world_size: int, num_experts: int) -> int:
    """``auto`` = the largest divisor of the world size that also divides num_experts."""
    if setting == "auto":
        return max(d for d in range(1, world_size + 1) if world_size % d == 0 and num_experts % d == 0)
    if not isinstance(setting, int) or setting <= 0:
        raise LayoutError(f"parallel.expert_parallel_size must be a positive integer or 'auto', got {setting!r}")
    return setting


def build_layout(world_size: int, rank: int, expert_parallel_size: Union[int, str], num_experts: int,
                 local_world_size: Optional[int] = None) -> ParallelLayout:
    """Validate the degrees and return this rank's layout (pure: no communication)."""
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    ep = resolve_expert_parallel_size(expert_parallel_size, world_size, num_experts)
    if world_size % ep:
        raise LayoutError(f"parallel.expert_parallel_size ({ep}) must divide the number of processes ({world_size})")
    if num_experts % ep:
        raise LayoutError(f"parallel.expert_parallel_size ({ep}) must divide model.moe.num_experts ({num_experts})")
    if world_size % local_world_size:
        raise LayoutError(f"LOCAL_WORLD_SIZE ({local_world_size}) must divide WORLD_SIZE ({world_size})")
    return ParallelLayout(world_size, rank, ep, num_experts, local_world_size)


@dataclass
class ProcessGroups:
    """The groups this rank belongs to (None entries: the default world group)."""

    layout: ParallelLayout
    world: object  # replicated params' data-parallel group
    expert: object  # this rank's EP group (all-to-all)
    expert_data: object  # ranks holding the same experts (expert grad sync)


def create_process_groups(layout: ParallelLayout) -> ProcessGroups:
    """Create the EP and EDP groups; every rank calls new_group for every group in the same order."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call m6.parallel.init_distributed() first")
    expert = expert_data = None
    for ranks in layout.ep_group_ranks():
        group = dist.new_group(ranks)
        if layout.rank in ranks:
            expert = group
    for ranks in layout.edp_group_ranks():
        group = dist.new_group(ranks)
        if layout.rank in ranks:
            expert_data = group
    return ProcessGroups(layout, dist.group.WORLD, expert, expert_data)
