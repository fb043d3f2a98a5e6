"""The batch the M6 model consumes, and the collation of samples into it.

Text layout of one row (L = seq_len), with the labels the loss uses::

    position p : 0    1 .. s   s+1   s+2 .. s+n+1   s+n+2   ...   L-1
    text_ids   : BOS  source    SEP   t_1 .. t_n     EOS     PAD   PAD
    segment_ids: 1    1 .. 1    1     2   .. 2       2       0     0
    labels     : -100 -100..    t_1   t_2 .. EOS     -100    -100  -100

Rule: ``labels[b, p] = text_ids[b, p + 1]`` when position ``p + 1`` is a target token
(``segment_ids[b, p + 1] == SEG_TARGET``), else ``IGNORE_INDEX``. So the first target token is
predicted at the (last) SEP, and EOS is predicted at the last target text token. The model's
logits at text position ``p`` are compared with ``labels[:, p]`` directly: no shifting downstream.
The image tokens sit before the text as prefix; the model gives them their own segment.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from m6.batch_format import IGNORE_INDEX, SEG_PAD, SEG_SOURCE, SEG_TARGET  # re-exported: the batch format
from m6.data.byte_tokenizer import ByteTokenizer



@dataclass
class Sample:
    """One record: an optional normalised image float32 [C, H, W], a source and a target text."""

    image: np.ndarray | None
    source: str
    target: str


@dataclass
class MultimodalBatch:
    """Model input: images [B, C, H, W], has_image [B], text_ids / segment_ids / labels [B, L].

    ``num_target_tokens`` is the number of labels != IGNORE_INDEX; leave it at -1 to have it
    counted from ``labels`` (a host sync if labels live on an accelerator).
    """

    images: torch.Tensor  # float32 [B, C, H, W], zeros where has_image is False
    has_image: torch.Tensor  # bool [B]
    text_ids: torch.Tensor  # int64 [B, L]
    segment_ids: torch.Tensor  # int64 [B, L], SEG_PAD / SEG_SOURCE / SEG_TARGET
    labels: torch.Tensor  # int64 [B, L], next target token or IGNORE_INDEX
    num_target_tokens: int = -1

    def __post_init__(self) -> None:
        if self.num_target_tokens < 0:
            self.num_target_tokens = int((self.labels != IGNORE_INDEX).sum().item())

    @property
    def batch_size(self) -> int:
        """Number of rows B."""
        return self.text_ids.shape[0]

    @property
    def seq_len(self) -> int:
        """Number of text positions L."""
        return self.text_ids.shape[1]

    def densest(self) -> MultimodalBatch:
        """A batch of this shape that keeps the most activations for backward: an image in every
        row, no padding (MoE layers route every position) and a label at every text position but
        the last (the LM head and loss see the most targets). For sizing memory, not for training."""
        segments = torch.full_like(self.segment_ids, SEG_TARGET)
        segments[:, 0] = SEG_SOURCE
        labels = torch.full_like(self.labels, IGNORE_INDEX)
        labels[:, :-1] = self.text_ids[:, 1:]
        return MultimodalBatch(self.images, torch.ones_like(self.has_image), self.text_ids, segments, labels,
                               num_target_tokens=self.batch_size * (self.seq_len - 1))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MultimodalBatch:
        """Return a copy with every tensor on ``device``; the token count is carried, not recounted."""
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)

    def pin_memory(self) -> MultimodalBatch:
        """Return a copy in pinned host memory, so DataLoader(pin_memory=True) works on it."""
        pinned = {
            f.name: getattr(self, f.name).pin_memory()
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **pinned)


def encode_sample_text(
    source: str, target: str, tokenizer: ByteTokenizer, seq_len: int
) -> tuple[list[int], list[int]]:
    """Return (source tokens BOS+source+SEP, target tokens target+EOS) truncated to fit ``seq_len``."""
    source_tokens = [tokenizer.bos_id, *tokenizer.encode(source), tokenizer.sep_id]
    target_tokens = [*tokenizer.encode(target), tokenizer.eos_id]
    # The source is never cut (it is the conditioning); at least one target token must survive
    # so every sample contributes to the loss.
    if len(source_tokens) + 1 > seq_len:
        raise ValueError(
            f"source needs {len(source_tokens)} tokens (BOS + {len(source_tokens) - 2} text + SEP) "
            f"but seq_len={seq_len} leaves no room for the first target token "
            f"(source text starts {source[:40]!r})"
        )
    return source_tokens, target_tokens[: seq_len - len(source_tokens)]


def collate(
    samples: Sequence[Sample | None],
    tokenizer: ByteTokenizer,
    seq_len: int,
    image_shape: tuple[int, int, int],
) -> MultimodalBatch:
    """Pad/truncate ``samples`` into a MultimodalBatch with text [B, seq_len], images [B, *image_shape].

    A None sample (a record the loader had to skip) becomes an all-padding row: no image, no loss,
    no routed tokens. The batch keeps its shape, so every rank still runs the same micro-batches.
    """
    if not samples:
        raise ValueError("collate got an empty list of samples")
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (BOS+SEP need room), got {seq_len}")
    batch_size = len(samples)
    images = torch.zeros((batch_size, *image_shape), dtype=torch.float32)
    has_image = torch.zeros(batch_size, dtype=torch.bool)
    text_ids = torch.full((batch_size, seq_len), tokenizer.pad_id, dtype=torch.int64)
    segment_ids = torch.full((batch_size, seq_len), SEG_PAD, dtype=torch.int64)
    labels = torch.full((batch_size, seq_len), IGNORE_INDEX, dtype=torch.int64)

    for b, sample in enumerate(samples):
        if sample is None:
            continue
        if sample.image is not None:
            if tuple(sample.image.shape) != tuple(image_shape):
                raise ValueError(
                    f"sample {b}: image shape {tuple(sample.image.shape)} != image_shape {tuple(image_shape)}"
                )
            images[b] = torch.from_numpy(np.asarray(sample.image, dtype=np.float32))
            has_image[b] = True
        source_tokens, target_tokens = encode_sample_text(sample.source, sample.target, tokenizer, seq_len)
        num_source, num_target = len(source_tokens), len(target_tokens)
        end = num_source + num_target
        text_ids[b, :end] = torch.tensor(source_tokens + target_tokens, dtype=torch.int64)
        segment_ids[b, :num_source] = SEG_SOURCE
        segment_ids[b, num_source:end] = SEG_TARGET
        # Position p predicts token p+1, so the target tokens land one slot to the left:
        # the last source token (SEP) predicts t_1, the last kept target token predicts nothing.
        labels[b, num_source - 1 : end - 1] = torch.tensor(target_tokens, dtype=torch.int64)

    # num_target_tokens is counted in __post_init__ while labels are still on the host.
    return MultimodalBatch(images, has_image, text_ids, segment_ids, labels)
