"""Bucketed gradient all-reduce overlapped with backward, and the global gradient-norm clip.

Scale: every rank's loss is already normalised by GLOBAL counts (target tokens all-reduced, routing
statistics summed by m6.moe.GlobalRoutingStats), so the gradient of the global loss is the plain SUM of
the ranks' gradients: replicated params over all ranks, expert params over the ranks holding the
same experts (the expert-data-parallel group). The other EP ranks' tokens already reached these
experts through the all-to-all backward. No division by the world or EP size anywhere, which is
where expert gradients come out off by the EP size in stacks that average.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from m6.parallel.plan import ShardedModel


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    group: object
    group_size: int
    ready: int = 0
    flat: torch.Tensor | None = None
    work: object = None
    launched: bool = False


@dataclass
class GradientSync:
    """Launches an async SUM all-reduce per bucket as soon as its last gradient is accumulated.

    Set ``enabled = False`` for the micro-batches of an accumulation step that are not the last,
    so only the final backward communicates; call ``finish()`` after the last backward.
    ``on_grads_final`` (e.g. CPU offload streaming gradients to the host) receives each bucket's
    params once their gradients are final: each parameter as backward writes it when its group is
    this process alone (one process, or experts no other rank holds), the bucket after its
    all-reduce otherwise, so nothing moves an unreduced gradient. One process is the same object
    with nothing to reduce (and an unused parameter keeps no gradient, as without the sync).
    """

    sharded: ShardedModel
    bucket_bytes: int
    on_grads_final: Optional[Callable[[list[nn.Parameter]], None]] = None
    buckets: list[_Bucket] = field(default_factory=list)
    enabled: bool = True

    def __post_init__(self) -> None:
        groups, layout = self.sharded.groups, self.sharded.groups.layout
        # Reverse registration order approximates the order backward produces gradients.
        self._make_buckets(list(self.sharded.replicated_params.values())[::-1], groups.world, layout.world_size)
        self._make_buckets(list(self.sharded.expert_params.values())[::-1], groups.expert_data,
                           layout.expert_data_parallel_size)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _make_buckets(self, params: list[nn.Parameter], group, size: int) -> None:
        current, current_bytes = [], 0
        for p in params:
            if not p.requires_grad:
                continue
            current.append(p)
            current_bytes += p.numel() * p.element_size()
            if current_bytes >= self.bucket_bytes:
                self.buckets.append(_Bucket(current, group, size))
                current, current_bytes = [], 0
        if current:
            self.buckets.append(_Bucket(current, group, size))

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.enabled:
            return
        bucket = self._bucket_of[id(param)]
        if bucket.group_size == 1:
            # Nothing to add up: final as soon as backward wrote it, one parameter at a time (so
            # offload frees each device gradient right away, not a bucket's worth).
            if self.on_grads_final is not None:
                self.on_grads_final([param])
            return
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        for p in bucket.params:
            if p.grad is None:  # unused in this step: contributes zeros, keeps collectives aligned
                p.grad = torch.zeros_like(p)
        bucket.launched = True
        bucket.flat = torch.cat([p.grad.reshape(-1) for p in bucket.params])
        bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)

    def _final(self, bucket: _Bucket) -> None:
        if self.on_grads_final is not None:
            self.on_grads_final(bucket.params)

    def finish(self) -> None:
        """Launch what backward did not (unused params), wait, and write the sums into .grad."""
        for bucket in self.buckets:
            if not bucket.launched and bucket.group_size > 1:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                offset = 0
                for p in bucket.params:
                    n = p.numel()
                    p.grad.copy_(bucket.flat[offset:offset + n].view_as(p.grad))
                    offset += n
                self._final(bucket)
            bucket.ready, bucket.flat, bucket.work, bucket.launched = 0, None, None, False


def _sum_sq(params: list[nn.Parameter]) -> torch.Tensor:
    grads = [p.grad.detach().float().pow(2).sum() for p in params if p.grad is not None]
    return torch.stack(grads).sum() if grads else torch.zeros(())


def clip_grad_norm(replicated: list[nn.Parameter], experts: list[nn.Parameter], max_norm: float,
                   expert_group=None, device: torch.device | None = None) -> float:
    """Clip to the norm of the GLOBAL gradient, counting every expert once; returns that norm.

    Replicated grads are identical on all ranks after sync (counted from this rank); expert grads
    are summed over the expert-parallel group (``expert_group``; None = this process holds every
    expert), which holds each expert exactly once: their expert-data-parallel replicas are
    identical and not added again. Same coefficient formula as torch.nn.utils.clip_grad_norm_.
    """
    sq_rep, sq_exp = _sum_sq(replicated), _sum_sq(experts)
    if expert_group is not None and dist.get_world_size(expert_group) > 1:
        # On the compute device (``device``): offloaded gradients live on the host, and NCCL
        # reduces device tensors only.
        reduced = sq_exp.to(device or sq_exp.device)
        dist.all_reduce(reduced, group=expert_group)
        sq_exp = reduced.to(sq_rep.device)
    total = float((sq_rep + sq_exp).sqrt())
    if math.isfinite(total) and max_norm < math.inf:
        coef = min(1.0, max_norm / (total + 1e-6))
        if coef < 1.0:
            for p in replicated + experts:
                if p.grad is not None:
                    p.grad.detach().mul_(coef)
    return total
