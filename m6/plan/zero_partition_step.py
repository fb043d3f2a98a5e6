"""The planner's model of the copies of a ZeRO-Offload step with partitioned host states
(``memory.offload=zero`` + ``parallel.shard=optimizer``; bytes in m6.memory.zero_partition_estimate).
Each rank's chunk is 1/n of a parameter (n: its gradient group, the data-parallel ranks for dense
parameters, the expert-data-parallel ranks for experts); c = the compute dtype's bytes, 2.

backward  the gradient buckets reduce-scatter over their group (m6.plan.timing: (n-1)/n of the
          bucket bytes per rank, half an all-reduce), launched as their gradients are final in the
          last micro-batch's backward, overlapped with it as the all-reduce is; each rank's reduced
          chunk leaves over PCIe beside that backward (16-bit, or widened to fp32 with
          memory.host_grad_dtype=fp32, a group of one rank's gradients then in every micro-batch as
          unsharded zero's): only the last bucket's chunk, or what outlasts the window, shows.
update    the host steps the rank's chunks only (m6.plan.timing times the update over them).
weights back  the copy-back thread casts the rank's 16-bit chunks and copies them host -> device
          (1/n of the bytes over PCIe), then each is all-gathered over its group ((n-1)/n of the
          whole bytes per rank over the link the group spans); issued in forward order, segment by
          segment (the weights outside the blocks, then each block), beside the next forward, whose
          blocks each wait for their own gathers (m6.plan.copy_back_overlap). The copies and the
          gathers use different links, so they pipeline: segment k's gather beside segment k+1's
          copy, the pair taking max(copies, gathers) + min(copies, gathers) / segments
          (m6.plan.timing.pipelined_s), its first piece the first segment's copy and gather. What
          of that shows is split between the copies and the gathers in proportion to their seconds
          (the pipeline's exposed time has no single owner: the split only labels it). The gathers
          that cross nodes share the inter-node link with that forward's all-to-alls: the forward
          (with what of the return and of its all-to-all shows) lasts at least their sum, the
          excess labelled "inter-node link shared" (m6.plan.link_floor). ASSUMED: the gathers do
          not slow the forward's compute; the copies' hidden part shares PCIe with the gradients
          going out.
synchronous  the update after the device's step, the chunks going back group by group while the
          next group updates (optim.apply_groups), what is left at the next forward beside it.
delayed   (optim.delayed_update) step t's host update beside step t+1's device phase, starting
          once the copy-back thread has read the masters; its copy back and gathers beside step
          t+2's forward, as unsharded zero's (m6.plan.offload_layouts).
"""

from __future__ import annotations

from m6.config import Config, accumulation_steps
from m6.plan.copy_back_overlap import weights_back_exposed
from m6.plan.link_floor import link_window
from m6.plan.offload_layouts import Copy, OffloadStep, copy_back_exposed, nonzero_copies

CHUNKS_BACK = "weights back (16-bit, the rank's chunks) beside the next forward, block by block"
GATHERS = "weight all-gathers, each segment's after its copy, beside the next forward"
PARTITION_ASSUMED = ("zero with shard=optimizer: the weights' all-gathers beside the next forward do not slow its "
                     "compute (they share the inter-node link with its all-to-alls: see inter-node link); the "
                     "reduce-scatter's chunk copied out of the bucket in place")


def pipelined_s(first_s: float, second_s: float, segments: int) -> float:
    """Two stages over the same ``segments`` (each segment's second stage after its first, the
    next segment's first beside it): the longer stage + one segment of the shorter."""
    return max(first_s, second_s) + min(first_s, second_s) / max(segments, 1)


