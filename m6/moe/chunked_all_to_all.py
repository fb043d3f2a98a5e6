"""The expert-parallel exchange in chunks, overlapped with the expert compute (Tutel-style, inside
one micro-batch): chunk i+1's rows travel while the local experts compute chunk i, chunk i's outputs
travel back while chunk i+1 computes, and backward runs the reverse exchanges the same way.

Shape legend: R ranks in the expert-parallel group, L local experts, C chunks (the overlap
degree), N rows this rank sends, M rows it receives, D d_model.

Chunking: the rows this rank sends to rank r (its segment, grouped by local expert of r) are cut
into C consecutive parts, part c being rows [n*c//C, n*(c+1)//C) of a segment of n rows; chunk c
is part c of every segment, so each chunk is itself an uneven all-to-all. Sender and receiver
compute the same cut from the same count (the counts exchange), so no extra exchange is needed.
Every rank issues 2*C exchanges per forward (and 2*C in backward) in the same order, zero-row
chunks included, whatever the routing.

Asynchronous exchanges as autograd Functions: ``_StartExchange`` issues
``all_to_all_single(async_op=True)`` into a new buffer and ``_WaitExchange`` waits for it; the
backward of the wait starts the reverse exchange and the backward of the start waits for it, so
the autograd engine runs the expert backward of other chunks while the gradients travel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from m6.moe.dispatch import group_received, ungroup

# auto: one chunk per this many bytes that the busiest rank sends, at most AUTO_MAX_DEGREE chunks.
# Below ~2 MiB per chunk an exchange's fixed cost (launch, handshake: tens of microseconds) is no
# longer small against its transfer time even on a 50 GB/s link, so cutting finer would add more
# latency than it hides.
AUTO_CHUNK_BYTES = 2 * 1024 * 1024
AUTO_MAX_DEGREE = 4


def auto_overlap_degree(max_rows_sent: int, row_bytes: int) -> int:
    """The degree ``a2a_overlap_degree: auto`` picks: one chunk per AUTO_CHUNK_BYTES that the
    busiest rank of the group sends (``max_rows_sent`` rows of ``row_bytes``), 1 to AUTO_MAX_DEGREE."""
    return max(1, min(AUTO_MAX_DEGREE, (max_rows_sent * row_bytes) // AUTO_CHUNK_BYTES))


def chunk_bounds(num_rows: int, degree: int) -> list[int]:
    """Cut points of a segment of ``num_rows`` rows into ``degree`` parts: part c is
    rows [bounds[c], bounds[c+1]) (sizes differ by at most one; empty parts are legal)."""
    return [num_rows * c // degree for c in range(degree + 1)]


def chunk_cuts(rows_S: torch.Tensor, degree: int) -> torch.Tensor:
    """int64 [S, C + 1] (device): ``chunk_bounds`` of every segment at once, ``rows_S`` [S] rows each."""
    return rows_S.unsqueeze(1) * torch.arange(degree + 1, device=rows_S.device) // degree


def chunk_of(cuts_SC1: torch.Tensor, seg_N: torch.Tensor, pos_N: torch.Tensor) -> torch.Tensor:
    """int64 [N] (device): the chunk of each row, from its segment ``seg_N`` and its position in it
    ``pos_N``: how many of the segment's inner cut points (``chunk_cuts``) lie at or before it."""
    return (cuts_SC1[:, 1:-1].index_select(0, seg_N) <= pos_N.unsqueeze(1)).sum(dim=1)


class _ExchangeBox:
    """The in-flight exchange of one chunk, shared by its start and wait nodes (forward and backward)."""

    def __init__(self, grad_columns: Optional[int] = None) -> None:
        self.work: Optional[dist.Work] = None
        self.buffers: tuple = ()  # kept alive until the wait: the exchange reads and writes them
        # Rows of several columns of which only the first ``grad_columns`` carry a gradient: backward
        # sends those alone (the others' gradient is zero by construction, so not sent).
        self.grad_columns = grad_columns


def _start(out: torch.Tensor, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
           box: _ExchangeBox) -> None:
    x = x.contiguous()
    box.work = dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)
    box.buffers = (out, x)


def _wait(box: _ExchangeBox) -> None:
    assert box.work is not None, "an exchange was waited for before it was started"
    box.work.wait()
    box.work, box.buffers = None, ()


