"""The planner's inter-node link per window (m6.plan.link_floor): the last backward lasts at least
its cross-node gradient sync + all-to-alls, the partitioned zero's next forward at least its
cross-node all-gathers + all-to-alls; what exceeds the window shows as "inter-node link shared"."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from m6 import config as m6config
from m6.plan.copy_back_overlap import weights_back_exposed
from m6.plan.memory import RankMemory
from m6.plan.offload_layouts import ZERO
from m6.plan.search import apply_choice
from m6.plan.timing import GPUS, HostProfile, densest_counts, expert_exchange_inter_s, expert_exchange_s, step_time
from m6.plan.zero_partition_step import GATHERS, partitioned_offload_step

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = ["train.global_batch_size=32", "train.micro_batch_size=2", "data.seq_len=64", "model.moe.top_k=2",
        "model.moe.num_experts=8", "model.moe.a2a_overlap_degree=4", "parallel.bucket_size_mb=0.01"]
WORLD, EP = 16, 8  # one micro-batch of 2 per rank
# A slow device (the tiny model's last backward 0.077 s) and a slow inter-node link: the gradient
# sync (0.082 s on it) fills that backward, and its all-to-alls, mostly hidden behind the experts,
# put more on the same link.
SLOW = dataclasses.replace(GPUS["h100"], latency_s=0.0, inter_node_GBps=0.05, intra_node_GBps=100.0, peak_tflops=0.016)


def _host() -> HostProfile:
    """Host update rates as if probed on one thread (no probe runs in the test): 1 ns per
    parameter, 12 cores per GPU (the M6-T plan's host update hidden, as there)."""
    host = HostProfile(threads=1, host_cores_per_gpu=12)
    for key in (("adamw", "torch", False), ("adamw", "torch", True), ("adamw", "torch", False, True),
                ("adamw", "torch", True, True)):
        host._step_costs[key] = (1e-6, 1e-9)
    return host


def test_the_last_backward_lasts_its_inter_node_transfers():
    """EP 8 over nodes of 4 (the all-to-all crosses nodes) on 16 ranks (the data-parallel world
    crosses nodes): the last backward holds the grad sync and that backward's dispatch + combine of
    every MoE layer on one link; its modelled length (2/3 of the micro-batch's compute + the shown
    sync + what of that backward's all-to-alls shows) is shorter, and the difference is added."""
    cfg = m6config.load(CONFIGS / "tiny.yaml", TINY)
    rm = RankMemory(cfg, WORLD, EP, "cuda")
    t = step_time(cfg, WORLD, EP, 4, SLOW, None, model=rm.model)
    layers, n = len(rm.model.moe_layers()), densest_counts(cfg, 2).positions
    # Flat dispatch, the remote rows slower than the local ones: an exchange is its inter-node rows.
    exchange = expert_exchange_s(cfg, n, 2, EP, 4, SLOW)
    assert exchange == pytest.approx(expert_exchange_inter_s(cfg, n, 2, EP, 4, SLOW))
    # Each pass (forward, backward) sends dispatch + combine in 4 chunks behind longer expert
    # compute: one chunk of the pair shows per layer and pass.
    assert t.all_to_all == pytest.approx(2 * layers * 2 * exchange / 4)
    window = 2 / 3 * t.compute + t.grad_sync + layers * 2 * exchange / 4
    load = t.grad_sync + t.grad_sync_hidden + layers * 2 * exchange
    assert t.grad_sync_hidden > 0 and load > window  # the floor binds here
    (w,) = t.link_windows
    assert w.name == "last backward" and w.window_s == pytest.approx(window)
    assert dict(w.transfers) == pytest.approx({"grad sync": t.grad_sync + t.grad_sync_hidden,
                                               "all-to-all": layers * 2 * exchange})
    assert t.link_shared == pytest.approx(load - window)
    assert t.total == pytest.approx(t.compute + t.all_to_all + t.grad_sync + t.small_collectives + t.offload
                                    + t.update + load - window)


def test_nothing_crossing_nodes_leaves_the_prediction_as_it_was():
    """All 16 ranks in one node: the sync and the all-to-all use NVLink, the inter-node link
    carries nothing, and the step is its components' sum as before."""
    cfg = m6config.load(CONFIGS / "tiny.yaml", TINY)
    rm = RankMemory(cfg, WORLD, EP, "cuda")
    t = step_time(cfg, WORLD, EP, 16, SLOW, None, model=rm.model)
    assert t.grad_sync_hidden > 0  # the backward still hides the sync, on NVLink
    assert t.link_shared == 0.0 and t.link_windows == ()
    assert t.total == pytest.approx(t.compute + t.all_to_all + t.grad_sync + t.small_collectives + t.offload + t.update)


def test_the_next_forward_lasts_the_gathers_and_its_all_to_alls():
    """The partitioned zero's forward window with hand numbers: compute 3 s at one micro-batch (a
    forward of 1 s), copies back over a link fast enough to vanish, gathers of 2 s and the
    forward's all-to-alls 0.5 s on the inter-node link, 0.1 s of them shown."""
    cfg = m6config.load(CONFIGS / "tiny.yaml", ["train.global_batch_size=16", "train.micro_batch_size=4",
                                                "memory.host_optimizer=torch", "checkpoint.async_save=false"])
    cfg = apply_choice(cfg, 4, "none", ZERO, 1, None, None, "fp16", "optimizer")
    step = dict(world_size=4, compute_s=3.0, device_other_s=0.0, update_s=0.0, cast_s=0.0, gather_s=2.0,
                copy_Bps=1e30, c=2, bucket_chunk_bytes=1.0, first_share=0.1, num_resident_blocks=4, delayed=False,
                forward_a2a_s=0.1, forward_a2a_inter_s=0.5)
    crossing = partitioned_offload_step(cfg, 1000, 0, **step, gathers_cross_nodes=True)
    shown = weights_back_exposed(2.0, 0.1 * 2.0, 1.0, 4)  # the gathers' stream beside a 1 s forward
    assert next(c for c in crossing.copies if c.name == GATHERS).exposed == pytest.approx(shown)
    w = crossing.link_window
    assert w.window_s == pytest.approx(1.0 + shown + 0.1)
    assert w.excess_s == pytest.approx(2.5 - (1.1 + shown)) and w.excess_s > 0
    inside = partitioned_offload_step(cfg, 1000, 0, **step, gathers_cross_nodes=False)
    assert inside.link_window.load_s == pytest.approx(0.5) and inside.link_window.excess_s == 0.0
    assert inside.offload == pytest.approx(crossing.offload)  # the floor is counted apart from the copies


def test_m6t_partitioned_step_carries_its_inter_node_transfers():
    """M6-T's partitioned plan (bench/results/plan-m6t-zero-partitioned.md): 480 V100s, EP 160, 3
    replicas of every expert, each EDP group across 3 nodes. Every step the rank's link carries
    the experts' reduce-scatter, the weights' all-gathers and the all-to-alls' inter-node part of
    each forward and backward; the step lasts at least their sum (it did not before the floor)."""
    cfg = m6config.load(CONFIGS / "m6-1t.yaml", [
        "train.global_batch_size=960", "parallel.expert_parallel_size=160", "train.micro_batch_size=2",
        "memory.activation_checkpointing=auto", "memory.activation_budget_gb=17.544", "memory.offload=zero",
        "parallel.shard=optimizer", "model.moe.a2a_overlap_degree=4", "model.moe.a2a_dispatch=node_aware",
        "memory.offload_blocks=[]", "memory.host_grad_dtype=fp32", "optim.delayed_update=true",
        "memory.host_optimizer=torch", "checkpoint.async_save=false"])
    hw = GPUS["v100"]
    rm = RankMemory(cfg, 480, 160, "cuda")
    t = step_time(cfg, 480, 160, 8, hw, _host(), model=rm.model)
    layers = len(rm.model.moe_layers())
    a2a = 4 * layers * expert_exchange_inter_s(cfg, densest_counts(cfg, 2).positions, 2, 160, 8, hw)  # accum 1
    gathers = next(c for c in t.copies if c.name == GATHERS).seconds
    carried = t.grad_sync + t.grad_sync_hidden + gathers + a2a
    assert carried > t.total - t.link_shared  # the double booking the floor removes
    assert t.total >= carried
    assert {w.name for w in t.link_windows} == {"last backward", "next forward"}
