"""The planner's pipelines with m6's offload (m6.plan.pipeline_offload): searched with
memory.offload=optimizer, the stage's gradients all on the device over the step, the optimizer
state on the host, and the plan's overrides load."""

from __future__ import annotations

import dataclasses

import pytest

from m6.config import load
from m6.plan.memory import RankMemory
from m6.plan.pipeline import stage_config
from m6.plan.pipeline_offload import pipeline_offload_memory
from m6.plan.search import search
from m6.plan.timing import GPUS, HostProfile

SMALL = ["model.d_model=256", "model.num_layers=8", "model.num_heads=8", "model.ffn_dim=512", "model.moe.every=2",
         "model.moe.num_experts=8", "data.seq_len=64", "model.max_text_len=64", "model.image_size=32",
         "train.global_batch_size=32", "checkpoint.async_save=false", "data.eval_samples=0"]


def test_pipelines_are_searched_with_optimizer_offload():
    cfg = load("configs/tiny.yaml", SMALL)
    result = search(cfg, 4, 8, GPUS["h100"], HostProfile(1, host_cores_per_gpu=12), 1024, 8, tps=(1,), pps=(2,),
                    recompute=("none",), offload=("none", "optimizer", "optimizer+params"), shard=("none",),
                    micro_batches=[2], apply_groups=(1,), a2a=(None,), overlap=(1,), delayed=(False, True))
    pp = [c for c in result.feasible if c.pipeline_parallel_size == 2]
    assert {c.offload for c in pp} == {"none", "optimizer"} and not any(c.delayed_update for c in pp)
    by = {(c.pipeline_schedule, c.expert_parallel_size, c.offload): c for c in pp}
    pairs = [(c, by[(s, e, "none")]) for (s, e, o), c in by.items() if o == "optimizer"]
    assert pairs
    for off, plain in pairs:
        assert "optimizer state" not in off.memory.device and off.memory.host["optimizer state"] > 0
        # The device keeps weights and gradients; the optimizer state and the update's temporaries left.
        assert off.memory.peak_device < plain.memory.peak_device
        assert off.memory.device["grads"] == plain.memory.device["grads"]  # every gradient, all step
        load("configs/tiny.yaml", [*SMALL, *off.overrides()])  # m6 runs what the planner proposes


def test_unshared_gradients_stay_on_the_device_over_the_step():
    """At one data-parallel rank per stage no gradient is all-reduced: without a pipeline the
    estimate lets each leave as backward writes it; in a pipeline all of them wait for the
    stage's last backward, 4 bytes each."""
    cfg = load("configs/tiny.yaml", [*SMALL, "memory.offload=optimizer", "parallel.pipeline_parallel_size=2",
                                     "train.micro_batch_size=4"])
    rank = stage_config(cfg, 2)
    rm = RankMemory(rank, 1, 1, "cuda")
    before = rm.report(rank)
    after = pipeline_offload_memory(rank, before, rm.facts, 1, 1, "cuda")
    numel = sum(p.numel() for p in rm.model.parameters())
    assert after.device["grads"] == pytest.approx(4.0 * numel)
    assert after.peak_device - before.peak_device == pytest.approx(4.0 * numel - before.device["grads"])
    no_offload = dataclasses.replace(rank, memory=dataclasses.replace(rank.memory, offload="none"))
    assert pipeline_offload_memory(no_offload, before, rm.facts, 1, 1, "cuda") is before
