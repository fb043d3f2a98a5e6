"""Dropout under tensor parallel (m6.parallel.tensor_parallel): one mask per tp group where the
activations are replicated, a mask of its own on each tp rank where they are split.

- Replicated regions (the embeddings, the residual stream between split regions, the MoE
  layers): every rank of a tp group draws from the process's default RNG, which starts from the
  same seed on every rank (m6.train.loop.seed_everything) and advances the same way on every rank
  of the group as long as each draws the same numbers: so its dropout masks (and router jitter)
  are the same on the whole group, as the replicated weights need.
- Split regions (the attention core over a rank's own heads; under sequence parallel the dropout
  on a rank's chunk of the sequence, whose length may differ between ranks): random draws there
  differ per rank by design, and their count may too, so they must not touch the default
  stream. ``split_region_rng`` runs them on a generator state of their own: seeded from one draw
  of the default stream (the same on every tp rank, so the default streams stay in step) and the
  tp rank, and restored to the default state afterwards (Megatron's model-parallel RNG tracker,
  without state to carry: the fork is a function of the default stream).

Because the fork's seed is drawn from the default stream, a recompute (torch.utils.checkpoint
with preserve_rng_state, which restores the default CPU and device states before it reruns a part)
draws the same seed and reproduces the same masks; and a checkpoint's RNG state (the default
streams, m6.checkpoint.rng) is all a resume needs.

torch's DTensor ``OffsetBasedRNGTracker`` does this for random ops on DTensors; m6 keeps its tp
activations as plain local tensors (m6.parallel.tensor_parallel), so the fork is done here.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from m6.model.attention import SelfAttention

# Spreads the tp ranks' seeds apart (a large odd constant: seed + rank * it stays distinct mod 2**63).
_RANK_STRIDE = 0x9E3779B97F4A7C15 >> 2


@contextmanager
def split_region_rng(tp_rank: int, device: torch.device) -> Iterator[None]:
    """Run the block inside on a generator state of this tp rank's own (see the module docstring):
    one draw of the default CPU stream (the same on every rank of the tp group) plus the rank seeds
    it; afterwards the default CPU and ``device`` states are back where that draw left them."""
    seed = (int(torch.randint(0, 2**62, (), dtype=torch.int64)) + tp_rank * _RANK_STRIDE) % 2**63
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.default_generator.manual_seed(seed)
        if devices:  # this rank's device only (torch.manual_seed would reseed every GPU)
            torch.cuda.default_generators[device.index if device.index is not None
                                          else torch.cuda.current_device()].manual_seed(seed)
        yield


class TensorParallelSelfAttention(SelfAttention):
    """A split SelfAttention (this rank's heads) whose attention dropout draws this rank's own mask."""

    tp_rank: int = 0

    def forward(self, *args, **kwargs) -> torch.Tensor:
        if not (self.training and self.dropout > 0):
            return super().forward(*args, **kwargs)
        with split_region_rng(self.tp_rank, args[0].device):
            return super().forward(*args, **kwargs)


class SequenceParallelDropout(nn.Dropout):
    """Dropout on this rank's chunk of the sequence (sequence parallel): its own mask per rank."""

    tp_rank: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.p > 0):
            return super().forward(x)
        with split_region_rng(self.tp_rank, x.device):
            return super().forward(x)


def fork_split_region_dropout(model: nn.Module, tp_rank: int, sequence_parallel: bool) -> None:
    """Make the dropout of ``model``'s split regions draw per-rank masks off the default stream:
    every block's attention core; with ``sequence_parallel`` also the blocks' residual dropout
    (on the rank's chunk of S). Same modules, parameters and names; only their forward differs."""
    for block in model.blocks:
        attn = getattr(block, "attn", None)
        if isinstance(attn, SelfAttention):
            attn.__class__ = TensorParallelSelfAttention
            attn.tp_rank = tp_rank
        if sequence_parallel and isinstance(getattr(block, "dropout", None), nn.Dropout):
            block.dropout.__class__ = SequenceParallelDropout
            block.dropout.tp_rank = tp_rank