class _StartExchange(torch.autograd.Function):
    """Starts sending ``x`` (rows ``in_splits[r]`` to rank r); returns the receive buffer, valid
    only after ``_WaitExchange``. Backward: waits for the reverse exchange the wait's backward
    began and returns what it brought (the gradient reaching it through the buffer only orders it)."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group, box: _ExchangeBox):
        ctx.box, ctx.width = box, x.shape[-1] if x.dim() == 2 else None
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        _start(out, x, out_splits, in_splits, group, box)
        return out

    @staticmethod
    def backward(ctx, _ordering_grad):
        grad_x = ctx.box.buffers[0]
        _wait(ctx.box)
        if ctx.box.grad_columns is not None:  # the columns without a gradient: zeros, made here
            grad_x = torch.nn.functional.pad(grad_x, (0, ctx.width - ctx.box.grad_columns))
        return grad_x, None, None, None, None


class _WaitExchange(torch.autograd.Function):
    """Waits for the exchange ``box`` holds; ``received`` is its (now filled) buffer. Backward:
    starts the reverse exchange of the gradient (its wait is in ``_StartExchange.backward``)."""

    @staticmethod
    def forward(ctx, received, out_splits: list[int], in_splits: list[int], group, box: _ExchangeBox):
        ctx.out_splits, ctx.in_splits, ctx.group, ctx.box = out_splits, in_splits, group, box
        _wait(box)
        return received.view_as(received)

    @staticmethod
    def backward(ctx, grad):
        sent = grad if ctx.box.grad_columns is None else grad[:, :ctx.box.grad_columns]
        back = sent.new_empty((sum(ctx.in_splits),) + tuple(sent.shape[1:]))
        _start(back, sent, ctx.in_splits, ctx.out_splits, ctx.group, ctx.box)
        # The gradient of the receive buffer is not needed: a placeholder of its shape links this
        # node to the start's backward, which waits and returns ``back``.
        return grad, None, None, None, None


def start_exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
                   grad_columns: Optional[int] = None) -> tuple[torch.Tensor, _ExchangeBox]:
    """Begin an uneven all-to-all of ``x`` (autograd-aware); pass the result to ``wait_exchange``.
    ``grad_columns``: ``x`` is [rows, columns] and only its first ``grad_columns`` columns have a
    gradient; backward exchanges those alone."""
    box = _ExchangeBox(grad_columns)
    return _StartExchange.apply(x, out_splits, in_splits, group, box), box


def wait_exchange(pending: tuple[torch.Tensor, _ExchangeBox], out_splits: list[int], in_splits: list[int],
                  group) -> torch.Tensor:
    """The rows ``start_exchange`` (same splits) received, once they have arrived."""
    received, box = pending
    return _WaitExchange.apply(received, out_splits, in_splits, group, box)


@dataclass(frozen=True)
class ChunkPlan:
    """The host-side cut of one dispatch into C chunks (host ints from the counts exchange: the
    split sizes the exchanges and the expert GEMMs need).

    send[c][r], recv[c][r]: rows of chunk c sent to / received from rank r.
    recv_counts[c]: rows of chunk c from each source rank for each local expert, row-major [R, L].
    local_experts[c][l]: rows of chunk c for local expert l (all sources).
    """

    send: list[list[int]]
    recv: list[list[int]]
    recv_counts: list[list[int]]
    local_experts: list[list[int]]

    @property
    def degree(self) -> int:
        return len(self.send)


def _segment_expert_counts(expert_counts: list[int], lo: int, hi: int) -> list[int]:
    """Rows of each expert inside rows [lo, hi) of a segment grouped by expert with these counts."""
    out, start = [], 0
    for n in expert_counts:
        out.append(max(0, min(hi, start + n) - max(lo, start)))
        start += n
    return out


def plan_chunks(send_RL: list[int], recv_RL: list[int], num_ranks: int, num_local: int, degree: int) -> ChunkPlan:
    """Cut the rows given by the counts exchange (``send_RL``/``recv_RL``: row-major [R, L] rows
    sent to / received from each rank for each of its / this rank's local experts) into ``degree`` chunks."""
    R, L = num_ranks, num_local
    send_cut = [chunk_bounds(sum(send_RL[r * L:(r + 1) * L]), degree) for r in range(R)]
    recv_cut = [chunk_bounds(sum(recv_RL[r * L:(r + 1) * L]), degree) for r in range(R)]
    send, recv, recv_counts, local_experts = [], [], [], []
    for c in range(degree):
        send.append([send_cut[r][c + 1] - send_cut[r][c] for r in range(R)])
        recv.append([recv_cut[r][c + 1] - recv_cut[r][c] for r in range(R)])
        counts = [n for r in range(R)
                  for n in _segment_expert_counts(recv_RL[r * L:(r + 1) * L], recv_cut[r][c], recv_cut[r][c + 1])]
        recv_counts.append(counts)
        local_experts.append([sum(counts[r * L + e] for r in range(R)) for e in range(L)])
    return ChunkPlan(send, recv, recv_counts, local_experts)


def _chunk_of_rows(counts_RL: torch.Tensor, degree: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped [rank][expert] with ``counts_RL`` [R, L] (on the device): each row's rank
    segment and its chunk (the cut of ``chunk_bounds``), both int64 [num_rows], with no host sync."""
    R = counts_RL.shape[0]
    seg_R = counts_RL.sum(dim=1)
    seg_N = torch.repeat_interleave(torch.arange(R, device=counts_RL.device), seg_R, output_size=num_rows)
    pos_N = torch.arange(num_rows, device=counts_RL.device) - (torch.cumsum(seg_R, 0) - seg_R).index_select(0, seg_N)
    return seg_N, chunk_of(chunk_cuts(seg_R, degree), seg_N, pos_N)


def chunk_major_order(send_counts_RL: torch.Tensor, degree: int, num_rows: int) -> torch.Tensor:
    """int64 [N]: the rows of a send buffer grouped [destination rank][expert] reordered chunk-major
    (chunk 0's rows for ranks 0..R-1, then chunk 1's, ...), computed on the device."""
    seg_N, chunk_N = _chunk_of_rows(send_counts_RL, degree, num_rows)
    return torch.argsort(chunk_N * send_counts_RL.shape[0] + seg_N, stable=True)


def chunk_counts(recv_counts_RL: torch.Tensor, degree: int, chunk: int) -> torch.Tensor:
    """int64 [R, L] (device): rows of ``chunk`` from each source rank for each local expert, from the
    received counts [R, L] (the device twin of ``ChunkPlan.recv_counts``, so no host-to-device copy)."""
    cuts_RC1 = chunk_cuts(recv_counts_RL.sum(dim=1), degree)
    lo_R1, hi_R1 = cuts_RC1[:, chunk:chunk + 1], cuts_RC1[:, chunk + 1:chunk + 2]
    start_RL = torch.cumsum(recv_counts_RL, 1) - recv_counts_RL
    return (torch.minimum(hi_R1, start_RL + recv_counts_RL) - torch.maximum(lo_R1, start_RL)).clamp_min(0)


ExpertCompute = Callable[[torch.Tensor, list[int]], torch.Tensor]


def exchange_compute_exchange(x_send: torch.Tensor, chunks: ChunkPlan, recv_counts_RL: torch.Tensor,
                              experts: ExpertCompute, compute_dtype: Optional[torch.dtype], group) -> torch.Tensor:
    """The pipeline: ``x_send`` [N, D] rows in chunk-major order (``chunk_major_order``; already in
    the wire dtype) -> the experts' outputs for them, same order, in the wire dtype.
    ``recv_counts_RL`` [R, L] (device): rows received per source rank and local expert, all chunks.

    All C dispatch exchanges are issued at once (they run in order on the group's worker); chunk c
    is computed as soon as it has arrived, and its outputs start back while chunk c+1 computes.
    ``compute_dtype``: what the received rows are cast to before the experts (None: as received).
    """
    starts = [0]
    for c in range(chunks.degree):
        starts.append(starts[-1] + sum(chunks.send[c]))
    pending = [start_exchange(x_send[starts[c]:starts[c + 1]], chunks.recv[c], chunks.send[c], group)
               for c in range(chunks.degree)]
    returning = []
    for c in range(chunks.degree):
        x_recv = wait_exchange(pending[c], chunks.recv[c], chunks.send[c], group)
        x_local, order = group_received(x_recv, chunk_counts(recv_counts_RL, chunks.degree, c), compute_dtype)
        y_recv = ungroup(experts(x_local, chunks.local_experts[c]), order, x_send.dtype)
        returning.append(start_exchange(y_recv, chunks.send[c], chunks.recv[c], group))
    return torch.cat([wait_exchange(returning[c], chunks.send[c], chunks.recv[c], group)
                      for c in range(chunks.degree)])
