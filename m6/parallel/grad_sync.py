"""Bucketed gradient all-reduce overlapped with backward, and the global gradient-norm clip.

Scale: every rank's loss is already normalised by GLOBAL counts (target tokens all-reduced, routing
statistics summed by m6.moe.GlobalRoutingStats), so the gradient of the global loss is the plain SUM of
the ranks' gradients: replicated params over all ranks, expert params over the ranks holding the
same experts (the expert-data-parallel group). The other EP ranks' tokens already reached these
experts through the all-to-all backward. No division by the world or EP size anywhere, which is
where expert gradients come out off by the EP size in stacks that average.

Order: all-reduces are matched by their order on each group, so every rank must issue the same
ones in the same order, whatever its graph reaches (a custom model's branch, a modality missing
from one rank's batch). Buckets are fixed at construction (checked equal on every rank) and launch
strictly in bucket order: a bucket goes once it and every bucket before it are complete. A
parameter the step's graph does not reach counts as complete at ``prepare(loss)`` and contributes
zeros; without ``prepare`` it completes at ``finish()``, and so does every bucket after it.

Memory: a bucket's flat copy lives from its launch until it is drained (waited for, the sums copied
back into ``.grad``, the copy freed, the params handed to ``on_grads_final``: offload streams them
to the host and frees the device gradients). Draining is in bucket order; one that has completed
is drained at the next launch, and launching one more than ``max_in_flight`` first waits for the
oldest. That wait inside backward is safe only when every rank's graph reaches the same parameters:
then every rank completes bucket k at the same point of its backward, so the rank waited for never
needs the waiting one in a later collective first (an earlier MoE layer's all-to-all). ``prepare``
checks it with one small all-reduce; otherwise (or without ``prepare``) backward drains only what
has completed, and ``finish()`` the rest.
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from m6.parallel.plan import ShardedModel


class GradientLayoutError(ValueError):
    """The ranks' gradient buckets differ (parameters, shapes, dtypes, groups): their all-reduces
    could not match. Raised on every rank at construction, before any gradient is reduced."""


@dataclass
class _Bucket:
    """Parameters reduced together over ``group`` as one flat tensor of ``dtype``."""

    params: list[nn.Parameter]
    names: list[str]
    group: object
    group_name: str  # "world" (replicated params: the data-parallel ranks) or "expert_data" (expert params)
    group_size: int
    dtype: torch.dtype
    ready: int = 0  # params whose gradient is final for this step (or that the graph does not reach)
    flat: torch.Tensor | None = None  # alive from launch to drain
    work: object = None

    nominal_bytes: float = 0.0  # the size the bucket is cut by (the same on every rank; see _make_buckets)

    @property
    def complete(self) -> bool:
        return self.ready == len(self.params)

    def signature(self) -> tuple:
        """What must be equal on every rank of the bucket's group for the all-reduces to match."""
        return (self.group_name, self.group_size, str(self.dtype),
                tuple((n, tuple(p.shape)) for n, p in zip(self.names, self.params)))

    def order_signature(self) -> tuple:
        """What must be equal on every rank of the job: the buckets' sequence, shapes aside (with
        uneven experts per rank an expert bucket's shapes differ between EP ranks)."""
        return (self.group_name, self.group_size, str(self.dtype), tuple(self.names))


def _describe(signature: tuple | None) -> str:
    if signature is None:
        return "nothing (fewer buckets)"
    group, size, dtype, params = signature
    return f"{group} group of {size}, {dtype}, " + ", ".join(f"{n} {list(s)}" for n, s in params)


def _reached_params(loss: torch.Tensor) -> set[int]:
    """ids of the leaf tensors ``loss``'s autograd graph reaches (their gradients will be written)."""
    reached, seen, stack = set(), set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: the leaf it writes
        if variable is not None:
            reached.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return reached


