"""Parallel layout: which ranks share experts, and the device mesh that follows from it.

The ONLY place m6 creates process groups: one torch DeviceMesh with named dims
("edp", "ep") over ranks arange(world).view(edp, ep). Ranks are laid out expert-parallel (EP)
first: EP group g = ranks [g*ep, (g+1)*ep) (a row of the mesh), so with ep <= processes per node
the all-to-all stays inside a node. The expert-data-parallel (EDP) groups (columns) join the
ranks holding the same experts; replicated parameters are data parallel over all ranks. One
process without torch.distributed is the trivial layout (world 1, EP 1) with no mesh.

Tensor parallel (parallel.tensor_parallel_size = tp > 1) adds an innermost mesh dim: the mesh is
("edp", "ep", "tp") over arange(world).view(edp, ep, tp), so a tensor-parallel group is tp
consecutive ranks (inside a node whenever tp divides the processes per node). Everything above
then runs over the ranks of one tp coordinate: the data-parallel group (``data``) is the world /
tp ranks with this rank's tp coordinate, EP and EDP groups are taken among them. At tp = 1 the
mesh, the groups and every rank's coordinates are the ones above.

Pipeline parallel (parallel.pipeline_parallel_size = pp > 1) adds the outermost mesh dim, as
torchtitan and Megatron do: the mesh is ("pp", "edp", "ep") over arange(world).view(pp, edp, ep),
so pipeline stage s runs on ranks [s*world/pp, (s+1)*world/pp) and a pipeline (one rank of each
stage, the point-to-point sends) is the ranks of one (edp, ep) coordinate. Data and expert
parallelism run inside each stage: the data-parallel group (``data``) is the stage's ranks, the
EP and EDP groups are taken among them. With tensor parallel as well the mesh is 4-D,
("pp", "edp", "ep", "tp") over arange(world).view(pp, edp, ep, tp): pp outermost, tp innermost,
so a stage's ranks are consecutive and its tp groups consecutive inside it; a pipeline is the
ranks of one (edp, ep, tp) coordinate, and the data-parallel group of a stage the ranks of its
tp coordinate.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional, Union

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from m6.parallel.expert_ranges import (describe_ranges, ep_position_weights, even_counts, first_experts,
                                      weighted_counts)


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
    # Experts held by each EP rank, contiguous in EP rank order (m6.parallel.expert_ranges); empty = even.
    expert_counts: tuple[int, ...] = field(default=())
    tensor_parallel_size: int = 1  # the innermost mesh dim (see the module docstring)
    pipeline_parallel_size: int = 1  # the outermost mesh dim (see the module docstring)

    def __post_init__(self) -> None:
        if not self.expert_counts:
            object.__setattr__(self, "expert_counts", tuple(even_counts(self.num_experts, self.expert_parallel_size)))
        assert len(self.expert_counts) == self.expert_parallel_size and sum(self.expert_counts) == self.num_experts

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel_size

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage (the world at pipeline-parallel size 1)."""
        return self.world_size // self.pipeline_parallel_size

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline position (0 at pipeline-parallel size 1)."""
        return self.rank // self.stage_size

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different batches: the world over the tensor- and pipeline-parallel sizes."""
        return self.stage_size // self.tensor_parallel_size

    @property
    def dp_rank(self) -> int:
        """This rank's place among the data-parallel ranks (its batch shard)."""
        return self.rank % self.stage_size // self.tensor_parallel_size

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.expert_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        return self.data_parallel_size // self.expert_parallel_size

    @property
    def experts_per_rank(self) -> int:
        """The experts this rank holds (uneven layouts: not the same on every EP rank)."""
        return self.expert_counts[self.ep_rank]

    @property
    def first_local_expert(self) -> int:
        return first_experts(list(self.expert_counts))[self.ep_rank]

    @property
    def uneven_experts(self) -> bool:
        return len(set(self.expert_counts)) > 1

    def counts_for(self, num_experts: int) -> list[int]:
        """Experts per EP rank of a layer with ``num_experts`` experts: the layout's counts for the
        model's layers, the even split for a layer of another size (a user's own plan)."""
        if num_experts == self.num_experts:
            return list(self.expert_counts)
        return even_counts(num_experts, self.expert_parallel_size)

    def expert_ranges_by_rank(self) -> list[str]:
        """The experts every rank of the job holds, in rank order, as text (``0-4``; the banner's)."""
        ranges = describe_ranges(list(self.expert_counts))
        return [ranges[(r % self.stage_size // self.tensor_parallel_size) % self.expert_parallel_size]
                for r in range(self.world_size)]

    @property
    def node(self) -> int:
        return self.rank // self.local_world_size

    def ep_group_ranks(self) -> list[list[int]]:
        ep, tp, n = self.expert_parallel_size, self.tensor_parallel_size, self.stage_size
        return [[s * n + (g * ep + e) * tp + t for e in range(ep)] for s in range(self.pipeline_parallel_size)
                for g in range(self.expert_data_parallel_size) for t in range(tp)]

    def edp_group_ranks(self) -> list[list[int]]:
        ep, tp, n = self.expert_parallel_size, self.tensor_parallel_size, self.stage_size
        return [[s * n + (g * ep + e) * tp + t for g in range(self.expert_data_parallel_size)]
                for s in range(self.pipeline_parallel_size) for e in range(ep) for t in range(tp)]

    def tp_group_ranks(self) -> list[list[int]]:
        tp = self.tensor_parallel_size
        return [list(range(d * tp, (d + 1) * tp)) for d in range(self.world_size // tp)]

    def data_group_ranks(self) -> list[list[int]]:
        """The data-parallel groups: the ranks of each (stage, tp coordinate) (all ranks at tp = pp = 1)."""
        tp, n = self.tensor_parallel_size, self.stage_size
        return [list(range(s * n + t, (s + 1) * n, tp)) for s in range(self.pipeline_parallel_size)
                for t in range(tp)]

    def embedding_group_ranks(self, last_stage_pp_rank: int) -> list[list[int]]:
        """Per pipeline, its first stage's rank and the rank of its last stage (pipeline position
        ``last_stage_pp_rank``): the ranks holding the tied token embedding."""
        return [[p[0], p[last_stage_pp_rank]] for p in self.pp_group_ranks()]

    def pp_group_ranks(self) -> list[list[int]]:
        """The pipelines: one rank of each stage, at the same place inside its stage."""
        n = self.stage_size
        return [list(range(i, self.world_size, n)) for i in range(n)]

    def my_ep_group(self) -> list[int]:
        """The ranks of this rank's expert-parallel group, in EP rank order."""
        return next(g for g in self.ep_group_ranks() if self.rank in g)


def data_parallel_coordinates(world_size: int, rank: int, tensor_parallel_size: int,
                              pipeline_parallel_size: int = 1) -> tuple[int, int]:
    """(this rank's data-parallel rank, the data-parallel size): the batch shard it reads. The
    ranks of one tensor-parallel group (tp consecutive ranks) read the same shard, and so do the
    ranks of one pipeline (every stage needs the micro-batches: the first embeds them, the last
    scores their labels)."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if not isinstance(pp, int) or pp <= 0 or world_size % pp:
        raise LayoutError(f"parallel.pipeline_parallel_size ({pp}) must divide the number of processes ({world_size})")
    stage = world_size // pp
    if not isinstance(tp, int) or tp <= 0 or stage % tp:
        raise LayoutError(f"parallel.tensor_parallel_size ({tp}) must divide the number of processes ({world_size})")
    return rank % stage // tp, stage // tp


def resolve_expert_parallel_size(setting: Union[int, str], world_size: int, num_experts: int) -> int:
    """``auto`` = the largest divisor of the world size that also divides num_experts."""
    if setting == "auto":
        return max(d for d in range(1, world_size + 1) if world_size % d == 0 and num_experts % d == 0)
    if not isinstance(setting, int) or setting <= 0:
        raise LayoutError(f"parallel.expert_parallel_size must be a positive integer or 'auto', got {setting!r}")
    return setting


def build_layout(world_size: int, rank: int, expert_parallel_size: Union[int, str], num_experts: int,
                 local_world_size: Optional[int] = None,
                 rank_weights: Optional[list[float]] = None, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1) -> ParallelLayout:
    """Validate the degrees and return this rank's layout (pure: no communication).

    ``tensor_parallel_size`` (parallel.tensor_parallel_size) must divide the world; expert
    parallelism is then resolved and checked against the world / tp data-parallel ranks.

    ``rank_weights`` (parallel.balance as a list, one weight per rank): with expert parallelism,
    each EP rank holds experts in proportion to its weight (m6.parallel.expert_ranges); None = even.
    """
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if pp != 1 or tp != 1:
        return _split_layout(world_size, rank, expert_parallel_size, num_experts, local_world_size, rank_weights,
                             tp, pp)
    ep = resolve_expert_parallel_size(expert_parallel_size, world_size, num_experts)
    if world_size % ep:
        raise LayoutError(f"parallel.expert_parallel_size ({ep}) must divide the number of processes ({world_size})")
    if world_size % local_world_size:
        raise LayoutError(f"LOCAL_WORLD_SIZE ({local_world_size}) must divide WORLD_SIZE ({world_size})")
    if rank_weights is None or ep == 1:
        if num_experts % ep:
            raise LayoutError(f"parallel.expert_parallel_size ({ep}) must divide model.moe.num_experts ({num_experts})")
        return ParallelLayout(world_size, rank, ep, num_experts, local_world_size)
    if len(rank_weights) != world_size:
        raise LayoutError(f"parallel.balance has {len(rank_weights)} weights, the job has {world_size} ranks: give "
                          f"one weight per rank")
    try:
        counts = weighted_counts(num_experts, ep_position_weights(rank_weights, ep))
    except ValueError as e:
        raise LayoutError(f"parallel.balance={rank_weights} at parallel.expert_parallel_size={ep}: {e}") from e
    return ParallelLayout(world_size, rank, ep, num_experts, local_world_size, tuple(counts))


def _split_layout(world_size: int, rank: int, expert_parallel_size: Union[int, str], num_experts: int,
                  local_world_size: int, rank_weights: Optional[list[float]], tp: int, pp: int) -> ParallelLayout:
    """build_layout where the model is split (parallel.tensor_parallel_size or
    pipeline_parallel_size > 1): even experts over each stage's data-parallel ranks (its ranks / tp;
    a stage is the whole world without a pipeline); uneven ones (parallel.balance) are refused."""
    if not isinstance(pp, int) or pp <= 0 or world_size % pp:
        raise LayoutError(f"parallel.pipeline_parallel_size ({pp}) must divide the number of processes ({world_size})")
    stage = world_size // pp
    # Each message names the divisions that made its number: the world alone without a pipeline.
    of_stage = f"{world_size} processes / parallel.pipeline_parallel_size {pp}"
    if not isinstance(tp, int) or tp <= 0 or stage % tp:
        raise LayoutError(f"parallel.tensor_parallel_size ({tp}) must divide the number of processes ({world_size})"
                          if pp == 1 else
                          f"parallel.tensor_parallel_size ({tp}) must divide the ranks of a pipeline stage ({stage} = "
                          f"{of_stage})")
    if world_size % local_world_size:
        raise LayoutError(f"LOCAL_WORLD_SIZE ({local_world_size}) must divide WORLD_SIZE ({world_size})")
    if rank_weights is not None:
        key = "pipeline_parallel_size" if pp > 1 else "tensor_parallel_size"
        raise LayoutError(f"parallel.balance={rank_weights} with parallel.{key}={pp if pp > 1 else tp} is not "
                          f"supported: use parallel.balance=even")
    dp = stage // tp
    ep = resolve_expert_parallel_size(expert_parallel_size, dp, num_experts)
    if dp % ep:
        raise LayoutError(f"parallel.expert_parallel_size ({ep}) must divide the data-parallel ranks ({dp} = "
                          f"{world_size} processes / parallel.tensor_parallel_size {tp})" if pp == 1 else
                          f"parallel.expert_parallel_size ({ep}) must divide the data-parallel ranks of a pipeline "
                          f"stage ({dp} = {of_stage} / parallel.tensor_parallel_size {tp})")
    if num_experts % ep:
        raise LayoutError(f"parallel.expert_parallel_size ({ep}) must divide model.moe.num_experts ({num_experts})")
    return ParallelLayout(world_size, rank, ep, num_experts, local_world_size, tensor_parallel_size=tp,
                          pipeline_parallel_size=pp)


MESH_DIMS = ("edp", "ep")  # expert-data-parallel (same experts), expert-parallel (all-to-all)
TP_MESH_DIMS = ("edp", "ep", "tp")  # parallel.tensor_parallel_size > 1: tensor-parallel innermost
PP_MESH_DIMS = ("pp", "edp", "ep")  # parallel.pipeline_parallel_size > 1: pipeline-parallel outermost
PP_TP_MESH_DIMS = ("pp", "edp", "ep", "tp")  # both > 1: pipeline outermost, tensor innermost


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's groups, read off the job's device mesh; every group is None for one process
    without torch.distributed (then nothing communicates)."""

    layout: ParallelLayout
    mesh: Optional[DeviceMesh]
    checkpoint: object = None  # a gloo group of all ranks for checkpoint coordination (see below)
    node_aware: Optional["NodeAwareGroups"] = None  # made only for model.moe.a2a_dispatch: node_aware

    data_group: object = None  # tensor or pipeline parallel: this rank's data-parallel group (see ``data``)
    # pipeline parallel with a tied head on another rank than the embedding: this rank's first- and
    # last-stage pair (Megatron's embedding group), None elsewhere
    embedding: object = None

    @property
    def world(self):
        """All ranks (at tensor-parallel size 1 also the replicated parameters' data-parallel group)."""
        return dist.group.WORLD if self.mesh is not None else None

    @property
    def data(self):
        """The ranks that see different batches and hold the same replicated and tensor-parallel
        shards: the gradient sync group of every parameter but the experts (all ranks at tp 1)."""
        return self.data_group if self.data_group is not None else self.world

    @property
    def pipeline(self):
        """This rank's pipeline (one rank of each stage; None at pipeline-parallel size 1)."""
        if self.mesh is None or self.layout.pipeline_parallel_size == 1:
            return None
        return self.mesh.get_group("pp")

    @property
    def tensor(self):
        """This rank's tensor-parallel group (None at tensor-parallel size 1)."""
        if self.mesh is None or self.layout.tensor_parallel_size == 1:
            return None
        return self.mesh.get_group("tp")

    @property
    def tensor_mesh(self) -> Optional[DeviceMesh]:
        """The mesh's "tp" dim for this rank (its tensor-parallel group as a 1-D DeviceMesh), None at tp 1."""
        if self.mesh is None or self.layout.tensor_parallel_size == 1:
            return None
        return self.mesh["tp"]

    @property
    def expert(self):
        """This rank's expert-parallel group (the all-to-all)."""
        return self.mesh.get_group("ep") if self.mesh is not None else None

    @property
    def expert_data(self):
        """The ranks holding the same experts (expert gradient sync)."""
        return self.mesh.get_group("edp") if self.mesh is not None else None


@dataclass(frozen=True)
class NodeAwareGroups:
    """The two halves of node-aware dispatch's exchange inside this rank's expert-parallel group
    (m6.moe.node_aware_all_to_all): ``rail``, the group's ranks of this rank's local index, one per
    node (the inter-node stage); ``node``, the group's ranks on this rank's node (the forwarding
    stage). Separate groups, so on NCCL the forwarding of one chunk is not queued behind the
    inter-node transfers of the next (each communicator has its own stream)."""

    rail: object
    node: object


def node_aware_groups(layout: ParallelLayout) -> NodeAwareGroups:
    """Every rail and node group of every expert-parallel group (a collective: every rank creates
    all of them in the same order and keeps its own). Nodes must hold the same number of each
    expert-parallel group's ranks (m6.parallel.node_groups.check_node_aware_dispatch)."""
    ep, lws = layout.expert_parallel_size, layout.local_world_size
    per_node = min(ep, lws)
    nodes = ep // per_node
    mine = {}
    for first in range(0, layout.world_size, ep):
        for b in range(nodes):
            ranks = [first + b * per_node + g for g in range(per_node)]
            group = dist.new_group(ranks)
            if layout.rank in ranks:
                mine["node"] = group
        for g in range(per_node):
            ranks = [first + b * per_node + g for b in range(nodes)]
            group = dist.new_group(ranks)
            if layout.rank in ranks:
                mine["rail"] = group
    return NodeAwareGroups(**mine)


def create_process_groups(layout: ParallelLayout, timeout_s: Optional[float] = None,
                          node_aware: bool = False, tied_last_stage: Optional[int] = None) -> ProcessGroups:
    """Build the job's device mesh (a collective: every rank calls it at the same point).

    One process without torch.distributed gets no mesh; under torch.distributed, even at world
    size 1, the mesh is built on the default group's device type (cuda for NCCL, cpu for gloo).
    ``timeout_s`` (parallel.timeout_s): how long a collective of the gloo checkpoint group waits
    for a peer (None: torch's default for gloo, 30 minutes). ``tied_last_stage``: at pipeline
    parallel with tied embeddings, the pipeline position of the last stage; when it is not the
    first stage's (0), each pipeline's pair of them gets a group (``ProcessGroups.embedding``).
    """
    if not dist.is_initialized():
        if layout.world_size == 1:
            return ProcessGroups(layout, None)
        raise RuntimeError("torch.distributed is not initialised; call m6.parallel.init_distributed() first")
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    data_group = None
    if layout.pipeline_parallel_size > 1 and layout.tensor_parallel_size > 1:
        shape, names = (layout.pipeline_parallel_size, layout.expert_data_parallel_size,
                        layout.expert_parallel_size, layout.tensor_parallel_size), PP_TP_MESH_DIMS
    elif layout.pipeline_parallel_size > 1:
        shape, names = (layout.pipeline_parallel_size, layout.expert_data_parallel_size,
                        layout.expert_parallel_size), PP_MESH_DIMS
    elif layout.tensor_parallel_size > 1:
        shape, names = (layout.expert_data_parallel_size, layout.expert_parallel_size,
                        layout.tensor_parallel_size), TP_MESH_DIMS
    else:
        shape, names = (layout.expert_data_parallel_size, layout.expert_parallel_size), MESH_DIMS
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    if names != MESH_DIMS:  # the data-parallel group is not the world: every rank creates every one, in order
        for ranks in layout.data_group_ranks():
            group = dist.new_group(ranks)
            if layout.rank in ranks:
                data_group = group
    embedding = None
    if tied_last_stage:
        for ranks in layout.embedding_group_ranks(tied_last_stage):
            group = dist.new_group(ranks)
            if layout.rank in ranks:
                embedding = group
    # Checkpoints coordinate over a group of their own: DCP exchanges plans and results as
    # pickled objects (host memory: gloo serves them whatever the training backend), and a save
    # running in a background thread must never interleave with the training collectives.
    checkpoint = dist.new_group(backend="gloo", timeout=None if timeout_s is None else timedelta(seconds=timeout_s))
    # node_aware: the subgroups node-aware dispatch needs (model.moe.a2a_dispatch: node_aware).
    aware = node_aware_groups(layout) if node_aware and layout.expert_parallel_size > 1 else None
    return ProcessGroups(layout, mesh, checkpoint, aware, data_group, embedding)
