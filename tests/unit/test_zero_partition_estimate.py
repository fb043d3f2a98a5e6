"""memory.offload=zero with parallel.shard=optimizer (ZeRO-Offload with partitioned host states,
m6.memory.zero_partition_estimate): the device keeps zero's resident 16-bit layout, the host
holds each parameter's torch.chunk chunk only (dense over the data-parallel ranks, experts over
the expert-data-parallel ranks), and the config accepts the layout the planner proposes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from m6.config import load
from m6.config_loader import ConfigError
from m6.memory.estimate import WEIGHT_STAGING
from m6.memory.memory_report import estimate_memory
from m6.plan.memory import RankMemory

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
SMALL = ["data.kind=synthetic", "data.sources=[]", "model.moe.capacity_factor=null", "data.seq_len=40",
         "model.max_text_len=40", "model.image_size=16", "train.global_batch_size=16", "train.precision=bf16",
         "memory.host_optimizer=torch", "checkpoint.async_save=false", "memory.offload=zero",
         "memory.offload_blocks=[]"]
WORLD, EP = 4, 2  # dense chunks over 4 ranks, experts over 2


def _cfg(*extra: str):
    return load(CONFIG, [*SMALL, *extra])


def _chunks(rm: RankMemory) -> tuple[int, int]:
    """(elements of this rank's chunks, trainable tensors), from the parameters' shapes."""
    experts = rm.facts.expert_ids
    total = 0
    for p in rm.facts.params:
        n = WORLD // EP if id(p) in experts else WORLD
        total += 1 if p.dim() == 0 else math.ceil(p.shape[0] / n) * (p.numel() // p.shape[0])
    return total, len(rm.facts.params)


def test_host_holds_the_rank_s_chunks_and_the_device_zero_s_resident_layout():
    rm = RankMemory(_cfg(), WORLD, EP, "cuda")
    chunk, tensors = _chunks(rm)
    numel = rm.facts.numel
    assert numel / WORLD < chunk < numel  # dense 1/4, experts 1/2, padding rows
    whole = rm.report(_cfg())  # unsharded zero, every block resident
    for extra, grad_bytes in ((["memory.host_grad_dtype=compute"], 2), ([], 4),
                              (["optim.delayed_update=true"], 8)):
        cfg = _cfg("parallel.shard=optimizer", *extra)
        r = rm.report(cfg)
        assert r.host["params"] == 4 * chunk
        assert r.host["optimizer state"] == 8 * chunk + 4 * tensors
        assert r.host["grads"] == grad_bytes * chunk
        assert r.host["params"] < whole.host["params"] / 1.5
        # The same estimate as the one memory model's entry point (what python -m m6.inspect prints).
        est = estimate_memory(cfg, rm.model, rm.no_decay, WORLD, EP, "cuda")
        assert (est.host, est.peak_device, est.peak_host) == (r.host, r.peak_device, r.peak_host)
        unsharded = rm.report(_cfg(*extra))
        assert r.device == unsharded.device and r.peak_device == unsharded.peak_device
        assert r.device["params"] == 2 * numel  # full 16-bit weights, no fp32 master on the device
        assert r.peak_host == sum(r.host.values())
    # 16-bit host gradients: one update group's chunks read back in fp32 beside foreach's temporaries.
    half = rm.report(_cfg("parallel.shard=optimizer", "memory.host_grad_dtype=compute", "optim.apply_groups=1"))
    assert half.host["optimizer step temporaries"] > 4 * chunk  # the whole group: every chunk, + the call's
    assert half.host[WEIGHT_STAGING] == 2 * 2 * max(_push_sizes(rm))


def _push_sizes(rm: RankMemory) -> list[int]:
    """Each forward-order segment's chunk elements: the weights outside the blocks, each block's."""
    experts, in_block = rm.facts.expert_ids, {}
    for i, b in enumerate(rm.model.blocks):
        for p in b.parameters():
            in_block.setdefault(id(p), i + 1)
    sizes = [0] * (len(rm.model.blocks) + 1)
    for p in rm.facts.params:
        n = WORLD // EP if id(p) in experts else WORLD
        sizes[in_block.get(id(p), 0)] += 1 if p.dim() == 0 else math.ceil(p.shape[0] / n) * (p.numel() // p.shape[0])
    return sizes


def test_async_save_stages_the_chunks_states_only():
    rm = RankMemory(_cfg(), WORLD, EP, "cuda")
    chunk, tensors = _chunks(rm)
    r = rm.report(_cfg("parallel.shard=optimizer", "checkpoint.async_save=true"))
    # masters + two moments per chunk (each padded to 64 B) + a 64-B slot per step count
    assert 12 * chunk + 64 * tensors <= r.host["checkpoint staging"] <= 12 * chunk + 4 * 64 * tensors


@pytest.mark.parametrize("extra, names", [
    (["memory.offload_blocks=all"], "memory.offload_blocks"), (["optim.name=adafactor"], "optim.name=adafactor"),
    (["parallel.shard=full"], "parallel.shard=full")])
def test_config_refuses_what_the_partitioned_layout_is_not_built_with(extra, names):
    with pytest.raises(ConfigError, match=names):
        _cfg("parallel.shard=optimizer", *extra) if "parallel.shard=full" not in extra else _cfg(*extra)


def test_config_accepts_the_partitioned_layout_with_auto_recompute_and_the_delayed_update():
    cfg = _cfg("parallel.shard=optimizer", "memory.activation_checkpointing=auto", "optim.delayed_update=true",
               "memory.host_grad_dtype=compute")
    assert (cfg.memory.offload, cfg.parallel.shard) == ("zero", "optimizer")
