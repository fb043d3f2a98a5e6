"""Where the nodes are in an expert-parallel group: the node of each rank of the group, the check
that model.moe.node_groups puts every node group of experts on one node (so node-limited routing
limits the nodes a token reaches), and the check that node-aware dispatch finds the same number of
the group's ranks on every node (its relays pair ranks of equal local index)."""

from __future__ import annotations

from m6.parallel.layout import LayoutError, ParallelLayout


def ep_group_nodes(layout: ParallelLayout) -> list[int]:
    """Node of each rank of this rank's expert-parallel group, by position in the group."""
    return [r // layout.local_world_size for r in layout.my_ep_group()]


def check_node_groups(layout: ParallelLayout, node_groups: int, max_nodes_per_token: int) -> None:
    """With node-limited routing on, every one of the ``node_groups`` contiguous expert groups must
    lie on one node of every expert-parallel group (LayoutError naming the keys otherwise); a
    layout whose expert-parallel groups stay inside one node always fits."""
    if not max_nodes_per_token:
        return
    ep, lws = layout.expert_parallel_size, layout.local_world_size
    per_group = layout.num_experts // node_groups
    owner = [j for j, count in enumerate(layout.expert_counts) for _ in range(count)]  # EP rank of each expert
    for ranks in layout.ep_group_ranks():
        nodes = [r // lws for r in ranks]
        for group in range(node_groups):
            spanned = {nodes[owner[e]] for e in range(group * per_group, (group + 1) * per_group)}
            if len(spanned) > 1:
                num_nodes = len(set(nodes))
                raise LayoutError(
                    f"model.moe.node_groups ({node_groups}) does not match the launch: expert group {group} "
                    f"(experts {group * per_group}..{(group + 1) * per_group - 1}) spans nodes {sorted(spanned)} "
                    f"of the expert-parallel group (parallel.expert_parallel_size {ep}, {lws} processes per node, "
                    f"{num_nodes} nodes); node_groups must be a multiple of {num_nodes}")


def check_node_aware_dispatch(layout: ParallelLayout, a2a_dispatch: str) -> None:
    """model.moe.a2a_dispatch=node_aware needs every node of each expert-parallel group to hold the
    same number of the group's ranks (LayoutError naming the keys otherwise)."""
    if a2a_dispatch != "node_aware" or layout.expert_parallel_size == 1:
        return
    nodes = ep_group_nodes(layout)
    per_node = [nodes.count(n) for n in dict.fromkeys(nodes)]
    if len(set(per_node)) > 1:
        raise LayoutError(
            f"model.moe.a2a_dispatch=node_aware does not match the launch: the expert-parallel group of rank "
            f"{layout.rank} (parallel.expert_parallel_size {layout.expert_parallel_size}, {layout.local_world_size} "
            f"processes per node) has {per_node} ranks on its nodes; node-aware dispatch needs the same number on "
            f"each: make the expert-parallel size a multiple or a divisor of the processes per node, or use "
            f"model.moe.a2a_dispatch=flat")
