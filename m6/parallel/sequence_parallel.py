"""Sequence parallel (parallel.sequence_parallel, with tensor parallel): between the split
regions of m6.parallel.tensor_parallel the residual stream is cut along the sequence, each tp
rank holding its chunk of S, so the norms, residual adds and what they save for backward cost
1/tp per rank instead of being repeated on every rank (Megatron's sequence parallelism).

- The first block takes its rank's chunk of the embeddings (backward: all-gather of the chunks'
  gradients); the last block's output is gathered whole again (the final norm and the head run
  replicated; backward keeps the rank's chunk).
- A split region (attention, dense MLP) all-gathers the normed chunks on entry and
  reduce-scatters on exit (m6.parallel.tp_regions), instead of tensor parallel's identity and
  all-reduce: the same bytes on the wire.
- An MoE layer runs whole, as at tensor parallel: its input is gathered (backward: the rank's
  chunk of the gradient, which is the same on every rank), its output cut back to the rank's
  chunk (backward: all-gather), so every tp rank routes and computes the same tokens.
- The blocks' norms, and a row-parallel bias, see only the rank's tokens: their weights go
  through copy_to_tensor_parallel so their gradients are summed over the tp group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from m6.moe import MoELayer
from m6.parallel.tp_regions import SequenceShape, copy_to_tensor_parallel, gather_from_sequence, scatter_to_sequence


class SequenceParallelLayerNorm(nn.LayerNorm):
    """A LayerNorm over this rank's tokens whose weight and bias gradients are summed over the tp group."""

    tp_mesh: DeviceMesh | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else copy_to_tensor_parallel(self.weight, self.tp_mesh)
        bias = None if self.bias is None else copy_to_tensor_parallel(self.bias, self.tp_mesh)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class SequenceParallelRMSNorm(nn.RMSNorm):
    """An RMSNorm over this rank's tokens whose weight gradient is summed over the tp group."""

    tp_mesh: DeviceMesh | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else copy_to_tensor_parallel(self.weight, self.tp_mesh)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


_NORMS = {nn.LayerNorm: SequenceParallelLayerNorm, nn.RMSNorm: SequenceParallelRMSNorm}


def _sequence_norm(norm: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Same parameters, names and values; the forward sums their gradients over the tp group."""
    if type(norm) not in _NORMS:
        raise TypeError(f"sequence parallel: no sequence-parallel form of {type(norm).__name__}")
    norm.__class__ = _NORMS[type(norm)]
    norm.tp_mesh = tp_mesh


def apply_sequence_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence: SequenceShape) -> None:
    """Cut the residual stream of ``model``'s blocks along the sequence (after
    apply_tensor_parallel(..., sequence=sequence) has set up the split regions)."""
    blocks = list(model.blocks)

    def enter(module, args):
        sequence.shape = args[0].shape  # [B, S, D] of this forward
        return (scatter_to_sequence(args[0], tp_mesh), *args[1:])

    def leave(module, args, output):
        x_local, aux = output
        return gather_from_sequence(x_local, tp_mesh, sequence, partial_grad=False), aux

    blocks[0].register_forward_pre_hook(enter)
    blocks[-1].register_forward_hook(leave)
    for block in blocks:
        _sequence_norm(block.attn_norm, tp_mesh)
        _sequence_norm(block.ffn_norm, tp_mesh)
        if isinstance(block.ffn, MoELayer):
            block.ffn.register_forward_pre_hook(
                lambda module, args: (gather_from_sequence(args[0], tp_mesh, sequence, partial_grad=False), *args[1:]))
            block.ffn.register_forward_hook(
                lambda module, args, output: (scatter_to_sequence(output[0], tp_mesh), *output[1:]))
