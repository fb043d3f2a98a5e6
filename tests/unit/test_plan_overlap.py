"""The planner's overlap model (m6.plan.timing): the all-to-all cut into chunks that overlap the
expert compute (model.moe.a2a_overlap_degree), and the bucketed gradient sync overlapped with the
last micro-batch's backward, on GPUs; neither on a CPU host, whose prediction stays measured."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from m6 import config as m6config
from m6.plan.search import search
from m6.plan.timing import GPUS, HostProfile, cpu_hardware, overlap_degree, pipelined_s, step_time

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = ["train.global_batch_size=64", "train.micro_batch_size=2", "data.seq_len=64"]  # 16 ranks: accumulation 2
WORLD, EP, PER_NODE = 16, 8, 4  # the expert-parallel group spans two nodes


def tiny(*extra: str) -> m6config.Config:
    return m6config.load(CONFIGS / "tiny.yaml", [*TINY, *extra])


def test_a_pipelined_pass_takes_the_longer_part_plus_one_chunk_of_the_other():
    assert pipelined_s(3.0, 2.0, 1) == 5.0  # one chunk: nothing overlaps
    assert pipelined_s(3.0, 2.0, 4) == pytest.approx(3.5)
    assert pipelined_s(2.0, 3.0, 4) == pytest.approx(3.5)
    assert pipelined_s(3.0, 2.0, 10**6) == pytest.approx(3.0)  # fine chunks: the longer one alone


def test_chunked_all_to_all_hides_behind_the_experts_on_a_gpu():
    # A "GPU" slow enough that the tiny model's experts take as long as its exchanges (no latency).
    hw = dataclasses.replace(GPUS["h100"], peak_tflops=0.05, inter_node_GBps=0.5, latency_s=0.0)
    blocking = step_time(tiny(), WORLD, EP, PER_NODE, hw, None)
    assert blocking.all_to_all_hidden == 0.0
    previous = blocking.all_to_all
    for degree in (2, 4):
        t = step_time(tiny(f"model.moe.a2a_overlap_degree={degree}"), WORLD, EP, PER_NODE, hw, None)
        # Less exposed, and what is hidden plus what shows is the blocking time (chunk latencies aside).
        assert t.all_to_all < previous
        assert t.all_to_all + t.all_to_all_hidden == pytest.approx(blocking.all_to_all)
        assert t.compute == blocking.compute and t.grad_sync == blocking.grad_sync
        previous = t.all_to_all
    assert t.all_to_all > 0.0


def test_chunks_of_a_latency_bound_exchange_only_add_latency():
    """The tiny model on an H100: microseconds of expert compute, the exchange its latency; more
    chunks mean more latencies and nothing to hide behind, so the planner would not pick them."""
    hw = GPUS["h100"]
    blocking = step_time(tiny(), WORLD, EP, PER_NODE, hw, None)
    chunked = step_time(tiny("model.moe.a2a_overlap_degree=4"), WORLD, EP, PER_NODE, hw, None)
    assert chunked.all_to_all > blocking.all_to_all and chunked.all_to_all_hidden == 0.0


def test_the_degree_modelled_is_the_configured_one_on_gpus_and_one_on_a_cpu_host():
    hw = cpu_hardware(16.0, 5.0, 1e-4)
    cfgs = [tiny(), tiny("model.moe.a2a_overlap_degree=4")]
    assert [overlap_degree(c, 1e9, hw) for c in cfgs] == [1, 1]
    assert overlap_degree(cfgs[1], 1e9, GPUS["h100"]) == 4
    assert overlap_degree(tiny("model.moe.a2a_overlap_degree=auto"), 5 * 2**20, GPUS["h100"]) == 2  # 2 MiB chunks


def test_gradient_sync_shows_only_what_the_last_backward_cannot_cover():
    hw = GPUS["h100"]
    cfg = tiny()
    t = step_time(cfg, WORLD, EP, PER_NODE, hw, None)  # the replicated grads cross nodes
    assert t.grad_sync > 0.0 and t.grad_sync_hidden > 0.0
    full = t.grad_sync + t.grad_sync_hidden
    # A link slow enough that the sync outlasts the backward: exposed = full - backward.
    slow = dataclasses.replace(hw, inter_node_GBps=0.001)
    s = step_time(cfg, WORLD, EP, PER_NODE, slow, None)
    backward = 2 / 3 * s.compute / 2  # the last of the 2 micro-batches
    assert s.grad_sync == pytest.approx(s.grad_sync + s.grad_sync_hidden - backward)
    assert s.grad_sync_hidden == pytest.approx(backward)
    assert t.grad_sync <= full


def test_the_search_tries_overlap_degrees_on_gpus_and_writes_them_out():
    only = dict(recompute=("none",), offload=("none",), apply_groups=(1,), a2a=(None,), micro_batches=[1],
                shard=("none",))
    found = search(tiny(), WORLD, PER_NODE, GPUS["h100"], HostProfile(1), 1e6, eps=[1, EP], **only)
    degrees = {(c.expert_parallel_size, c.a2a_overlap_degree) for c in found.feasible}
    assert degrees == {(1, 1), (EP, 1), (EP, 2), (EP, 4)}
    best16 = min((c for c in found.feasible if c.expert_parallel_size == EP), key=lambda c: c.time.total)
    assert f"model.moe.a2a_overlap_degree={best16.a2a_overlap_degree}" in best16.overrides()