@dataclass
class GradientSync:
    """Sums gradients over their groups in buckets, launched in bucket order during backward.

    Set ``enabled = False`` for the micro-batches of an accumulation step that are not the last,
    so only the final backward communicates; call ``prepare(loss)`` before that backward (it
    learns which parameters the graph reaches) and ``finish()`` after it. ``on_grads_final``
    (e.g. CPU offload streaming gradients to the host) receives params once their gradients are
    final: each parameter as backward writes it when its group is this process alone (one
    process, or experts no other rank holds), a bucket's params when it is drained otherwise, so
    nothing moves an unreduced gradient. With ``stream_local`` the local parameters go to
    ``on_grads_final`` in the backwards that do not communicate too (the training micro-batches
    before the last: offload sums them on the host); trial backwards (recompute check, speed
    measurement) leave it off and keep their gradients. One process is the same object with
    nothing to reduce (and an unused parameter keeps no gradient, as without the sync).
    """

    sharded: ShardedModel
    bucket_bytes: int
    on_grads_final: Optional[Callable[[list[nn.Parameter]], None]] = None
    max_in_flight: int = 2  # buckets launched and not yet drained (each holds a flat copy)
    buckets: list[_Bucket] = field(default_factory=list)
    enabled: bool = True
    stream_local: bool = False
    # The tensor whose .grad holds a parameter's gradient for the all-reduce (train.weight_copy=per_step:
    # the fp32 master, which a hook registered before this one fills); None: the parameter itself.
    grad_holder: Optional[Callable[[nn.Parameter], torch.Tensor]] = None
    # memory.offload=zero with parallel.shard=optimizer (m6.memory.zero_partition): the buckets
    # reduce-scatter, each rank receiving its dim-0 chunk of every bucket parameter, handed with
    # the param to ``on_chunks_final`` (the full device gradient is dropped); None: all-reduce.
    partition: object = None
    on_chunks_final: Optional[Callable[[list[tuple[nn.Parameter, torch.Tensor]]], None]] = None

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"GradientSync.max_in_flight must be >= 1, got {self.max_in_flight}")
        self._local: set[int] = set()  # params whose group is this process alone
        self._holder = self.grad_holder or (lambda p: p)
        self._make_buckets()
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        # The hook reaches this object through a weak reference: a strong one would close a cycle
        # parameter -> hook -> GradientSync -> model -> parameter that runs through autograd's C++
        # side, which Python's gc cannot collect, so a dropped Trainer would keep its model alive.
        on_ready = weakref.WeakMethod(self._on_grad_ready)

        def hook(param: nn.Parameter) -> None:
            method = on_ready()
            if method is not None:
                method(param)

        for _, p in self._trainable():
            p.register_post_accumulate_grad_hook(hook)
        if self.sharded.groups.world is not None and self.sharded.groups.layout.world_size > 1:
            self._check_same_layout()
        self._in_flight: deque[_Bucket] = deque()
        self._reset()

    def _trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.sharded.model.named_parameters() if p.requires_grad]

    def _make_buckets(self) -> None:
        groups, layout = self.sharded.groups, self.sharded.groups.layout
        experts = {id(p) for p in self.sharded.expert_params.values()}
        # Reverse registration order approximates the order backward produces gradients; both
        # groups' buckets interleave in that order, so a bucket's predecessors tend to be complete
        # by the time it is, and launching in bucket order rarely holds one back.
        open_buckets: dict[tuple, _Bucket] = {}
        for name, p in reversed(self._trainable()):
            if id(p) in experts:
                group, group_name, size = groups.expert_data, "expert_data", layout.expert_data_parallel_size
            else:
                # the data-parallel ranks: all of them but at tensor parallel (ProcessGroups.data)
                group, group_name, size = groups.data, "world", layout.data_parallel_size
            if size == 1:
                self._local.add(id(p))
                continue
            dtype = self._holder(p).dtype
            key = (group_name, dtype)
            bucket = open_buckets.setdefault(key, _Bucket([], [], group, group_name, size, dtype))
            bucket.params.append(p)
            bucket.names.append(name)
            # Expert tensors are cut by their even-layout size: with uneven experts per rank
            # (parallel.balance) every rank then closes its buckets at the same parameters, so all
            # ranks launch the world group's buckets in the same place among the expert ones.
            bucket.nominal_bytes += (p.numel() / p.shape[0] * layout.num_experts / layout.expert_parallel_size
                                     if id(p) in experts else p.numel()) * dtype.itemsize
            if bucket.nominal_bytes >= self.bucket_bytes:
                self.buckets.append(open_buckets.pop(key))
        self.buckets.extend(open_buckets.values())

    def _check_same_layout(self) -> None:
        """Every rank must hold the same buckets in the same order (one collective, at construction):
        the same sequence on every rank, the same shapes on the ranks holding the same experts (rank
        r and the first rank of its expert-data-parallel group, r % EP)."""
        mine = [(b.order_signature(), b.signature()) for b in self.buckets]
        world = self.sharded.groups.data  # the ranks holding the same parameters (a pipeline stage's at pp > 1)
        everyone: list = [None] * dist.get_world_size(world)
        dist.all_gather_object(everyone, mine, group=world)
        ep = self.sharded.groups.layout.expert_parallel_size
        for rank, theirs in enumerate(everyone):
            for what, ref in ((0, 0), (1, rank % ep)):
                a, b = [x[what] for x in theirs], [x[what] for x in everyone[ref]]
                if a == b:
                    continue
                i = next(i for i in range(max(len(a), len(b))) if i >= len(a) or i >= len(b) or a[i] != b[i])
                at = lambda buckets: buckets[i][1] if i < len(buckets) else None  # noqa: E731
                raise GradientLayoutError(
                    f"gradient buckets differ between ranks: rank {rank}'s bucket {i} holds {_describe(at(theirs))}; "
                    f"rank {ref}'s holds {_describe(at(everyone[ref]))} ({len(a)} vs {len(b)} buckets). Every "
                    f"rank must build the same model (parameter names, shapes, dtypes, requires_grad) with the same "
                    f"parallel.bucket_size_mb, or their all-reduces would not match")

    def _reset(self) -> None:
        for b in self.buckets:
            b.ready, b.flat, b.work = 0, None, None
        self._next = 0  # the first bucket not launched yet
        self._may_wait = False  # whether a launch may wait for the oldest bucket inside backward
        self._device: torch.device | None = None

    # ---- one synced backward ------------------------------------------------------------------
    def prepare(self, loss: torch.Tensor) -> None:
        """Before the synced backward of ``loss``: parameters its graph does not reach count as
        complete now (zeros); one all-reduce tells whether every rank's graph reaches the same
        ones, which is when waiting for a bucket inside backward is safe."""
        if not self.enabled or not self.buckets:
            return
        reached = _reached_params(loss)
        self._device = loss.device
        counts = torch.tensor([id(p) in reached for b in self.buckets for p in b.params],
                              dtype=torch.int32, device=loss.device)
        world = self.sharded.groups.data
        dist.all_reduce(counts, group=world)  # per param: how many ranks' graphs reach it
        size = dist.get_world_size(world)
        self._may_wait = bool(((counts == 0) | (counts == size)).all())
        for b in self.buckets:
            b.ready += sum(id(p) not in reached for p in b.params)
        self._launch_complete()

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not (self.enabled or (self.stream_local and id(param) in self._local)):
            return
        if id(param) in self._local:
            # Nothing to add up: final as soon as backward wrote it, one parameter at a time (so
            # offload frees each device gradient right away, not a bucket's worth).
            if self.on_grads_final is not None:
                self.on_grads_final([param])
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        assert bucket.ready <= len(bucket.params), "a parameter's gradient was final twice in one backward"
        if bucket.complete:
            self._launch_complete()

    def _launch_complete(self) -> None:
        """Launch, in bucket order, every bucket that is complete with all buckets before it."""
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        self._drain(wait=False)
        while self._may_wait and len(self._in_flight) >= self.max_in_flight:
            self._drain_oldest()
        holders = [self._holder(p) for p in bucket.params]
        for h in holders:
            if h.grad is None:  # unused in this step: contributes zeros, keeps collectives aligned
                h.grad = torch.zeros_like(h)
        grads = [h.grad.reshape(-1) for h in holders]
        if self._device is not None:
            grads = [g.to(self._device) for g in grads]
        if self.partition is not None:
            self._launch_scatter(bucket, grads)
        else:
            bucket.flat = torch.cat(grads)
            bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)
        self._in_flight.append(bucket)

    def _launch_scatter(self, bucket: _Bucket, grads: list[torch.Tensor]) -> None:
        """The bucket laid out rank-major (for each rank r, every param's dim-0 chunk r padded to
        the chunk size), so ``reduce_scatter_tensor`` hands rank r exactly its chunks, back to back.
        Each gradient is copied into its columns of the layout and dropped at once: from here on
        the device holds the bucket's layout, not its gradients (the reduced chunks are 1/n of it)."""
        per_rank = [self.partition.of(p).chunk_rows * (p.numel() // p.shape[0]) for p in bucket.params]
        n = bucket.group_size
        layout = grads[0].new_empty((n, sum(per_rank)))
        offset = 0
        for p, g, width in zip(bucket.params, grads, per_rank):
            chunk, columns = self.partition.of(p), layout[:, offset:offset + width]
            if chunk.rows == n * chunk.chunk_rows:  # no padding: the gradient is already rank-major
                columns.copy_(g.view(n, width))
            else:  # one padded copy of this gradient at a time
                padded = g.new_zeros(n * width)
                padded[:g.numel()] = g
                columns.copy_(padded.view(n, width))
            self._holder(p).grad = None
            offset += width
        bucket.flat = layout.new_empty(sum(per_rank))
        bucket.work = dist.reduce_scatter_tensor(bucket.flat, layout.view(-1), group=bucket.group, async_op=True)

    def _drain(self, wait: bool) -> None:
        """Drain in order the buckets in flight: all (``wait``), or those already reduced."""
        while self._in_flight and (wait or self._in_flight[0].work.is_completed()):
            self._drain_oldest()

    def _drain_oldest(self) -> None:
        bucket = self._in_flight.popleft()
        bucket.work.wait()
        if self.partition is not None:
            self._drain_scatter(bucket)
            return
        offset = 0
        for p in bucket.params:
            n, grad = p.numel(), self._holder(p).grad
            grad.copy_(bucket.flat[offset:offset + n].view_as(grad))
            offset += n
        bucket.flat, bucket.work = None, None  # the flat copy is freed here, not at finish()
        if self.on_grads_final is not None:
            self.on_grads_final(bucket.params)

    def _drain_scatter(self, bucket: _Bucket) -> None:
        """This rank's reduced chunks, each cut to its real rows, to ``on_chunks_final`` (the full
        device gradients were dropped at the launch)."""
        chunks, offset = [], 0
        for p in bucket.params:
            chunk = self.partition.of(p)
            n = chunk.chunk_rows * (p.numel() // chunk.rows)
            padded = bucket.flat[offset:offset + n].view(chunk.chunk_rows, *p.shape[1:])
            chunks.append((p, padded[:chunk.count]))
            offset += n
        bucket.flat, bucket.work = None, None  # the chunks are views of it: alive until offload has copied them
        if self.on_chunks_final is not None:
            self.on_chunks_final(chunks)

    def finish(self) -> None:
        """After the synced backward: launch in order what it did not (parameters it did not
        reach contribute zeros), drain everything, and get ready for the next step."""
        if self.enabled and self.buckets:
            # Past its backward, a rank needs no peer in any other collective before these: waiting is safe.
            self._may_wait = True
            for bucket in self.buckets[self._next:]:
                self._launch(bucket)
            self._drain(wait=True)
        self._reset()


_NORM_ROW = 4096  # elements per row of the sum of squares (see _sum_sq)


def _sum_sq(params: list[nn.Parameter]) -> torch.Tensor:
    """Sum of the squared gradient entries (float64, on the gradients' device).

    Each gradient is viewed as rows of _NORM_ROW elements and reduced with one fused norm per row
    (no squared copy of the gradient; the rows spread over threads), the rows' squares then summed
    in float64. On the host, where offloaded gradients are clipped, that is 2.3x faster than
    ``pow(2).sum()`` and as accurate (5e-9 of a float64 sum); one fused norm over each whole
    gradient, and torch's get_total_norm, accumulate tens of millions of values in fp32 lanes and
    were 1.2e-2 off (bench/results/host_clip-cpu-2core.md, 1 GiB of m6-base-moe gradients).
    """
    return sum_sq_of([p.grad for p in params if p.grad is not None])


def sum_sq_of(grads: list[torch.Tensor], factors: list[float] | None = None) -> torch.Tensor:
    """_sum_sq of plain gradient tensors (float64, on their device); ``factors``: the gradient is
    ``grads[i] * factors[i]`` (an fp16 host buffer stored divided by a power of two)."""
    parts = []
    for i, grad in enumerate(grads):
        if grad.numel() == 0:
            continue
        flat = grad.detach().reshape(-1)
        whole = flat.numel() // _NORM_ROW * _NORM_ROW
        sq = []
        if whole:
            rows = torch.linalg.vector_norm(flat[:whole].view(-1, _NORM_ROW), dim=1, dtype=torch.float32)
            sq.append(rows.double().square().sum())
        if whole < flat.numel():
            sq.append(torch.linalg.vector_norm(flat[whole:], dtype=torch.float32).double().square())
        parts.extend(sq if factors is None or factors[i] == 1.0 else [x * factors[i] ** 2 for x in sq])
    return torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64)


def clip_grad_norm(replicated: list[nn.Parameter], experts: list[nn.Parameter], max_norm: float,
                   expert_group=None, device: torch.device | None = None, grad_scale: float = 1.0,
                   split: list[nn.Parameter] = (), tensor_group=None, pipeline_group=None,
                   uncounted: list[nn.Parameter] = ()) -> float:
    """Clip to the norm of the GLOBAL gradient, counting every expert once; returns that norm.

    Replicated grads are identical on all ranks after sync (counted from this rank); expert grads
    are summed over the expert-parallel group (``expert_group``; None = this process holds every
    expert), which holds each expert exactly once: their expert-data-parallel replicas are
    identical and not added again. Same coefficient formula as torch.nn.utils.clip_grad_norm_.

    ``grad_scale``: the gradients hold the loss scale's multiple (fp16); they are unscaled (divided
    by it) before clipping, as torch.amp.GradScaler.unscale_ before clip_grad_norm_, in the clip's
    one multiply (one pass over the gradients, which matters on the host when offloaded), and the
    returned norm is the unscaled one. A non-finite norm leaves the gradients as they are.

    ``split``: tensor-parallel shards (m6.parallel.tensor_parallel), summed over ``tensor_group``;
    ``replicated`` then holds the rest (whole on every rank of the tensor-parallel group).
    ``pipeline_group``: this rank's pipeline; each stage's squares are summed over it.
    ``uncounted``: clipped like the rest but not in the norm (a copy another rank counts: the tied
    token embedding's on a pipeline's last stage).
    """
    split = list(split)
    total = global_grad_norm(_grads(replicated), _grads(experts), expert_group, device,
                             split_grads=_grads(split), tensor_group=tensor_group,
                             pipeline_group=pipeline_group) / grad_scale
    if math.isfinite(total):  # else not even unscaled: the step is skipped or refused
        coef = clip_coefficient(total, max_norm)
        if coef < 1.0 or grad_scale != 1.0:
            for p in replicated + experts + split + list(uncounted):
                if p.grad is not None:
                    p.grad.detach().mul_(coef / grad_scale)
    return total


def _grads(params: list[nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def global_grad_norm(replicated_grads: list[torch.Tensor], expert_grads: list[torch.Tensor], expert_group=None,
                     device: torch.device | None = None, replicated_factors: list[float] | None = None,
                     expert_factors: list[float] | None = None, split_grads: list[torch.Tensor] = (),
                     tensor_group=None, pipeline_group=None) -> float:
    """The global gradient's norm from these gradient tensors (any float dtype, summed in float64;
    each times its factor where ``*_factors`` are given), counting every expert once (see
    clip_grad_norm) and every tensor-parallel shard once (``split_grads``, this rank's shards,
    summed over ``tensor_group``); at pipeline parallel every stage's squares, summed over
    ``pipeline_group`` (a stage's ranks hold only its parameters)."""
    sq_rep = sum_sq_of(replicated_grads, replicated_factors)
    sq_exp = _group_sum_sq(expert_grads, expert_group, device, expert_factors).to(sq_rep.device)
    if split_grads or tensor_group is not None:
        sq_rep = sq_rep + _group_sum_sq(list(split_grads), tensor_group, device).to(sq_rep.device)
    total = sq_rep + sq_exp
    if pipeline_group is not None and dist.get_world_size(pipeline_group) > 1:
        total = total.to(device or total.device)
        dist.all_reduce(total, group=pipeline_group)
    return float(total.sqrt())


def _group_sum_sq(grads: list[torch.Tensor], group, device: torch.device | None,
                  factors: list[float] | None = None) -> torch.Tensor:
    """Sum of squares of ``grads`` (times ``factors``, see sum_sq_of) over the ranks of ``group``
    (float64; on the compute device ``device`` when reduced: offloaded gradients live on the host,
    and NCCL reduces device tensors only)."""
    sq = sum_sq_of(grads, factors)
    if group is None or dist.get_world_size(group) == 1:
        return sq
    reduced = sq.to(device or sq.device)
    dist.all_reduce(reduced, group=group)
    return reduced


def clip_coefficient(total: float, max_norm: float) -> float:
    """What every clip multiplies the gradients by, from the global norm ``total``:
    torch.nn.utils.clip_grad_norm_'s coefficient; 1 when ``max_norm`` is inf, and 1 for a
    non-finite norm (the gradients are left as they are: the step is skipped or refused)."""
    if not math.isfinite(total) or max_norm == math.inf:
        return 1.0
    return min(1.0, max_norm / (total + 1e-6))
