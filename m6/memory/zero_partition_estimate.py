"""Per-rank bytes of ZeRO-Offload with partitioned host states (``memory.offload=zero`` with
``parallel.shard=optimizer``: DeepSpeed's stage 2 with offload_optimizer), the layout the planner
models and searches.

Partition: each trainable parameter split along dim 0 in torch.chunk order, padded to equal chunks
(ceil(rows / n) rows per rank; a 0-dim tensor whole), over its gradient group: dense parameters over
the data-parallel ranks (n = world), expert parameters over the expert-data-parallel ranks
(n = world / EP); the same partition as FSDP2's shard=optimizer (m6.memory.shard_estimate's
``shard_layout``, whose ``shard_numel`` is this rank's elements, padding rows included).

device  what zero keeps with every block resident (m6.memory.estimate.zero_memory with
        ``memory.offload_blocks=[]``): the full 16-bit weights, the 16-bit gradients while on the
        device, the gradient buckets in flight (reduce-scattered instead of all-reduced: the
        reduced chunk is the bucket's own slice, ASSUMED in place, copied to the host from there),
        activations. The all-gathers after the host update write into the resident weights
        (ASSUMED in place: a flat 16-bit buffer per group whose slices are the parameters). No fp32
        master, no optimizer state.
host    for this rank's chunks only: 4 B fp32 master + AdamW's two moments (8 B per element, 4 B
        step count per tensor) + the host gradients, c B (memory.host_grad_dtype=compute) or 4 B
        per element (twice with optim.delayed_update: the next backward streams into a second set)
        + the copy back's pinned 16-bit staging (two buffers of the largest push, a push being
        one forward-order segment's chunks: the weights outside the blocks, or one block's; at
        most m6.memory.estimate.STAGING_CHUNK elements each) + the update's temporaries (torch's
        foreach AdamW: one call's sqrt(exp_avg_sq) over chunks; with 16-bit host gradients one
        update group's chunks read back in fp32; DeepSpeed's CPU Adam: in place) + with
        checkpoint.async_save the staging copy of the rank's states: its chunks' masters and
        moments (the 16-bit device weights are the masters' cast; ASSUMED not staged).
"""

from __future__ import annotations

import dataclasses
import math
import weakref

import torch
from torch import nn

from m6.config import Config
from m6.memory.estimate import (STAGING_ALIGN, WEIGHT_STAGING, MemoryReport, ModelFacts, compute_bytes,
                                copy_back_staging, zero_memory)
from m6.memory.grouped_apply import split_apply_groups

ADAMW_ONLY = "adamw"  # the partitioned host states are AdamW's (DeepSpeed's CPU Adam or torch's foreach AdamW)


def partitioned(cfg: Config) -> bool:
    """Whether ``cfg`` is ZeRO-Offload with partitioned host states."""
    return cfg.memory.offload == "zero" and cfg.parallel.shard == "optimizer"


@dataclasses.dataclass(frozen=True)
class Chunks:
    """Element counts of one rank's chunks (padding included)."""

    numel: int  # all of this rank's chunks
    num_tensors: int
    largest_push: int  # the largest forward-order segment's chunks (outside the blocks, or one block)
    largest_group: int  # the largest optim.apply_groups group's chunks, both decay groups together
    largest_call: int  # the largest foreach call's chunks (apply group x decay group)
    staging_sizes: tuple[int, ...]  # each chunk's bytes of master, moments and step (checkpoint staging)


_CHUNKS: "weakref.WeakKeyDictionary[ModelFacts, dict]" = weakref.WeakKeyDictionary()


