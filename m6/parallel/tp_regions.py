"""The boundaries of a tensor-parallel region, as DTensor placements on the job mesh's "tp" dim
(m6.parallel.tensor_parallel, m6.parallel.sequence_parallel). Each function takes and returns
plain local tensors; DTensor's redistribute supplies the collective and its backward.

Shape legend: B batch, S sequence (dim 1 everywhere here), D d_model; a "local" sequence tensor
holds this tp rank's chunk of S (torch.chunk's split: uneven S allowed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


def copy_to_tensor_parallel(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """Enter a split region: forward identity (``x`` is Replicate on the tp mesh); backward sums
    the gradient over the tp group (each rank's is Partial: the share its heads or columns took)."""
    return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def reduce_from_tensor_parallel(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """Leave a split region: forward sums the ranks' Partial outputs (an all-reduce); backward
    identity (the gradient of a Replicate output is whole on every rank)."""
    return DTensor.from_local(x, tp_mesh, [Partial()], run_check=False).redistribute(tp_mesh, [Replicate()]).to_local()


@dataclass
class SequenceShape:
    """The global [B, S, D] of the residual stream in the forward running now (sequence parallel:
    the ranks hold chunks of S, and a gather needs the whole shape when S does not divide)."""

    shape: Optional[torch.Size] = None


def scatter_to_sequence(x_BSD: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """Replicate [B, S, D] -> this rank's chunk of S; backward all-gathers the chunks' gradients."""
    replicated = DTensor.from_local(x_BSD, tp_mesh, [Replicate()], run_check=False)
    return replicated.redistribute(tp_mesh, [Shard(1)]).to_local()


def gather_from_sequence(x_local: torch.Tensor, tp_mesh: DeviceMesh, sequence: SequenceShape,
                         partial_grad: bool) -> torch.Tensor:
    """This rank's chunk of S -> the whole [B, S, D] (an all-gather). Backward: ``partial_grad``
    (a split region follows, each rank's gradient is a share) reduce-scatters the gradient;
    otherwise (replicated work follows: the same gradient on every rank) keeps this rank's chunk."""
    shape = sequence.shape
    stride = (shape[1] * shape[2], shape[2], 1)
    full = DTensor.from_local(x_local, tp_mesh, [Shard(1)], run_check=False, shape=shape, stride=stride)
    full = full.redistribute(tp_mesh, [Replicate()])
    return full.to_local(grad_placements=[Partial()] if partial_grad else None)


def reduce_scatter_to_sequence(y_BSD: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """Leave a split region under sequence parallel: the ranks' Partial [B, S, D] summed and each
    rank keeping its chunk of S (a reduce-scatter); backward all-gathers the gradient."""
    return DTensor.from_local(y_BSD, tp_mesh, [Partial()], run_check=False).redistribute(tp_mesh, [Shard(1)]).to_local()
