"""Tensor parallel in the planner (parallel.tensor_parallel_size = tp, parallel.sequence_parallel).

m6.parallel.tensor_parallel splits each block's attention by heads (qkv column-split, out
row-split) and each dense MLP by its hidden units (fc_in/fc_gate column-, fc_out row-split); the
norms, embeddings, head and the MoE layers whole (router, shared experts, and the experts under
expert parallelism over the world / tp data-parallel ranks) are replicated, and every tp rank
computes the MoE layers on the same tokens. So a tp rank holds, and computes, exactly what an
M6 model of H/tp query heads, Hkv/tp key/value heads (the same head dim) and ffn_dim/tp dense
hidden units holds and computes, with the experts' and shared experts' sizes kept:
``rank_config`` is that model, and the planner's memory estimate, FLOP rates and CPU profile run
on it at the data-parallel world (world / tp), where the batch is split. A unit test holds its
parameters to apply_tensor_parallel's split of the real model.

What that does not see, added here:
- the split regions' collectives (``tensor_parallel_s``): per region (each block's attention and
  each dense MLP) forward one all-reduce of the region's [B, S, D] output and backward one of its
  input's gradient; with sequence parallel an all-gather and a reduce-scatter instead of each
  all-reduce (the same bytes on a ring; x Hardware.gather_scatter_cost), and around each MoE layer
  an all-gather of its input (forward) and of its output's gradient (backward), and at the first
  and last block one more each. Replicated weights inside a region (per-head q/k norms; with
  sequence parallel the blocks' norms too) all-reduce their gradients in every micro-batch: a
  latency each. None of it overlaps compute (m6 runs them in the compute stream), on the
  intra-node link (the search keeps a tp group inside a node).
- with full recompute (memory.activation_checkpointing=full) the recomputed parts issue their
  forward collectives again in backward: each attention sub-block its row-parallel all-reduce
  (sequence parallel: its entry all-gather and exit reduce-scatter), each dense MLP its
  row-parallel all-reduce (sequence parallel: its exit reduce-scatter; the entry all-gather runs
  outside the recomputed part, on the MLP's input).
- sequence parallel's memory (``sequence_parallel_saving``): the residual stream each block saves
  for its two norms (input and statistics) is 1/tp per rank.
- MFU's numerator: the whole model's FLOPs, not tp x the rank model's (the MoE work replicated
  over the tp ranks is not useful work).
"""

from __future__ import annotations

import dataclasses

from m6.config import (Config, ConfigError, check_tensor_parallel, expert_ffn_dim, head_dim, is_moe_block,
                       num_kv_heads, num_patches)
from m6.model.activation_bytes import RESIDUAL_BYTES, norm_saved

# What tensor parallel composes with today (m6.config.check_tensor_parallel refuses the rest):
# the search tries tp > 1 only with these. auto recompute decides per rank (a tp group must agree).
# Sharded, the rank model's states are sharded over the data-parallel world it is sized at: the
# shards of the tp shard (FSDP2 over each tp coordinate's data-parallel ranks, m6.parallel.fsdp).
TP_RECOMPUTE, TP_OFFLOAD, TP_SHARD = ("none", "full"), ("none",), ("none", "optimizer", "full")


def tensor_parallel_refusal(cfg: Config, tp: int) -> str | None:
    """Why ``cfg`` cannot run at parallel.tensor_parallel_size=tp with the planner's settings for
    it (recompute, offload and shard none: the others are searched from TP_*), or None: the config
    check's own message."""
    trial = dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, tensor_parallel_size=tp, shard="none"),
        memory=dataclasses.replace(cfg.memory, activation_checkpointing="none", offload="none"),
        model=dataclasses.replace(cfg.model, moe=dataclasses.replace(cfg.model.moe, a2a_dispatch="flat")))
    try:
        check_tensor_parallel(trial)
    except ConfigError as e:
        return str(e)
    return None


def rank_config(cfg: Config, tp: int) -> Config:
    """``cfg`` with the model one tp rank holds and computes (see the module docstring); ``cfg``
    itself at tp 1."""
    if tp == 1:
        return cfg
    m = cfg.model
    moe = dataclasses.replace(m.moe, ffn_dim=expert_ffn_dim(m),
                              shared_expert_ffn_dim=m.moe.shared_expert_ffn_dim or expert_ffn_dim(m))
    model = dataclasses.replace(m, num_heads=m.num_heads // tp, num_kv_heads=num_kv_heads(m) // tp,
                                head_dim=head_dim(m), ffn_dim=m.ffn_dim // tp, moe=moe)
    return dataclasses.replace(cfg, model=model,
                               parallel=dataclasses.replace(cfg.parallel, tensor_parallel_size=1,
                                                            sequence_parallel=False))


def tensor_parallel_s(cfg: Config, tp: int, sequence_parallel: bool, micro_batch: int, accum: int,
                      latency_s: float, bandwidth_Bps: float, gather_scatter_cost: float = 1.0) -> float:
    """Seconds per step of the split regions' collectives over a tp group (see the module docstring)."""
    if tp == 1:
        return 0.0
    m = cfg.model
    S = num_patches(m) + cfg.data.seq_len
    precision = cfg.train.precision
    c = 2 if precision in ("bf16", "bf16-autocast", "fp16") else 4
    region = micro_batch * S * m.d_model * c  # a row-parallel output: the compute dtype
    residual = micro_batch * S * m.d_model * RESIDUAL_BYTES
    moe_blocks = sum(is_moe_block(m, i) for i in range(m.num_layers))
    regions = m.num_layers + (m.num_layers - moe_blocks)  # attention everywhere, the dense MLPs
    share = (tp - 1) / tp

    def all_reduce(nbytes: float) -> float:
        return latency_s + 2 * share * nbytes / bandwidth_Bps

    def gather_or_scatter(nbytes: float) -> float:
        return latency_s + share * nbytes * gather_scatter_cost / bandwidth_Bps

    small = 2 * m.num_layers if m.qk_norm == "head" else 0  # q/k norm weights' gradients
    recompute = cfg.memory.activation_checkpointing == "full"
    if not sequence_parallel:
        per_micro = regions * (2 + recompute) * all_reduce(region)
    else:
        per_micro = regions * 2 * (gather_or_scatter(region) + gather_or_scatter(region))
        per_micro += moe_blocks * 2 * gather_or_scatter(residual) + 2 * gather_or_scatter(residual)
        if recompute:  # attention: entry and exit again; a dense MLP its exit only
            per_micro += (2 * m.num_layers + (m.num_layers - moe_blocks)) * gather_or_scatter(region)
        small += 2 * m.num_layers  # the blocks' two norms see a chunk: their gradients summed
    return accum * (per_micro + small * latency_s)


def sequence_parallel_saving(cfg: Config, tp: int, micro_batch: int) -> float:
    """Activation bytes per micro-batch sequence parallel saves a tp rank: each block's two norms'
    inputs (the fp32 residual stream) and statistics held as 1/tp chunks."""
    m = cfg.model
    T = micro_batch * (num_patches(m) + cfg.data.seq_len)
    per_block = 2 * (RESIDUAL_BYTES * T * m.d_model + norm_saved(m, T))
    return m.num_layers * per_block * (tp - 1) / tp
