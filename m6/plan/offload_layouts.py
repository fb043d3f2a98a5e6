"""The planner's model of the offloaded layouts' bytes and copies: ZeRO-Offload's layout
(``memory.offload: zero``) beside m6's fp32 ones (``optimizer``, ``optimizer+params``), and what
each copy overlaps, with and without the delayed update (``optim.delayed_update``).

zero (ZeRO-Offload's layout): device and host bytes are m6.memory.estimate.zero_memory's (one model,
  shared with m6.memory.estimate and ``python -m m6.inspect``; with 16-bit host gradients and no
  delayed update the streamed blocks' gradients land in their 16-bit homes, no host gradient
  buffers of their own: m6.memory.home_grads); c = the compute dtype's bytes, 2:
  copies  gradients device -> host: 16-bit ones once per step (as their buckets are final, during
          the last micro-batch's backward); fp32 buffers receive 4 B per parameter, the unshared
          gradients in every micro-batch; the streamed blocks' 16-bit weights host -> device twice
          per micro-batch (forward and backward, the next block prefetched); after the host update
          the resident blocks' 16-bit weights host -> device once, cast to 16 bits on the host by
          the copy-back thread first (m6.memory.block_copy_back), in forward-order segments that
          the next step's first forward waits for block by block (m6.plan.copy_back_overlap: the
          first piece, outside the blocks and block 0, shows, and what the forward of the other
          blocks cannot hide; the cast paces the copies where it is the slower). All on CUDA copy streams beside
          compute, over one PCIe link (ASSUMED, as for the fp32 layouts: the two directions share
          the PCIe figure): the gradients hide behind the last backward (2/3 of its micro-batch's
          compute) except the last bucket's copy, the fetches, the gradients and the copy back's
          hidden part together behind the step's compute, what exceeds either shows.

The host update and its copy back (every offloaded layout):
  synchronous  the update runs after the device's step (clip, agree, update), the weights going
          back group by group (``optim.apply_groups``) while the next group updates: the last
          group's copy, or what exceeds the update, shows.
  delayed (``optim.delayed_update``, GPUs, fp32 or 16-bit host gradients, either in two sets;
          m6.memory.delayed_update) step
          t's host update runs while step t+1's forward/backward run on the device; the device
          waits for it after its backward, then for the whole copy back of the new weights (the
          device's own weights are in use until that backward ends, so nothing is copied earlier;
          zero casts its masters to 16 bits then too, chunk by chunk beside the copy: the longer
          of the two), then launches step
          t+1's update: a step is max(device phase, host update) + the copy back, where the
          device phase is compute + exposed all-to-all + exposed gradient sync + small collectives
          + the copies during compute that show. ASSUMED: the update's host cores are not slowed
          by the training thread nor by the next step's gradient copies into host memory. The
          first ``optim.delayed_update_after`` steps run synchronously (their step time is the
          synchronous one, printed beside).
          zero: the copy back is not waited for whole after the backward: it runs beside the next
          step's first forward, block by block (see above), and the host update of the step
          starts once the copy-back thread has read the masters (the longer of the copy and the
          cast), so a step is the device phase (with the copy back's exposed part) + what of
          copy back + update outlasts it. The synchronous zero step: the update (without the
          cast, which runs on the copy-back thread) after the device's step, the copy back
          handed over group by group while the next group updates, what is left beside the
          next forward.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Optional

from m6.config import Config, MemoryConfig, accumulation_steps
from m6.plan.copy_back_overlap import weights_back_exposed
from m6.plan.link_floor import LinkWindow
# Re-exported: the planner's callers name the zero layout's bytes from here.
from m6.memory.estimate import STAGING_CHUNK, WEIGHT_STAGING, streamed_blocks, zero_memory  # noqa: F401

ZERO = "zero"
BLOCK_COPY_BACK = "weights back (16-bit) beside the next forward, block by block"  # zero's (m6.plan.copy_back_overlap)
FP32_LAYOUTS = ("optimizer", "optimizer+params")  # m6's offload of fp32 weights (m6.memory.offload)
PLANNED_OFFLOAD = ("none", *FP32_LAYOUTS, ZERO)  # every memory.offload the planner models
# What the printed plan names as ASSUMED when it shows these layouts (see the module docstring).
ZERO_ASSUMED = ("zero: copies on CUDA copy streams beside compute, both directions sharing the PCIe figure; "
                "with accumulation the 16-bit gradients summed on the device; the weights back beside the next "
                "forward block by block, the blocks' forwards equal, the first micro-batch's forward 1/3 of its "
                "forward+backward")
DELAYED_ASSUMED = ("delayed update: the host update runs beside the next step's forward/backward unslowed by it, "
                   "the weights copied back after both (zero: beside the next forward, the update starting once "
                   "they are read)")


def runnable_offload_modes() -> tuple[str, ...]:
    """The memory.offload settings this checkout's config accepts (train.py runs them): the planner
    models zero whether or not the runtime that trains it is installed, and proposes it only where
    it is (or when asked: ``python -m m6.plan --offload-modes all``)."""
    accepted = typing.get_args(typing.get_type_hints(MemoryConfig)["offload"])
    return tuple(m for m in PLANNED_OFFLOAD if m in accepted)


@dataclass(frozen=True)
class Copy:
    """One host<->device copy of a step: its seconds over the link and those the step waits for."""

    name: str
    seconds: float
    exposed: float


@dataclass(frozen=True)
class OffloadStep:
    """The offloaded layout's share of a step: copies and host update, exposed and overlapped."""

    offload: float  # copies the step waits for
    offload_hidden: float  # copies beside compute or the update
    update: float  # host update the step waits for
    update_hidden: float  # host update behind the next step's forward/backward (delayed)
    copies: tuple[Copy, ...]
    synchronous_total_extra: Optional[float] = None  # delayed: offload + update of the first, synchronous steps
    # The next forward's inter-node transfers (the partitioned zero's gathers; m6.plan.link_floor),
    # its excess counted in the step by the caller, not in offload
    link_window: Optional[LinkWindow] = None


