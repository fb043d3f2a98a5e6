"""Node-aware expert-parallel dispatch (DeepEP's idea, on torch.distributed): a token bound for
several experts on the same remote node crosses the inter-node link ONCE, to a relay rank on that
node, which forwards it to the ranks owning those experts (inside the node), sums their
router-weighted outputs and sends ONE row back. The flat dispatcher (m6.moe.all_to_all) sends a row
per (token, expert) assignment, so at top-k a token can cross the same link k times each way.

Shape legend: T tokens, K assignments per token, A = T*K, E global experts, R ranks of the
expert-parallel group, B nodes of the group, G ranks per node, NE experts of this rank's node, L
this rank's local experts, N kept assignments of this rank, C chunks (the overlap degree), D d_model.

Roles, with ranks numbered node-major (group rank = node * G + local index, as m6.parallel lays
them out):
- source: every rank, for its own tokens. Stage A (on the ``rail`` group: the ranks of its local
  index, one per node) sends each (token, node) pair as one row to the relay on that node (its own
  node: itself), with the router weight and row index of each of the token's assignments there.
- relay: stage B (on the ``node`` group) forwards each received assignment's row to the rank of its
  node owning the expert, and after the experts sums the weighted outputs per row (in fp32) before
  stage A's way back.
- receiver: gets rows from the relays of its node, computes its local experts, sends them back.

Overlap (``overlap_degree`` C > 1): each (source, node) segment of rows is cut into C consecutive
parts (as m6.moe.chunked_all_to_all.chunk_bounds cuts), and chunk c (part c of every segment, with
its assignments) runs the whole way (stage A, B, experts, B back, A back) on its own. All C stage A
exchanges start at once; chunk c is forwarded and computed as soon as it has arrived while later
chunks still cross the inter-node link, and its summed rows start back while chunk c+1 computes;
backward runs the reverse exchanges the same way (m6.moe.chunked_all_to_all's start/wait autograd
pairs). Stage B is a blocking exchange on the node group: on NCCL it does not queue behind the rail
group's transfers (each communicator has its own stream).

Every rank issues the same collectives in the same order whatever the routing: one counts exchange
on the expert-parallel group (the layer's one host sync; it carries each chunk's counts, so
chunking adds no exchange), then per chunk: stage A rows and (weight, index) pairs, stage B, stage B
back, stage A back; zero-row splits are legal. The router weights travel with autograd, so their
gradient (formed on the relay, where the weighted sum is) returns to the source.

Index arithmetic, a worked example. Group of R = 4 ranks on B = 2 nodes (G = 2 ranks each), E = 4
experts (expert r on rank r: node 0 holds experts 0-1, node 1 experts 2-3), C = 2 chunks. A source
rank has T = 4 tokens at top-2: token 0 -> experts (0, 1), 1 -> (1, 2), 2 -> (2, 3), 3 -> (3, 0).
- Rows (``_pair_rows``): one per (node, token) pair with an assignment there. Node 0: tokens 0, 1,
  3 (rows 0-2 of its segment); node 1: tokens 1, 2, 3. rows_B = [3, 3].
- Chunks (``chunk_cuts``, ``chunk_of``): a segment of 3 rows cuts at [0, 1, 3]: chunk 0 = row 0,
  chunk 1 = rows 1-2. Stage A sends the rows chunk-major (``_rows_chunk_major``): tokens
  [0, 1 | 1, 3, 2, 3] (chunk 0: node 0's token 0, node 1's token 1; chunk 1: node 0's 1, 3, node
  1's 2, 3), so rows_CB = [[1, 1], [2, 2]] (chunk c: rows for node b).
- Assignments per (chunk, expert) (``_count_per_chunk_expert``): counts_CE = [[1, 1, 1, 0],
  [1, 1, 1, 2]]. Each (weight, index) pair carries its row counted inside its (chunk, node)
  segment: token 3's pair for expert 0 is row 2 of node 0, chunk 1 starts at row 1: index 1.
- Counts exchange: rank r receives from every source, per chunk, the counts of node(r)'s experts
  and the rows for node(r): rank 2 gets [[1, 0, 1], [1, 2, 2]] from this source ([C, NE + 1]).
- Split sizes (``_host_counts``), at rank 2 (node 1, local index 0) as relay for the sources of
  local index 0 (ranks 0 and 2), with the above from source 0: stage A rows from node 0 per chunk
  1, 2 (the last column); pairs 1, 3 (the expert columns summed); stage B to rank 2 (expert 2)
  1, 1 and to rank 3 (expert 3) 0, 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Optional

import torch
import torch.distributed as dist

from m6.moe.all_to_all import AllToAllDispatcher, all_to_all, received_compute_dtype, wire_dtype
from m6.moe.chunked_all_to_all import chunk_cuts, chunk_of, start_exchange, wait_exchange
from m6.moe.dispatch import DispatchPlan, group_received, host_ints, sum_rows, ungroup

# A relayed assignment's row index travels bit-cast into its router weight's dtype, as the second
# column of one (weight, index) exchange: one collective per chunk instead of two. Backward sends
# the weights' gradient alone (the index column has none): one value per pair, not two.
_INDEX_BITS = {torch.float32: torch.int32, torch.float64: torch.int64}


@dataclass(frozen=True)
class _Counts:
    """Host ints of one dispatch, per chunk c (all from the counts exchange)."""

    a_send: list[list[int]]  # [c][b] stage A rows to the relay on node b
    a_recv: list[list[int]]  # [c][b] stage A rows from the source on node b (this rank as relay)
    w_send: list[list[int]]  # [c][b] (weight, index) pairs sent with them
    w_recv: list[list[int]]  # [c][b] pairs received with them
    b_send: list[list[int]]  # [c][h] stage B rows to local rank h of this node (this rank as relay)
    b_recv: list[list[int]]  # [c][g] stage B rows from relay g of this node (this rank as receiver)
    local_experts: list[list[int]]  # [c][l] rows for local expert l


@dataclass(frozen=True)
class _Source:
    """The source's side of one dispatch, ready to send."""

    n: _Counts
    x_send: torch.Tensor  # [rows, D] wire dtype, chunk-major (chunk, node, token)
    meta: torch.Tensor  # [N, 2] (weight, row index bits) in (chunk, node, expert) order; weights differentiable
    token_row: torch.Tensor  # int64 [rows]: the token of each row of x_send
    row_starts: list[int]  # chunk c's rows are x_send[row_starts[c]:row_starts[c + 1]]
    meta_starts: list[int]  # and its pairs meta[meta_starts[c]:meta_starts[c + 1]]
    recv_RCX: torch.Tensor  # int64 [R, C, NE + 1] (device): the counts exchange's received counts
    look: dict
    index_dtype: torch.dtype
    num_tokens: int


