"""Held-out evaluation: caption loss with the true images and with the images shuffled among the
samples. A model that uses the image has a clearly lower loss with the true ones (``image_gap``)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from m6.batch_format import IGNORE_INDEX
from m6.data.batch import MultimodalBatch
from m6.data.synthetic import shuffled_images

LossSum = Callable[[MultimodalBatch], torch.Tensor]  # a micro-batch -> its summed target loss


@torch.no_grad()
def evaluate_captions(loss_sum: LossSum, eval_batch: Callable[[list[int]], MultimodalBatch], num_samples: int,
                      global_batch_size: int, num_batches: int, micro_batch_size: int,
                      rank_slice: Callable[[list[int]], list[int]], reduce_sum: Callable[[list[float]], list[float]],
                      seed: int) -> dict[str, float]:
    """Mean caption loss over ``num_batches`` global batches of held-out samples (true and shuffled
    images) and their gap. Every rank runs every eval batch (the expert all-to-all needs all of
    them), each on its ``rank_slice`` of the global batch. ``eval_batch(indices)`` collates
    held-out samples on the host, where the caption-only labels, their count and the shuffled
    images are made without touching the device; ``loss_sum`` moves a batch to the device. The
    losses stay there until the end: one host sync per evaluation, not one per batch."""
    if not num_samples:
        return {}
    gb = global_batch_size
    n = min(num_samples, gb * num_batches) // gb * gb or gb
    gen = torch.Generator().manual_seed(seed)
    losses = []  # per micro-batch: [true, shuffled] summed caption losses, on the device
    count = 0
    for start in range(0, n, gb):
        mine = rank_slice([i % num_samples for i in range(start, start + gb)])
        for i in range(0, len(mine), micro_batch_size):
            batch = captions_only(eval_batch(mine[i:i + micro_batch_size]))
            shuffled = shuffled_images(batch, gen) if int(batch.has_image.sum()) > 1 else batch
            losses.append(torch.stack([loss_sum(batch), loss_sum(shuffled)]))
            count += batch.num_target_tokens
    true_sum = shuffled_sum = 0.0
    for true, shuffled in (torch.stack(losses).tolist() if losses else []):
        true_sum += true
        shuffled_sum += shuffled
    true_sum, shuffled_sum, count = reduce_sum([true_sum, shuffled_sum, float(count)])
    out = {"caption_loss": true_sum / max(count, 1), "caption_loss_shuffled_images": shuffled_sum / max(count, 1)}
    out["image_gap"] = out["caption_loss_shuffled_images"] - out["caption_loss"]
    return out


def captions_only(batch: MultimodalBatch) -> MultimodalBatch:
    """``batch`` (on the host) with the labels of samples without an image ignored, and its target
    count taken again: the caption loss is over image samples only."""
    labels = batch.labels.clone()
    labels[~batch.has_image] = IGNORE_INDEX
    return dataclasses.replace(batch, labels=labels, num_target_tokens=-1)


def rank_slice(indices: Sequence[int], rank: int, world_size: int) -> list[int]:
    """This rank's share of a global batch: changing the number of ranks keeps the global batch."""
    n = len(indices) // world_size
    return list(indices[rank * n:(rank + 1) * n])