def copy_back_exposed(back_s: float, update_s: float, groups: int) -> float:
    """The weights going back group by group while the next group updates: the last group's copy,
    or what exceeds the update."""
    return max(back_s / groups, back_s - update_s * (groups - 1) / groups)


def offload_step(cfg: Config, numel: int, numel_exp: int, streamed: int, world_size: int, ep: int,
                 compute_s: float, device_other_s: float, update_s: float, copy_Bps: float,
                 c: int, delayed: bool = False, cast_s: float = 0.0, first_numel: int = 0,
                 num_resident_blocks: int = 0) -> OffloadStep:
    """Copies and host update of an unsharded offloaded step (memory.offload optimizer,
    optimizer+params or zero), see the module docstring. ``numel``: the rank's trainable elements,
    ``numel_exp`` of them experts; ``streamed``: the streamed blocks' elements (0 for optimizer);
    ``compute_s``: forward+backward of all micro-batches; ``device_other_s``: the rest of the
    device phase (exposed all-to-all, gradient sync, small collectives); ``update_s``: the host
    update; ``c``: the compute dtype's bytes; ``delayed``: the update overlaps the next step
    (optim.delayed_update on a GPU); ``cast_s`` (zero): the host's cast of the masters to 16 bits,
    part of ``update_s``, done by the copy-back thread; ``first_numel`` (zero): the elements of
    the copy back's first piece (outside the blocks and block 0's), ``num_resident_blocks``: the
    blocks it copies back (m6.plan.copy_back_overlap)."""
    accum = accumulation_steps(cfg.train, world_size)
    groups = max(1, cfg.optim.apply_groups)
    if cfg.memory.offload == ZERO:
        if cfg.memory.host_grad_dtype == "compute":
            grads, window = c * numel / copy_Bps, 2 / 3 * compute_s / accum  # once, in the last backward
        else:  # fp32 buffers: the unshared gradients in every backward, widened to 4 B
            local = numel if world_size == 1 else (numel_exp if world_size // ep == 1 else 0)
            grads, window = 4.0 * (local * accum + numel - local) / copy_Bps, 2 / 3 * compute_s
        fetch = 2.0 * c * streamed * accum / copy_Bps
        last_bucket = min(c * numel, cfg.parallel.bucket_size_mb * 2**20) / copy_Bps
        # The gradients' own share: their last bucket, or what outlasts the last backward.
        grads_own = min(grads, max(last_bucket if numel else 0.0, grads - window))
        during = max(grads_own, fetch + grads - compute_s)
        back = c * (numel - streamed) / copy_Bps
        names = (f"gradients out ({'16-bit' if cfg.memory.host_grad_dtype == 'compute' else 'to fp32'})",
                 "streamed blocks' weights in (16-bit)", BLOCK_COPY_BACK)
    else:
        # Gradients out: the unshared ones (the experts at EP = world, everything at world 1) in
        # every micro-batch, the shared ones once after their all-reduce; all during backward.
        local = numel if world_size == 1 else (numel_exp if world_size // ep == 1 else 0)
        grad_bytes = 2.0 if cfg.memory.host_grad_dtype == "compute" and c < 4 else 4.0
        grads = grad_bytes * (local * accum + numel - local) / copy_Bps
        fetch = 2 * 4.0 * streamed * accum / copy_Bps  # fetched for forward and for backward, prefetched
        during = max(0.0, grads + fetch - compute_s)
        grads_own = during * grads / (grads + fetch) if grads + fetch else 0.0  # the link shared in proportion
        back = 4.0 * numel / copy_Bps  # new weights, group by group while the next group updates
        names = (f"gradients out ({'16-bit' if grad_bytes == 2 else 'fp32'})", "streamed blocks' weights in (fp32)",
                 "weights back (fp32)")
    if cfg.memory.offload == ZERO:
        return _zero_block_copy_back(grads, grads_own, fetch, back, names, compute_s / accum / 3,
                                     c * streamed / copy_Bps, first_numel / max(numel - streamed, 1),
                                     num_resident_blocks, compute_s, device_other_s, update_s, cast_s,
                                     groups, delayed)
    sync_back = copy_back_exposed(back, update_s, groups)
    # What shows during compute, split between the gradients (their own share) and the fetches (the rest).
    exposed_now = {names[0]: grads_own, names[1]: during - grads_own}
    if not delayed:
        copies = (Copy(names[0], grads, exposed_now[names[0]]), Copy(names[1], fetch, exposed_now[names[1]]),
                  Copy(names[2], back, sync_back))
        return OffloadStep(during + sync_back, grads + fetch + back - during - sync_back, update_s, 0.0,
                           nonzero_copies(copies))
    device_phase = compute_s + device_other_s + during
    background = update_s - cast_s  # zero casts at the catch-up, beside the copy back
    update_exposed = max(0.0, background - device_phase)
    catch_up = max(back, cast_s)
    copies = (Copy(names[0], grads, exposed_now[names[0]]), Copy(names[1], fetch, exposed_now[names[1]]),
              Copy(names[2], back, catch_up))
    return OffloadStep(during + catch_up, grads + fetch - during, update_exposed, background - update_exposed,
                       nonzero_copies(copies), synchronous_total_extra=during + sync_back + update_s)


def _zero_block_copy_back(grads: float, grads_own: float, fetch: float, back: float, names: tuple[str, ...],
                          forward_s: float, fetch_forward: float, first_share: float, num_blocks: int,
                          compute_s: float, device_other_s: float, update_s: float, cast_s: float,
                          groups: int, delayed: bool) -> OffloadStep:
    """zero's step with the block copy-back (see the module docstring): the copy-back thread casts
    and copies what the update hands it; what is left of the copy when the next forward starts
    overlaps it block by block, the rest of the link's load (gradients out, fetches, the copy's
    hidden part) sharing the step's compute."""
    chain = max(back, cast_s)  # the thread's casts and the link's copies, chunk beside chunk
    if delayed:  # all of it after the backward, the update waiting for the thread to have cast the masters
        left, main_update = chain, 0.0
    else:  # group by group while the next group updates (the cast off the training thread)
        main_update = update_s - cast_s
        left = copy_back_exposed(chain, main_update, groups)
    back_exposed = weights_back_exposed(left, first_share * chain, forward_s, num_blocks, fetch_forward)
    during = max(grads_own, fetch + grads + left - back_exposed - compute_s)
    copies = (Copy(names[0], grads, grads_own), Copy(names[1], fetch, during - grads_own),
              Copy(names[2], back, back_exposed))
    hidden = grads + fetch + back - during - back_exposed
    if not delayed:
        return OffloadStep(during + back_exposed, hidden, main_update, 0.0, nonzero_copies(copies))
    device_phase = compute_s + device_other_s + during + back_exposed
    background = update_s - cast_s
    update_exposed = max(0.0, chain + background - device_phase)  # it starts once the masters are read
    sync_left = copy_back_exposed(chain, update_s - cast_s, groups)
    sync_exposed = weights_back_exposed(sync_left, first_share * chain, forward_s, num_blocks, fetch_forward)
    sync_during = max(grads_own, fetch + grads + sync_left - sync_exposed - compute_s)
    return OffloadStep(during + back_exposed, hidden, update_exposed, background - update_exposed,
                       nonzero_copies(copies), synchronous_total_extra=sync_during + sync_exposed + update_s - cast_s)


def nonzero_copies(copies: tuple[Copy, ...]) -> tuple[Copy, ...]:
    return tuple(c for c in copies if c.seconds > 0)
