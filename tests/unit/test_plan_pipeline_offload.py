"""The planner's pipelines with m6's offload (m6.plan.pipeline_offload, in m6.plan.pipeline_memory): searched with
memory.offload=optimizer, the stage's gradients all on the device over the step, the optimizer
state on the host, and the plan's overrides load."""

from __future__ import annotations

import dataclasses

import pytest

from m6.config import load
from m6.plan.pipeline_memory import pipeline_memory
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


def test_every_stage_gradient_stays_on_the_device_and_the_update_goes_to_the_host():
    """At one data-parallel rank per stage no gradient is all-reduced: without a pipeline the
    estimate lets each leave as backward writes it; in a pipeline all of them wait for the
    stage's last backward, 4 bytes each, and the masters, streamed gradients and optimizer state
    are on the host."""
    cfg = load("configs/tiny.yaml", [*SMALL, "memory.offload=optimizer", "parallel.pipeline_parallel_size=2",
                                     "train.micro_batch_size=4", "memory.host_optimizer=torch"])
    sized = pipeline_memory(cfg, 2, "1f1b", 1, 1, 1, "cuda")
    plain = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, offload="none"))
    for rank in sized.ranks:
        off, on = sized.rank_report(cfg, rank), sized.rank_report(plain, rank)
        numel = rank.facts.numel
        assert off.device["grads"] == on.device["grads"] == pytest.approx(4.0 * numel)
        assert "optimizer state" not in off.device and on.device["optimizer state"] > 0
        assert off.host["params"] == pytest.approx(4.0 * numel) and off.host["grads"] == pytest.approx(4.0 * numel)
        assert off.host["optimizer state"] == on.device["optimizer state"]
        assert off.peak_device < on.peak_device and off.peak_host > on.peak_host
