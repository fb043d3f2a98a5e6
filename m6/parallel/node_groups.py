"""Where the nodes are in an expert-parallel group: the node of each rank of the group, the check
that model.moe.node_groups puts every node group of experts on one node (so node-limited routing
limits the nodes a token reaches)."""

from __future__ import annotations

from m6.parallel.layout import LayoutError, ParallelLayout


def ep_group_nodes(layout: ParallelLayout) -> list[int]:
    """Node of each rank of this rank's expert-parallel group, by position in the group."""
    first = layout.rank - layout.ep_rank
    return [(first + j) // layout.local_world_size for j in range(layout.expert_parallel_size)]


def check_node_groups(layout: ParallelLayout, node_groups: int, max_nodes_per_token: int) -> None:
    """With node-limited routing on, every one of the ``node_groups`` contiguous expert groups must
    lie on one node of every expert-parallel group (LayoutError naming the keys otherwise); a
    layout whose expert-parallel groups stay inside one node always fits."""
    if not max_nodes_per_token:
        return
    ep, lws = layout.expert_parallel_size, layout.local_world_size
    per_group = layout.num_experts // node_groups
    owner = [j for j, count in enumerate(layout.expert_counts) for _ in range(count)]  # EP rank of each expert
    for first in range(0, layout.world_size, ep):
        nodes = [(first + j) // lws for j in range(ep)]
        for group in range(node_groups):
            spanned = {nodes[owner[e]] for e in range(group * per_group, (group + 1) * per_group)}
            if len(spanned) > 1:
                num_nodes = len(set(nodes))
                raise LayoutError(
                    f"model.moe.node_groups ({node_groups}) does not match the launch: expert group {group} "
                    f"(experts {group * per_group}..{(group + 1) * per_group - 1}) spans nodes {sorted(spanned)} "
                    f"of the expert-parallel group (parallel.expert_parallel_size {ep}, {lws} processes per node, "
                    f"{num_nodes} nodes); node_groups must be a multiple of {num_nodes}")
