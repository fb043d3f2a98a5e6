"""The planner's tensor-parallel model (m6.plan.tensor_parallel): the rank model it sizes holds
what m6.parallel.tensor_parallel leaves a tp rank; its collectives and sequence parallel's saving
follow the formulas written in the module docstring."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from m6.config import load
from m6.model.m6_model import M6Model
from m6.parallel.tensor_parallel import apply_tensor_parallel
from m6.plan.tensor_parallel import rank_config, sequence_parallel_saving, tensor_parallel_refusal, tensor_parallel_s

SMALL = ["model.d_model=64", "model.num_layers=4", "model.num_heads=4", "model.ffn_dim=128", "model.moe.every=2",
         "model.moe.num_experts=4", "data.seq_len=16", "model.max_text_len=16", "model.image_size=16",
         "train.global_batch_size=4"]


@pytest.mark.parametrize("extra", [[], ["model.num_kv_heads=2", "model.ffn_activation=swiglu", "model.qk_norm=head",
                                        "model.moe.num_shared_experts=1"]])
def test_rank_config_holds_the_tp_ranks_parameters(extra):
    cfg = load("configs/tiny.yaml", [*SMALL, *extra])
    with torch.device("meta"):
        split = M6Model(cfg.model)
        narrow = M6Model(rank_config(cfg, 2).model)
    apply_tensor_parallel(split, 2, 0, None)
    want = {n: tuple(p.shape) for n, p in split.named_parameters()}
    got = {n: tuple(p.shape) for n, p in narrow.named_parameters()}
    assert got == want


def test_tensor_parallel_collectives_by_the_formula():
    cfg = load("configs/tiny.yaml", [*SMALL, "train.precision=fp32"])
    S = 16 + (16 // cfg.model.patch_size) ** 2
    nbytes = 2 * S * 64 * 4  # micro-batch 2, fp32
    lat, bw = 1e-4, 1e9
    regions = 4 + 2  # attention in 4 blocks, dense MLPs in the 2 non-MoE blocks
    want = 3 * regions * 2 * (lat + 2 * 0.5 * nbytes / bw)
    assert tensor_parallel_s(cfg, 2, False, 2, 3, lat, bw) == pytest.approx(want)
    assert tensor_parallel_s(cfg, 1, False, 2, 3, lat, bw) == 0.0
    # Sequence parallel: the regions' bytes are the same on a ring, more latencies and the MoE gathers.
    sp = tensor_parallel_s(cfg, 2, True, 2, 3, lat, bw)
    assert sp > want
    assert tensor_parallel_s(cfg, 2, True, 2, 3, 0.0, bw) == pytest.approx(
        3 * (regions * 2 * 2 * 0.5 * nbytes / bw + (2 + 1) * 2 * 0.5 * nbytes / bw))


def test_full_recompute_repeats_the_forward_collectives():
    """memory.activation_checkpointing=full: each attention's and dense MLP's forward all-reduce runs
    again in backward (sequence parallel: attention's all-gather and reduce-scatter, the MLP's
    reduce-scatter)."""
    cfg = load("configs/tiny.yaml", [*SMALL, "train.precision=fp32"])
    full = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, activation_checkpointing="full"))
    S = 16 + (16 // cfg.model.patch_size) ** 2
    nbytes = 2 * S * 64 * 4
    lat, bw = 1e-4, 1e9
    all_reduce, half = lat + 2 * 0.5 * nbytes / bw, lat + 0.5 * nbytes / bw
    regions = 4 + 2
    assert tensor_parallel_s(full, 2, False, 2, 3, lat, bw) - tensor_parallel_s(cfg, 2, False, 2, 3, lat, bw) == \
        pytest.approx(3 * regions * all_reduce)
    assert tensor_parallel_s(full, 2, True, 2, 3, lat, bw) - tensor_parallel_s(cfg, 2, True, 2, 3, lat, bw) == \
        pytest.approx(3 * (2 * 4 + 2) * half)


def test_sequence_parallel_saving_and_refusal():
    cfg = load("configs/tiny.yaml", SMALL)
    assert sequence_parallel_saving(cfg, 1, 2) == 0.0
    assert sequence_parallel_saving(cfg, 4, 2) == pytest.approx(1.5 * sequence_parallel_saving(cfg, 2, 2))
    assert tensor_parallel_refusal(cfg, 2) is None
    assert "model.num_heads" in tensor_parallel_refusal(cfg, 8)
    full = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, qk_norm="full"))
    assert "model.qk_norm=full" in tensor_parallel_refusal(full, 2)
