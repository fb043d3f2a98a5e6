"""The training loss, written once: target-token cross-entropy normalised by the GLOBAL step's
target count, plus the MoE auxiliary losses averaged over the micro-batches that formed them.

Normalising by the target tokens of the whole global step (all ranks, all micro-batches), not per
micro-batch or per rank, makes the loss, and so the gradient sum over ranks, the same however the
global batch is split. The aux loss is a mean too: over the accumulation micro-batches, and with
aux_loss_scope=local over the ranks as well (each rank's aux comes from its own tokens, and the
gradients of all ranks are summed), so its gradient does not grow with the number of ranks. Being
a mean of per-micro-batch losses, each a nonlinear function of its micro-batch's routing
statistics, it does depend on how the step is cut into micro-batches (docs/moe.md).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from m6.data.batch import MultimodalBatch
from m6.model import M6Model


def forward_loss_sums(model: M6Model, batch: MultimodalBatch,
                      autocast: AbstractContextManager) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of target-token cross-entropy, summed MoE aux loss) for one micro-batch."""
    with autocast:
        hidden, aux = model(batch.images, batch.has_image, batch.text_ids, batch.segment_ids)
        return model.target_loss_sum(hidden, batch.labels, batch.num_target_tokens), aux


def aux_loss_ranks(aux_loss_scope: str, world_size: int) -> int:
    """How many ranks' aux losses the summed gradients add up: each rank's own with scope local;
    one shared global value with scope global (its gradient is already split over the ranks by
    m6.moe.GlobalRoutingStats)."""
    return world_size if aux_loss_scope == "local" else 1


def micro_batch_loss(lm_sum: torch.Tensor, aux: torch.Tensor, step_targets: float,
                     accumulation_steps: int, aux_ranks: int = 1) -> torch.Tensor:
    """What one micro-batch backpropagates: its share of the step's mean target loss and of the
    aux loss (each micro-batch's aux is a mean over its own tokens, hence / accumulation, and /
    aux_ranks when every rank adds its own, see ``aux_loss_ranks``)."""
    return lm_sum / max(step_targets, 1) + aux / (accumulation_steps * aux_ranks)


def moe_loss_terms(model: M6Model, lm_sum: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """[4] float64 (lm sum, weighted aux, unweighted balance, unweighted z) of one micro-batch,
    detached, kept on the device: the step reads them all in one host sync."""
    layers = list(model.moe_layers().values())
    zero = aux.detach().new_zeros(())
    balance = sum((layer.stats.aux_loss for layer in layers), zero)
    z = sum((layer.stats.z_loss for layer in layers), zero)
    return torch.stack([lm_sum.detach().double(), aux.detach().double(), balance.double(), z.double()])
