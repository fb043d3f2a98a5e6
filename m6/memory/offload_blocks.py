"""Which transformer blocks stream their weights from the host (``memory.offload_blocks``, with
``memory.offload: optimizer+params`` or ``zero``, where they stream in 16-bit); the others stay on
the device for the whole run.

    all        every block (each on the device only around its forward and its backward)
    [i, ...]   those blocks
    auto       on CUDA, as many blocks kept on the device as the memory estimate (m6.memory.estimate)
               fits in the device's total memory, ``AUTO_MEMORY_FRACTION`` of it (the allocator's
               fragmentation and the CUDA context need the rest); kept from the last block down,
               since backward starts there right after the forward, when a streamed block would
               have to be fetched again at once. On a CPU device the device memory is the host's:
               streaming saves nothing, so auto keeps every block (and says so).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from m6.config import Config
from m6.memory.memory_report import estimate_memory

AUTO_MEMORY_FRACTION = 0.9


def streamed_block_indices(cfg: Config, num_blocks: int) -> list[int]:
    """The blocks memory.offload_blocks names (all: every one); auto must be resolved first."""
    blocks = cfg.memory.offload_blocks
    assert blocks != "auto", "resolve memory.offload_blocks=auto with resolve_offload_blocks first"
    return list(range(num_blocks)) if blocks == "all" else sorted(blocks)


def resolve_offload_blocks(cfg: Config, model: nn.Module, no_decay: set[int], world_size: int, ep: int,
                           device: torch.device, log: Callable[[str], None]) -> list[int]:
    """The indices of the blocks to stream for this run (see the module docstring)."""
    num_blocks = len(model.blocks)
    if cfg.memory.offload not in ("optimizer+params", "zero"):
        return []
    if cfg.memory.offload_blocks != "auto":
        return streamed_block_indices(cfg, num_blocks)
    if device.type != "cuda":
        log("memory.offload_blocks=auto on a CPU device: device and host memory are one, so every block stays "
            "resident (nothing streamed)")
        return []
    budget = AUTO_MEMORY_FRACTION * torch.cuda.get_device_properties(device).total_memory

    def peak(streamed: list[int]) -> float:
        trial = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, offload_blocks=streamed))
        return estimate_memory(trial, model, no_decay, world_size, ep, "cuda").peak_device

    streamed = blocks_to_stream(num_blocks, peak, budget)
    log(f"memory.offload_blocks=auto: {num_blocks - len(streamed)} of {num_blocks} blocks stay on the device, "
        f"{len(streamed)} stream from the host (estimated peak {peak(streamed) / 2**30:.2f} GiB of "
        f"{budget / 2**30:.2f} GiB = {AUTO_MEMORY_FRACTION} of the device's memory)")
    return streamed


def blocks_to_stream(num_blocks: int, peak: Callable[[list[int]], float], budget: float) -> list[int]:
    """The fewest blocks to stream, 0..k-1, so that ``peak(streamed)`` (device bytes) fits ``budget``:
    blocks are kept on the device from the last one down (see the module docstring). Streaming
    one more block k saves its bytes everywhere but in k's own backward, which also has block k-1
    prefetched beside it (m6.memory.offload.ParamStreamer); that outweighs the saving only where
    the peak is in k's backward, in practice the last block's (the one with most activations held
    after the head's, whose backward holds no streamed block). So the count is found by bisection,
    log2(blocks) estimates, over all the blocks or, where streaming every one does not fit, over
    all but the last; what it returns fits. All blocks when no count fits (the caller tells it
    from the peak)."""
    lo, hi = 0, num_blocks  # streaming hi blocks fits (or hi = all); find the least that fits
    if peak(list(range(hi))) > budget:
        if num_blocks < 2 or peak(list(range(num_blocks - 1))) > budget:
            return list(range(num_blocks))
        hi = num_blocks - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if peak(list(range(mid))) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return list(range(hi))
