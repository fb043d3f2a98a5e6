"""The caption-loss evaluation: built on the host (labels of image samples only, their count, the
shuffled images), so the model's loss can select its target positions from that count."""

from __future__ import annotations

import pytest
import torch

from m6.batch_format import IGNORE_INDEX
from m6.data.batch import collate
from m6.data.byte_tokenizer import ByteTokenizer
from m6.data.synthetic import SyntheticImageCaptionDataset
from m6.train.eval import evaluate_captions


def test_eval_batches_carry_their_caption_target_count():
    data = SyntheticImageCaptionDataset(16, image_size=12, seed=0, text_only_fraction=0.4)
    samples = [data[i] for i in range(16)]
    assert any(s.image is None for s in samples) and any(s.image is not None for s in samples)
    seen = []

    def loss_sum(batch):
        seen.append(batch)
        assert batch.num_target_tokens == int((batch.labels != IGNORE_INDEX).sum())  # what the loss gathers by
        assert bool((batch.labels[~batch.has_image] == IGNORE_INDEX).all())  # captions only
        rows = torch.arange(1, batch.batch_size + 1, dtype=torch.float32)
        return (batch.images.flatten(1).sum(1) * rows).sum() + batch.num_target_tokens  # which row has which image

    out = evaluate_captions(loss_sum, lambda idx: collate([samples[i] for i in idx], ByteTokenizer(), 48, (3, 12, 12)),
                            num_samples=16, global_batch_size=8, num_batches=2, micro_batch_size=4,
                            rank_slice=lambda idx: idx, reduce_sum=lambda values: values, seed=0)
    true, shuffled = seen[0::2], seen[1::2]
    count = sum(b.num_target_tokens for b in true)
    assert count > 0 and len(true) == 4
    assert out["caption_loss"] == pytest.approx(sum(float(loss_sum(b)) for b in true) / count, rel=1e-12)
    assert out["caption_loss_shuffled_images"] == pytest.approx(sum(float(loss_sum(b)) for b in shuffled) / count,
                                                                rel=1e-12)
    assert all(torch.equal(t.labels, s.labels) for t, s in zip(true, shuffled))
    assert out["image_gap"] != 0