def chunk_numel(p: nn.Parameter, n: int) -> int:
    """Elements of one rank's chunk of ``p`` over ``n`` ranks: ceil(rows / n) rows (torch.chunk's
    chunk size, padded to equal chunks); a 0-dim tensor whole."""
    if p.dim() == 0:
        return 1
    return math.ceil(p.shape[0] / n) * (p.numel() // max(p.shape[0], 1))


def rank_chunks(facts: ModelFacts, no_decay: set[int], world_size: int, ep: int, apply_groups: int) -> Chunks:
    """This rank's chunks of ``facts``' model at ``world_size`` data-parallel ranks and EP ``ep``."""
    key = (world_size, ep, apply_groups, frozenset(no_decay))
    cache = _CHUNKS.setdefault(facts, {})
    if key in cache:
        return cache[key]
    edp = world_size // ep
    size = {id(p): chunk_numel(p, edp if id(p) in facts.expert_ids else world_size) for p in facts.params}
    segment: dict[int, int] = {}
    for i, block in enumerate(getattr(facts.model, "blocks", [])):
        for p in block.parameters():
            segment.setdefault(id(p), i + 1)
    pushes: dict[int, int] = {}
    for p in facts.params:
        pushes[segment.get(id(p), 0)] = pushes.get(segment.get(id(p), 0), 0) + size[id(p)]
    # Apply groups as m6.memory.grouped_apply splits the whole tensors, counted in chunk elements.
    shards = {id(p): torch.empty(size[id(p)], device="meta") for p in facts.params}
    rep = [shards[id(p)] for p in facts.replicated]
    exp = [shards[id(p)] for p in facts.experts]
    groups = split_apply_groups(rep, exp, apply_groups) if apply_groups > 1 else [rep + exp]
    decayed = {id(shards[id(p)]) for p in facts.params if id(p) not in no_decay}
    chunks = Chunks(
        numel=sum(size.values()), num_tensors=len(facts.params), largest_push=max(pushes.values(), default=0),
        largest_group=max((sum(t.numel() for t in g) for g in groups), default=0),
        largest_call=max((sum(t.numel() for t in g if (id(t) in decayed) == d) for g in groups for d in (True, False)),
                         default=0),
        staging_sizes=tuple(b for n in size.values() for b in (4 * n, 4 * n, 4 * n, 4)))
    cache[key] = chunks
    return chunks


def zero_partitioned_memory(cfg: Config, model: nn.Module, facts: ModelFacts, no_decay: set[int], world_size: int,
                            ep: int, device_type: str = "cuda") -> MemoryReport:
    """Device and host bytes of one rank (see the module docstring), named as m6.memory.estimate
    names its components; the peaks taken as zero_memory takes them."""
    assert partitioned(cfg), "zero_partitioned_memory is memory.offload=zero with parallel.shard=optimizer"
    resident = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, offload_blocks=[]),
                                   parallel=dataclasses.replace(cfg.parallel, shard="none"))
    whole = zero_memory(resident, model, facts, no_decay, world_size, ep, device_type)
    c = compute_bytes(cfg, device_type)
    half_grads = cfg.memory.host_grad_dtype == "compute"
    chunks = rank_chunks(facts, no_decay, world_size, ep, cfg.optim.apply_groups)
    foreach = 0.0 if cfg.memory.host_optimizer == "deepspeed" else 4.0 * chunks.largest_call
    host = {"params": 4.0 * chunks.numel,
            "grads": float((c if half_grads else 4) * chunks.numel) * (2 if cfg.optim.delayed_update else 1),
            "optimizer state": 8.0 * chunks.numel + 4.0 * chunks.num_tensors,
            WEIGHT_STAGING: float(c * copy_back_staging(chunks.largest_push)),
            "optimizer step temporaries": foreach + (4.0 * chunks.largest_group if half_grads else 0.0)}
    if cfg.checkpoint.async_save:
        host["checkpoint staging"] = float(sum(-(-n // STAGING_ALIGN) * STAGING_ALIGN for n in chunks.staging_sizes))
    peak_host = sum(host.values())
    resident_params = whole.device["params"]
    temporaries = host["optimizer step temporaries"]
    phases = whole.peak_device - resident_params  # the largest of backward, its end, the forward's end
    shared = whole.peak_device + peak_host if cfg.optim.delayed_update else \
        resident_params + peak_host - temporaries + max(phases, temporaries)
    return MemoryReport(device=dict(whole.device), host=host, peak_device=whole.peak_device, peak_host=peak_host,
                        peak_shared=shared)