def partitioned_offload_step(cfg: Config, chunk_numel: int, local_numel: int, world_size: int, compute_s: float,
                             device_other_s: float, update_s: float, cast_s: float, gather_s: float,
                             copy_Bps: float, c: int, bucket_chunk_bytes: float, first_share: float,
                             num_resident_blocks: int, delayed: bool, forward_a2a_s: float = 0.0,
                             forward_a2a_inter_s: float = 0.0, gathers_cross_nodes: bool = False) -> OffloadStep:
    """Copies and host update of the step (module docstring). ``chunk_numel``: this rank's chunk
    elements; ``local_numel``: those of parameters whose group is this rank alone (reduced
    nowhere); ``compute_s``: forward+backward of all micro-batches; ``device_other_s``: exposed
    all-to-all, gradient sync and small collectives; ``update_s``: the host update over the chunks,
    ``cast_s`` of it the masters' cast to 16 bits (on the copy-back thread); ``gather_s``: every
    all-gather of the weights; ``bucket_chunk_bytes``: a bucket's chunk (its bytes / n);
    ``first_share``: the weights outside the blocks + block 0's share of the whole (of its
    elements, taken for the chunks' and the gathers' bytes too);
    ``num_resident_blocks``: the blocks; ``delayed``: optim.delayed_update on a GPU;
    ``forward_a2a_s``: a micro-batch's forward all-to-alls' exposed seconds, ``forward_a2a_inter_s``
    their seconds on the inter-node link; ``gathers_cross_nodes``: the gathers' groups span nodes."""
    accum = accumulation_steps(cfg.train, world_size)
    groups = max(1, cfg.optim.apply_groups)
    if cfg.memory.host_grad_dtype == "compute":
        grads, window = c * chunk_numel / copy_Bps, 2 / 3 * compute_s / accum  # once, in the last backward
        dtype = "16-bit"
    else:  # widened to fp32; a group of one rank's (nothing to reduce) in every micro-batch
        grads = 4.0 * (local_numel * accum + chunk_numel - local_numel) / copy_Bps
        # The reduced chunks leave in the last backward only; the unreduced ones in every one.
        window = 2 / 3 * compute_s if local_numel else 2 / 3 * compute_s / accum
        dtype = "to fp32"
    last_bucket = min(c * chunk_numel, bucket_chunk_bytes) / copy_Bps
    grads_own = min(grads, max(last_bucket if chunk_numel else 0.0, grads - window))
    back = c * chunk_numel / copy_Bps
    chain = max(back, cast_s)  # the thread's casts and the link's copies, chunk beside chunk
    segments = num_resident_blocks + 1
    forward_s = compute_s / accum / 3  # the first micro-batch's forward

    def at_forward(left: float) -> tuple[float, float, float, float]:
        """(exposed, copies' exposed, gathers' exposed, copies hidden on PCIe) of ``left`` seconds
        of copies still to go, and every gather, when the next forward starts."""
        stream = pipelined_s(left, gather_s, segments)
        if stream <= 0.0:
            return 0.0, 0.0, 0.0, 0.0
        exposed = weights_back_exposed(stream, first_share * (left + gather_s), forward_s, num_resident_blocks)
        copies_exposed = exposed * left / (left + gather_s)
        return exposed, copies_exposed, exposed - copies_exposed, left - copies_exposed

    def forward_link(exposed: float):
        """The next forward's inter-node link window, the weights' return showing ``exposed``."""
        return link_window("next forward", forward_s + exposed + forward_a2a_s,
                           {"weight all-gathers": gather_s * gathers_cross_nodes, "all-to-all": forward_a2a_inter_s})

    grads_name = f"gradients out (the rank's reduced chunks, {dtype})"
    if not delayed:
        main_update = update_s - cast_s
        left = copy_back_exposed(chain, main_update, groups)
        exposed, exp_c, exp_g, pcie = at_forward(left)
        during = max(grads_own, grads + pcie - compute_s)
        copies = (Copy(grads_name, grads, during), Copy(CHUNKS_BACK, back, exp_c), Copy(GATHERS, gather_s, exp_g))
        window = forward_link(exposed)
        return OffloadStep(during + exposed, grads + back + gather_s - during - exposed, main_update, 0.0,
                           nonzero_copies(copies), link_window=window if window.transfers else None)
    exposed, exp_c, exp_g, pcie = at_forward(chain)
    during = max(grads_own, grads + pcie - compute_s)
    window = forward_link(exposed)
    device_phase = compute_s + device_other_s + during + exposed + window.excess_s
    background = update_s - cast_s
    update_exposed = max(0.0, chain + background - device_phase)  # it starts once the masters are read
    sync_left = copy_back_exposed(chain, background, groups)
    sync_exposed, _, _, sync_pcie = at_forward(sync_left)
    sync_during = max(grads_own, grads + sync_pcie - compute_s)
    sync_link = forward_link(sync_exposed).excess_s
    copies = (Copy(grads_name, grads, during), Copy(CHUNKS_BACK, back, exp_c), Copy(GATHERS, gather_s, exp_g))
    return OffloadStep(during + exposed, grads + back + gather_s - during - exposed, update_exposed,
                       background - update_exposed, nonzero_copies(copies),
                       synchronous_total_extra=sync_during + sync_exposed + sync_link + background,
                       link_window=window if window.transfers else None)
