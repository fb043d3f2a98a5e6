"""The planner's granular offload: with memory.offload=optimizer+params on a GPU it streams only the
blocks the device cannot keep (the first ones; what memory.offload_blocks=auto picks at start-up),
writes them as an explicit list train.py loads, and times only their traffic."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from m6.config import load
from m6.memory.offload_blocks import AUTO_MEMORY_FRACTION
from m6.plan.memory import RankMemory
from m6.plan.search import apply_choice, search
from m6.plan.timing import GPUS, HostProfile

GPU_2B = Path(__file__).resolve().parents[2] / "configs" / "m6-gpu-2b.yaml"
NARROW = dict(eps=[1], micro_batches=[1], recompute=("full",), offload=("optimizer+params",), apply_groups=(1,),
              a2a=(None,), shard=("none",))


def test_streams_only_the_blocks_that_do_not_fit():
    cfg = load(GPU_2B)
    hw = GPUS["h100"]
    rm = RankMemory(cfg, 1, 1, "cuda")

    def peak(streamed):
        return rm.report(apply_choice(cfg, 1, "full", "optimizer+params", 1, None, None, hw.precision, "none",
                                      offload_blocks=streamed)).peak_device

    blocks = len(rm.model.blocks)
    every, half = peak(list(range(blocks))), peak(list(range(blocks // 2)))
    assert every < half < peak([])  # each block kept on the device costs device memory
    # A GPU on which streaming half the blocks just fits the auto budget
    small = dataclasses.replace(hw, memory_gib=half / AUTO_MEMORY_FRACTION / 2**30 * 1.0001)
    best = search(cfg, 1, 1, small, HostProfile(1), 4096.0, **NARROW).feasible[0]
    assert best.offload_blocks == list(range(blocks // 2))  # the first ones, the last kept resident
    assert best.memory.peak_device <= AUTO_MEMORY_FRACTION * small.memory_gib * 2**30
    assert f"memory.offload_blocks=[{','.join(map(str, best.offload_blocks))}]" in best.overrides()
    load(GPU_2B, best.overrides())  # a config train.py runs
    # Fewer blocks streamed, less traffic to hide than streaming every block on the same GPU.
    streaming_all = search(cfg, 1, 1, dataclasses.replace(hw, memory_gib=every / AUTO_MEMORY_FRACTION / 2**30 * 1.0001),
                           HostProfile(1), 4096.0, **NARROW).feasible[0]
    assert streaming_all.offload_blocks is None  # every block streams: the plain setting
    assert best.time.offload <= streaming_all.time.offload


def test_a_gpu_that_holds_every_block_streams_none_and_the_plan_says_all():
    """Nothing to stream: the candidate stays offload=optimizer+params with every block streamed
    (offload=optimizer is its own candidate in a full search)."""
    cfg = load(GPU_2B)
    best = search(cfg, 1, 1, GPUS["h100"], HostProfile(1), 4096.0, **NARROW).feasible[0]
    assert best.offload_blocks is None