@dataclass(frozen=True)
class _Chunk:
    """One chunk at this rank as relay and receiver, between the experts' input and output."""

    relay_row: torch.Tensor  # int64 [stage B rows sent]: the stage A row each forwarded assignment came from
    weights: torch.Tensor  # [stage B rows sent] their router weights (differentiable)
    local_order_M: torch.Tensor  # received stage B row -> position in the expert-grouped buffer
    num_rows: int  # stage A rows of the chunk received here
    wire_dtype: torch.dtype
    b_send: list[int]
    b_recv: list[int]


class NodeAwareDispatcher(AllToAllDispatcher):
    """The expert-parallel Dispatcher that sends each token once per destination node
    (model.moe.a2a_dispatch: node_aware). ``group``: the expert-parallel group (counts exchange);
    ``rail``, ``node``: its two halves (m6.parallel.layout.NodeAwareGroups); ``rank_nodes``: node of
    each rank of the group, consecutive ranks per node, the same number on each; ``counts``:
    experts per rank (uneven layouts allowed); ``overlap_degree``: chunks (1 = blocking)."""

    def __init__(self, group, rail, node, num_experts: int, rank_nodes: list[int],
                 a2a_dtype: Optional[torch.dtype] = None, counts: Optional[list[int]] = None,
                 overlap_degree: int = 1) -> None:
        super().__init__(group, num_experts, a2a_dtype, 1, rank_nodes, counts)
        if isinstance(overlap_degree, bool) or not isinstance(overlap_degree, int) or overlap_degree < 1:
            raise ValueError(f"node-aware dispatch takes an integer overlap degree (model.moe.a2a_overlap_degree) "
                             f">= 1, got {overlap_degree!r}")
        self.overlap_degree = overlap_degree
        R = self.group_size
        node_ids = list(dict.fromkeys(rank_nodes))
        G = R // len(node_ids)
        if len(rank_nodes) != R or R % len(node_ids) or any(rank_nodes[r] != node_ids[r // G] for r in range(R)):
            raise ValueError(f"node-aware dispatch (model.moe.a2a_dispatch: node_aware) needs every node of the "
                             f"expert-parallel group to hold the same number of consecutive ranks; the group's "
                             f"ranks are on nodes {rank_nodes}")
        if dist.get_world_size(rail) != len(node_ids) or dist.get_world_size(node) != G:
            raise ValueError(f"node-aware dispatch: rail group of {dist.get_world_size(rail)} and node group of "
                             f"{dist.get_world_size(node)} ranks for {len(node_ids)} nodes of {G} ranks")
        self.rail, self.node_group = rail, node
        self.num_nodes, self.ranks_per_node = len(node_ids), G
        self.node = self.group_rank // G
        self.local_index = self.group_rank % G
        bounds = [0, *accumulate(self.counts)]
        self.node_experts = [(bounds[b * G], bounds[(b + 1) * G]) for b in range(self.num_nodes)]  # [first, end)
        lo = self.node_experts[self.node][0]
        self.owner_bounds = [bounds[r] - lo for r in range(self.node * G, (self.node + 1) * G + 1)]  # in node experts
        self.local_first = self.owner_bounds[self.local_index]
        self._lookups: dict[tuple, dict[str, torch.Tensor]] = {}

    def _lookup(self, device: torch.device, degree: int) -> dict[str, torch.Tensor]:
        """Index tensors that depend only on the layout and the degree, made once per device."""
        key = (device, degree)
        if key not in self._lookups:
            R, G, B, E, C = self.group_size, self.ranks_per_node, self.num_nodes, self.num_experts, degree
            node_of_expert = [b for b, (lo, hi) in enumerate(self.node_experts) for _ in range(lo, hi)] + [B]
            # The counts payload to rank r: for each chunk, the counts of node(r)'s experts and the
            # rows for node(r) (indices into cat(counts_CE.flatten(), rows_CB.flatten())).
            payload = [i for r in range(R) for c in range(C)
                       for i in [*(c * E + e for e in range(*self.node_experts[r // G])), C * E + c * B + r // G]]
            owner = [h for h in range(G) for _ in range(self.owner_bounds[h], self.owner_bounds[h + 1])]
            self._lookups[key] = {
                "node_of_expert": torch.tensor(node_of_expert, device=device),
                "payload": torch.tensor(payload, device=device),
                "relayed": torch.tensor([b * G + self.local_index for b in range(B)], device=device),
                "owner": torch.tensor(owner, device=device),  # local index of the owner of each node expert
                "arrival": torch.tensor([b * G + g for g in range(G) for b in range(B)], device=device),
            }
        return self._lookups[key]

    def dispatch(self, x_TD: torch.Tensor, plan: DispatchPlan) -> tuple[torch.Tensor, list[int], tuple]:
        """Rows for this rank's local experts, grouped by local expert, and their counts (one
        chunk, blocking: the protocol's separate phases; the layer calls ``dispatch_compute_combine``)."""
        src = self._source(x_TD, plan, 1)
        x_A = all_to_all(src.x_send, src.n.a_recv[0], src.n.a_send[0], self.rail)
        meta_A = wait_exchange(start_exchange(src.meta, src.n.w_recv[0], src.n.w_send[0], self.rail, grad_columns=1),
                               src.n.w_recv[0], src.n.w_send[0], self.rail)
        x_local, chunk = self._arrive(src, 0, x_A, meta_A, x_TD)
        return x_local, src.n.local_experts[0], (src, chunk)

    def combine(self, y_local: torch.Tensor, handle: tuple, out_dtype: torch.dtype) -> torch.Tensor:
        """Expert outputs back through the relays to their tokens, weighted and summed: [M, D] -> [T, D]."""
        src, chunk = handle
        y_rows = all_to_all(self._depart(y_local, chunk), src.n.a_send[0], src.n.a_recv[0], self.rail)
        return self._finish(src, y_rows, out_dtype)

    def dispatch_compute_combine(self, x_TD: torch.Tensor, plan: DispatchPlan,
                                 experts: Callable[[torch.Tensor, list[int]], torch.Tensor],
                                 out_dtype: torch.dtype) -> torch.Tensor:
        """dispatch -> experts -> combine through the relays, chunk by chunk: [T, D] -> [T, D]."""
        C = self.overlap_degree
        src = self._source(x_TD, plan, C)
        n = src.n
        rows_in = [start_exchange(src.x_send[src.row_starts[c]:src.row_starts[c + 1]], n.a_recv[c], n.a_send[c],
                                  self.rail) for c in range(C)]
        meta_in = [start_exchange(src.meta[src.meta_starts[c]:src.meta_starts[c + 1]], n.w_recv[c], n.w_send[c],
                                  self.rail, grad_columns=1) for c in range(C)]
        returning = []
        for c in range(C):
            x_A = wait_exchange(rows_in[c], n.a_recv[c], n.a_send[c], self.rail)
            meta_A = wait_exchange(meta_in[c], n.w_recv[c], n.w_send[c], self.rail)
            x_local, chunk = self._arrive(src, c, x_A, meta_A, x_TD)
            y_rows = self._depart(experts(x_local, n.local_experts[c]), chunk)
            returning.append(start_exchange(y_rows, n.a_send[c], n.a_recv[c], self.rail))
        y_rows = torch.cat([wait_exchange(returning[c], n.a_send[c], n.a_recv[c], self.rail) for c in range(C)])
        return self._finish(src, y_rows, out_dtype)

    def _source(self, x_TD: torch.Tensor, plan: DispatchPlan, C: int) -> _Source:
        """The source's side up to the exchanges: the counts exchange (the one host sync), then the
        rows chunk-major (chunk, node, token), so each chunk's rows are one slice in relay order,
        and the assignments' (weight, row) pairs in (chunk, node, expert) order, each row index
        counted inside its (chunk, node) segment."""
        R, G, B, E = self.group_size, self.ranks_per_node, self.num_nodes, self.num_experts
        T, K, dev = plan.num_tokens, plan.num_assignments, x_TD.device
        lo, hi = self.node_experts[self.node]
        NE = hi - lo
        look = self._lookup(dev, C)
        self.last_degree = C

        # On the device, before the host knows anything: for each assignment (in the plan's expert
        # order; past the kept ones: node B, dropped), its expert, its node and the row of its
        # (node, token) pair inside the node's segment, that row's chunk, and the kept assignments
        # per (chunk, expert).
        A = plan.order_A.numel()
        expert_pos = torch.searchsorted(torch.cumsum(plan.counts_E, 0), torch.arange(A, device=dev), right=True)
        node_pos = look["node_of_expert"].index_select(0, expert_pos)  # B: not kept
        present, rows_B, row_pos = _pair_rows(node_pos, plan.order_A // K, B, T)
        cuts_BC1 = chunk_cuts(rows_B, C)
        rows_CB = (cuts_BC1[:, 1:] - cuts_BC1[:, :-1]).t()
        chunk_pos = chunk_of(cuts_BC1, node_pos.clamp(max=B - 1), row_pos)
        counts_CE = _count_per_chunk_expert(expert_pos, chunk_pos, E, C)
        send_counts = torch.cat([counts_CE, rows_CB.reshape(-1)]).index_select(0, look["payload"])
        recv_counts = send_counts.new_empty(R * C * (NE + 1))
        dist.all_to_all_single(recv_counts, send_counts, [C * (NE + 1)] * R,
                               [C * (b - a + 1) for r in range(R) for a, b in [self.node_experts[r // G]]],
                               group=self.group)
        recv_RCX = recv_counts.view(R, C, NE + 1)
        counts_flat, rows_flat, recv_flat = host_ints(counts_CE, rows_CB, recv_RCX)  # the layer's one host sync
        n = self._host_counts(counts_flat, rows_flat, recv_flat, C)
        dtype = wire_dtype(x_TD, self.a2a_dtype)
        self._count(n, x_TD.shape[-1] * dtype.itemsize, plan.weights_A.dtype.itemsize)

        N, num_rows = sum(counts_flat), sum(rows_flat)
        kept = plan.kept(N)
        index_dtype = _INDEX_BITS.get(kept.weights_N.dtype)
        if index_dtype is None:
            raise ValueError(f"node-aware dispatch carries router weights in fp32 or fp64, got {kept.weights_N.dtype}")
        node_N, chunk_N = node_pos[:N], chunk_pos[:N]
        row_N = row_pos[:N] - cuts_BC1.index_select(0, node_N).gather(1, chunk_N.unsqueeze(1)).squeeze(1)
        send_order = torch.argsort((chunk_N * B + node_N) * E + expert_pos[:N], stable=True)
        meta = torch.stack([kept.weights_N.index_select(0, send_order),
                            row_N.index_select(0, send_order).to(index_dtype).view(kept.weights_N.dtype)], dim=1)
        token_row = _rows_chunk_major(present, rows_B, cuts_BC1, num_rows, T)
        return _Source(n, x_TD.index_select(0, token_row).to(dtype), meta, token_row,
                       [0, *accumulate(sum(n.a_send[c]) for c in range(C))],
                       [0, *accumulate(sum(n.w_send[c]) for c in range(C))], recv_RCX, look, index_dtype, T)

    def _arrive(self, src: _Source, c: int, x_A: torch.Tensor, meta_A: torch.Tensor, x_TD: torch.Tensor
                ) -> tuple[torch.Tensor, _Chunk]:
        """Chunk c from its arrival at the relay to this rank's expert rows: forward the assignments
        to their experts' ranks of this node (stage B), then, as receiver, group what the relays sent
        by local expert. Returns the rows [M, D] and what ``_depart`` needs."""
        B, L, dev, n, look = self.num_nodes, self.num_local, x_A.device, src.n, src.look
        recv_RX = src.recv_RCX[:, c]
        NE = recv_RX.shape[1] - 1
        src_RX = recv_RX.index_select(0, look["relayed"])  # [B, NE + 1]: what each relayed source sent
        src_assign, src_rows = src_RX[:, :NE].sum(dim=1), src_RX[:, NE]
        n_in = sum(n.w_recv[c])
        src_n = torch.repeat_interleave(torch.arange(B, device=dev), src_assign, output_size=n_in)
        index_n = meta_A[:, 1].detach().contiguous().view(src.index_dtype).long()
        row_n = index_n + (torch.cumsum(src_rows, 0) - src_rows).index_select(0, src_n)
        expert_n = torch.repeat_interleave(torch.arange(NE, device=dev).repeat(B), src_RX[:, :NE].reshape(-1),
                                           output_size=n_in)
        # Grouped by the owning rank (then source, then expert): the order each receiver expects.
        forward_order = torch.argsort(look["owner"].index_select(0, expert_n), stable=True)
        relay_row = row_n.index_select(0, forward_order)
        x_B = all_to_all(x_A.index_select(0, relay_row), n.b_recv[c], n.b_send[c], self.node_group)
        # Receiver: rows arrive [relay g][source node b][local expert].
        arrival_RL = recv_RX.index_select(0, look["arrival"])[:, self.local_first:self.local_first + L]
        x_local, local_order_M = group_received(x_B, arrival_RL, received_compute_dtype(x_TD))
        weights = meta_A[:, 0].index_select(0, forward_order)
        return x_local, _Chunk(relay_row, weights, local_order_M, x_A.shape[0], x_A.dtype, n.b_send[c], n.b_recv[c])

    def _depart(self, y_local: torch.Tensor, chunk: _Chunk) -> torch.Tensor:
        """This rank's expert outputs back to the relays (stage B back), each relayed row's weighted
        outputs summed there (fp32): [M, D] -> [rows of the chunk at this relay, D] in the wire dtype."""
        y_B = ungroup(y_local, chunk.local_order_M, chunk.wire_dtype)
        y_relay = all_to_all(y_B, chunk.b_send, chunk.b_recv, self.node_group)
        acc = torch.promote_types(y_relay.dtype, chunk.weights.dtype)
        return sum_rows(y_relay, chunk.relay_row, chunk.num_rows, acc, chunk.wire_dtype, chunk.weights)

    def _finish(self, src: _Source, y_rows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The summed rows back at the source (chunk-major, as sent) -> [T, D], one sum per token."""
        acc = torch.promote_types(y_rows.dtype, src.meta.dtype)
        return sum_rows(y_rows, src.token_row, src.num_tokens, acc, out_dtype)

    def _host_counts(self, counts_flat: list[int], rows_flat: list[int], recv_flat: list[int], C: int) -> _Counts:
        """Every split size of the dispatch, per chunk, from the counts exchange's host ints:
        ``counts_flat`` [C*E] and ``rows_flat`` [C*B] this rank sends (as a source), ``recv_flat``
        [R, C, NE + 1] what every source sent this node (the module docstring works an example)."""
        R, G, B, E = self.group_size, self.ranks_per_node, self.num_nodes, self.num_experts
        NE, L = self.node_experts[self.node][1] - self.node_experts[self.node][0], self.num_local
        relayed = [b * G + self.local_index for b in range(B)]  # the sources this rank relays for
        owner, mine = self.owner_bounds, (self.local_first, self.local_first + L)

        def assigned(s: int, c: int, lo: int = 0, hi: int = NE) -> int:
            """Assignments source s sent in chunk c for this node's experts lo..hi-1 (node numbering)."""
            at = (s * C + c) * (NE + 1)
            return sum(recv_flat[at + lo:at + hi])

        def rows(s: int, c: int) -> int:
            """Stage A rows source s sent in chunk c to this node."""
            return recv_flat[(s * C + c) * (NE + 1) + NE]

        chunks = range(C)
        return _Counts(
            a_send=[rows_flat[c * B:(c + 1) * B] for c in chunks],
            a_recv=[[rows(s, c) for s in relayed] for c in chunks],
            w_send=[[sum(counts_flat[c * E + lo:c * E + hi]) for lo, hi in self.node_experts] for c in chunks],
            w_recv=[[assigned(s, c) for s in relayed] for c in chunks],
            b_send=[[sum(assigned(s, c, owner[h], owner[h + 1]) for s in relayed) for h in range(G)] for c in chunks],
            b_recv=[[sum(assigned(b * G + g, c, *mine) for b in range(B)) for g in range(G)] for c in chunks],
            local_experts=[[sum(assigned(s, c, mine[0] + e, mine[0] + e + 1) for s in range(R)) for e in range(L)]
                           for c in chunks])

    def _count(self, n: _Counts, row_bytes: int, weight_bytes: int) -> None:
        """Add one layer call's inter-node payload to ``inter_node_bytes``, from the split sizes: the
        stage A rows and (weight, index) pairs sent to relays on other nodes, the summed rows this
        rank sends back to sources on other nodes as a relay, and in backward the rows again in the
        other direction and, as a relay, the received weights' gradients (one value per pair: the
        index has none). Stage B stays inside the node."""
        C, B = len(n.a_send), self.num_nodes
        remote = [(c, b) for c in range(C) for b in range(B) if b != self.node]
        rows = sum(n.a_send[c][b] + n.a_recv[c][b] for c, b in remote)
        pairs_out, pairs_in = sum(n.w_send[c][b] for c, b in remote), sum(n.w_recv[c][b] for c, b in remote)
        self.inter_node_bytes += 2 * rows * row_bytes + (2 * pairs_out + pairs_in) * weight_bytes


def _pair_rows(node_A: torch.Tensor, token_A: torch.Tensor, num_nodes: int, num_tokens: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows stage A sends: one per (node, token) pair with a kept assignment on that node,
    node-major, in token order. ``node_A``/``token_A`` [A]: each assignment's node (``num_nodes``
    for a dropped one) and token. Returns ``present`` bool [B*T] (pair b*T + t has a row),
    ``rows_B`` [B] (rows per node) and ``row_A`` [A]: the row of each assignment's pair inside
    its node's segment (meaningless for dropped ones), all on the device."""
    B, T = num_nodes, num_tokens
    key_A = node_A * T + token_A  # a dropped assignment's key lies past B*T and is cut off
    present = torch.zeros((B + 1) * T, dtype=torch.bool, device=node_A.device).scatter_(0, key_A, True)[:B * T]
    rows_B = present.view(B, T).sum(dim=1)
    row_of_key = torch.cumsum(present, 0).sub_(1)  # the pair's row counted over all nodes
    node_start_B = torch.cumsum(rows_B, 0) - rows_B
    row_A = row_of_key.index_select(0, key_A.clamp(max=max(B * T - 1, 0))) \
        - node_start_B.index_select(0, node_A.clamp(max=B - 1))
    return present, rows_B, row_A


def _count_per_chunk_expert(expert_A: torch.Tensor, chunk_A: torch.Tensor, num_experts: int, degree: int
                            ) -> torch.Tensor:
    """int64 [C*E]: kept assignments per (chunk, expert), chunk-major (``expert_A`` = E: dropped)."""
    E, C = num_experts, degree
    key_A = torch.where(expert_A < E, chunk_A * E + expert_A, torch.full_like(expert_A, C * E))
    return torch.zeros(C * E + 1, dtype=torch.int64, device=expert_A.device).scatter_add_(
        0, key_A, torch.ones_like(key_A))[:C * E]


def _rows_chunk_major(present: torch.Tensor, rows_B: torch.Tensor, cuts_BC1: torch.Tensor, num_rows: int,
                      num_tokens: int) -> torch.Tensor:
    """int64 [rows]: the token of each stage A row, rows ordered (chunk, node, token): chunk c of
    every node's segment in turn, so each chunk's rows are one slice in relay order."""
    B, T, dev = rows_B.numel(), num_tokens, rows_B.device
    token_row = torch.argsort(~present, stable=True)[:num_rows] % max(T, 1)  # node-major
    node_row = torch.repeat_interleave(torch.arange(B, device=dev), rows_B, output_size=num_rows)
    local_row = torch.arange(num_rows, device=dev) - (torch.cumsum(rows_B, 0) - rows_B).index_select(0, node_row)
    chunk_row = chunk_of(cuts_BC1, node_row, local_row)
    return token_row.index_select(0, torch.argsort(chunk_row * B + node_row, stable=True))
