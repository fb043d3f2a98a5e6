"""Node-aware expert-parallel dispatch (DeepEP's idea, on torch.distributed): a token bound for
several experts on the same remote node crosses the inter-node link ONCE, to a relay rank on that
node, which forwards it to the ranks owning those experts (intra-node), sums their router-weighted
outputs and sends ONE row back. The flat dispatcher (m6.moe.all_to_all) sends a row per
(token, expert) assignment, so at top-k a token can cross the same link k times each way.

Shape legend: T tokens, D d_model, K assignments per token, A = T*K, E global experts, R ranks of
the expert-parallel group, B nodes of the group, G ranks per node, NE experts of this rank's node,
L this rank's local experts, N kept assignments of this rank.

Roles, with ranks numbered node-major (rank = node * G + local index, as m6.parallel lays them out):
- source: every rank, for its own tokens. Stage A sends each (token, node) pair as one row to the
  relay on that node: the rank with the source's local index (its own node: itself), with the
  router weight and row index of each of the token's assignments on that node.
- relay: stage B forwards each received assignment's row to the rank of its node owning the expert,
  and after the experts sums the weighted outputs per row (in fp32) before stage A's way back.
- receiver: gets rows from the relays of its node, computes its local experts, sends them back.

Every rank issues the same collectives in the same order whatever the routing: one counts exchange
(the layer's one host sync), stage A (rows, weights, row indices), stage B, stage B back, stage A
back; zero-row splits are legal. All exchanges are on the expert-parallel group: a rank sends only
to ranks of its own local index (stage A) or of its own node (stage B), the other splits are 0.
The router weights travel with autograd, so their gradient (computed where the weighted sum is
formed, on the relay) returns to the source.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Optional

import torch
import torch.distributed as dist

from m6.moe.all_to_all import AllToAllDispatcher, all_to_all, wire_dtype
from m6.moe.dispatch import DispatchPlan, host_ints

INDEX_DTYPE = torch.int32  # a relayed assignment's row index on the wire (rows per source < 2**31)


@dataclass
class NodeAwareHandle:
    """What combine needs: the source's rows and the relay's forwarded assignments."""

    token_row: torch.Tensor  # int64 [rows sent in stage A]: the token of each (token, node) row
    a_send: list[int]  # stage A rows sent to each rank
    a_recv: list[int]  # stage A rows received from each rank (this rank as relay)
    b_send: list[int]  # stage B rows sent to each rank (this rank as relay)
    b_recv: list[int]  # stage B rows received from each rank (this rank as receiver)
    relay_row_B: torch.Tensor  # int64 [stage B rows sent]: the stage A row each forwarded assignment came from
    weights_B: torch.Tensor  # [stage B rows sent] their router weights (differentiable)
    local_order_M: torch.Tensor  # received stage B row -> position in the expert-grouped buffer
    wire_dtype: torch.dtype
    num_tokens: int


class NodeAwareDispatcher(AllToAllDispatcher):
    """The expert-parallel Dispatcher that sends each token once per destination node
    (model.moe.a2a_dispatch: node_aware). ``rank_nodes``: node of each rank of the group (from
    m6.parallel's layout); nodes must hold consecutive ranks, the same number each."""

    def __init__(self, group, num_experts: int, rank_nodes: list[int], a2a_dtype: Optional[torch.dtype] = None,
                 counts: Optional[list[int]] = None) -> None:
        super().__init__(group, num_experts, a2a_dtype, 1, rank_nodes, counts)
        R = self.group_size
        node_ids = list(dict.fromkeys(rank_nodes))
        G = R // len(node_ids)
        if len(rank_nodes) != R or any(rank_nodes[r] != node_ids[r // G] for r in range(R)) or R % len(node_ids):
            raise ValueError(f"node-aware dispatch (model.moe.a2a_dispatch: node_aware) needs every node of the "
                             f"expert-parallel group to hold the same number of consecutive ranks; the group's "
                             f"ranks are on nodes {rank_nodes}")
        self.num_nodes, self.ranks_per_node = len(node_ids), G
        self.node = self.group_rank // G
        self.local_index = self.group_rank % G
        bounds = [0, *accumulate(self.counts)]
        self.node_experts = [(bounds[b * G], bounds[(b + 1) * G]) for b in range(self.num_nodes)]  # [first, end)
        self.local_first = bounds[self.group_rank] - self.node_experts[self.node][0]  # in this node's experts
        self._lookups: dict[torch.device, dict[str, torch.Tensor]] = {}

    def _lookup(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Index tensors that depend only on the layout, made once per device."""
        if device not in self._lookups:
            R, G, B, E = self.group_size, self.ranks_per_node, self.num_nodes, self.num_experts
            node_of_expert = [b for b, (lo, hi) in enumerate(self.node_experts) for _ in range(lo, hi)] + [B]
            # The counts payload: to rank r, the counts of node(r)'s experts, then the rows for node(r).
            payload = [i for r in range(R) for i in [*range(*self.node_experts[r // G]), E + r // G]]
            lo, hi = self.node_experts[self.node]
            owner = [r % G for r in range(self.node * G, (self.node + 1) * G) for _ in range(self.counts[r])]
            self._lookups[device] = {
                "node_of_expert": torch.tensor(node_of_expert, device=device),
                "payload": torch.tensor(payload, device=device),
                "relayed": torch.tensor([r % G == self.local_index for r in range(R)], device=device),
                "owner": torch.tensor(owner, device=device),  # local index of the owner of each node expert
                "arrival": torch.tensor([b * G + g for g in range(G) for b in range(B)], device=device),
            }
        return self._lookups[device]

    def dispatch(self, x_TD: torch.Tensor, plan: DispatchPlan) -> tuple[torch.Tensor, list[int], NodeAwareHandle]:
        """Rows for this rank's local experts, grouped by local expert, and their counts."""
        R, G, B, E = self.group_size, self.ranks_per_node, self.num_nodes, self.num_experts
        T, K = plan.num_tokens, plan.num_assignments
        lo, hi = self.node_experts[self.node]
        NE, L = hi - lo, self.num_local
        look = self._lookup(x_TD.device)
        # Which (node, token) pairs have a kept assignment: on the device, before the host knows N.
        A = plan.order_A.numel()
        cum_E = torch.cumsum(plan.counts_E, 0)
        expert_pos = torch.searchsorted(cum_E, torch.arange(A, device=x_TD.device), right=True)  # E: not kept
        key_pos = look["node_of_expert"].index_select(0, expert_pos) * T + plan.order_A // K
        present = torch.zeros((B + 1) * T, dtype=torch.bool, device=x_TD.device).scatter_(0, key_pos, True)[:B * T]
        rows_B = present.view(B, T).sum(dim=1)
        send_counts = torch.cat([plan.counts_E, rows_B]).index_select(0, look["payload"])
        recv_counts = torch.empty(R * (NE + 1), dtype=send_counts.dtype, device=send_counts.device)
        dist.all_to_all_single(recv_counts, send_counts, [NE + 1] * R,
                               [hi_ - lo_ + 1 for r in range(R) for lo_, hi_ in [self.node_experts[r // G]]],
                               group=self.group)
        recv_RC = recv_counts.view(R, NE + 1)
        counts_E, rows_per_node, recv = host_ints(plan.counts_E, rows_B, recv_RC)  # the layer's one host sync
        recv = [recv[r * (NE + 1):(r + 1) * (NE + 1)] for r in range(R)]

        relay = [b * G + self.local_index for b in range(B)]
        relayed = [r for r in range(R) if r % G == self.local_index]  # sources this rank relays for
        bounds = [0, *accumulate(self.counts)]
        assign_per_node = [sum(counts_E[a:b]) for a, b in self.node_experts]
        a_send, w_send = [0] * R, [0] * R
        for b in range(B):
            a_send[relay[b]], w_send[relay[b]] = rows_per_node[b], assign_per_node[b]
        a_recv, w_recv = [0] * R, [0] * R
        for s in relayed:
            a_recv[s], w_recv[s] = recv[s][NE], sum(recv[s][:NE])
        node_bounds = [bounds[r] - lo for r in range(self.node * G, (self.node + 1) * G + 1)]  # in node experts
        b_send = [0] * R
        for h in range(G):
            b_send[self.node * G + h] = sum(sum(recv[s][node_bounds[h]:node_bounds[h + 1]]) for s in relayed)
        mine = slice(self.local_first, self.local_first + L)
        b_recv = [0] * R
        for g in range(G):
            b_recv[self.node * G + g] = sum(sum(recv[b * G + g][mine]) for b in range(B))
        local_experts = [sum(recv[s][self.local_first + e] for s in range(R)) for e in range(L)]
        dtype = wire_dtype(x_TD, self.a2a_dtype)
        self._count(a_send, a_recv, w_send, w_recv, x_TD.shape[-1] * dtype.itemsize, plan.weights_A.dtype.itemsize)

        # Source: one row per (node, token) pair, node-major, and each kept assignment's row index
        # inside its node's segment (the relay adds the segment's offset).
        N = sum(counts_E)
        kept = plan.kept(N)
        row_of_key = torch.cumsum(present, 0) - 1
        node_start = torch.cumsum(rows_B, 0) - rows_B
        node_N = look["node_of_expert"].index_select(0, expert_pos[:N])
        row_N = row_of_key.index_select(0, key_pos[:N]) - node_start.index_select(0, node_N)
        token_row = torch.argsort(~present, stable=True)[:sum(rows_per_node)] % max(T, 1)
        x_A = all_to_all(x_TD.index_select(0, token_row).to(dtype), a_recv, a_send, self.group)
        w_A = all_to_all(kept.weights_N, w_recv, w_send, self.group)
        idx_A = row_N.new_empty(sum(w_recv), dtype=INDEX_DTYPE)
        dist.all_to_all_single(idx_A, row_N.to(INDEX_DTYPE), w_recv, w_send, group=self.group)

        # Relay: each received assignment's stage A row and node expert; forward them grouped by the
        # owning rank of this node (then by source, then by expert: what the receiver expects).
        relayed_R = look["relayed"]
        src_assign = recv_RC[:, :NE].sum(dim=1) * relayed_R
        src_rows = recv_RC[:, NE] * relayed_R
        n_in = sum(w_recv)
        src_A = torch.repeat_interleave(torch.arange(R, device=x_TD.device), src_assign, output_size=n_in)
        row_A = idx_A.long() + (torch.cumsum(src_rows, 0) - src_rows).index_select(0, src_A)
        expert_A = torch.repeat_interleave(torch.arange(NE, device=x_TD.device).repeat(R),
                                           (recv_RC[:, :NE] * relayed_R.unsqueeze(1)).reshape(-1), output_size=n_in)
        forward_order = torch.argsort(look["owner"].index_select(0, expert_A), stable=True)
        relay_row_B = row_A.index_select(0, forward_order)
        x_B = all_to_all(x_A.index_select(0, relay_row_B), b_recv, b_send, self.group)

        # Receiver: rows arrive [relay g][source node b][local expert]; group them by local expert.
        arrival_RL = recv_RC.index_select(0, look["arrival"])[:, self.local_first:self.local_first + L]
        local_order_M = self.local_order(arrival_RL, sum(b_recv))
        x_local = x_B.index_select(0, local_order_M)
        if not torch.is_autocast_enabled(x_TD.device.type):
            x_local = x_local.to(x_TD.dtype)  # a compressed fp32 run computes in fp32 again
        handle = NodeAwareHandle(token_row, a_send, a_recv, b_send, b_recv, relay_row_B,
                                 w_A.index_select(0, forward_order), local_order_M, dtype, T)
        return x_local, local_experts, handle

    def _count(self, a_send: list[int], a_recv: list[int], w_send: list[int], w_recv: list[int], row_bytes: int,
               weight_bytes: int) -> None:
        """Add one layer call's inter-node payload to ``inter_node_bytes``, from the split sizes: stage
        A's rows and (weight, index) pairs to remote relays, the summed rows a relay sends back to
        remote sources, and in backward the same rows again plus the weights' gradients."""
        me = self.rank_nodes[self.group_rank]
        remote = [r for r in range(self.group_size) if self.rank_nodes[r] != me]
        rows = sum(a_send[r] + a_recv[r] for r in remote)
        self.inter_node_bytes += 2 * rows * row_bytes + sum(w_send[r] for r in remote) * (
            weight_bytes + INDEX_DTYPE.itemsize) + sum(w_recv[r] for r in remote) * weight_bytes

    def combine(self, y_local: torch.Tensor, handle: NodeAwareHandle, out_dtype: torch.dtype) -> torch.Tensor:
        """Expert outputs back to the relays, weighted and summed per (token, node) row there, back to
        the sources and summed per token: [M, D] -> [T, D] in ``out_dtype``."""
        y_B = torch.empty_like(y_local).index_copy(0, handle.local_order_M, y_local).to(handle.wire_dtype)
        y_relay = all_to_all(y_B, handle.b_send, handle.b_recv, self.group)
        acc = torch.promote_types(y_relay.dtype, handle.weights_B.dtype)
        weighted = y_relay.to(acc) * handle.weights_B.to(acc).unsqueeze(-1)
        partial = weighted.new_zeros(sum(handle.a_recv), y_local.shape[-1]).index_add(0, handle.relay_row_B, weighted)
        y_rows = all_to_all(partial.to(handle.wire_dtype), handle.a_send, handle.a_recv, self.group)
        out = y_rows.new_zeros(handle.num_tokens, y_local.shape[-1], dtype=acc)
        return out.index_add(0, handle.token_row, y_rows.to(acc)).to(out_dtype)
