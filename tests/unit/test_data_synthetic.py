"""Tokenizer, batch collation and the synthetic image-caption task."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from m6.data.batch import IGNORE_INDEX, SEG_PAD, SEG_SOURCE, SEG_TARGET, MultimodalBatch, Sample, collate
from m6.data.synthetic import (
    BACKGROUND_RGB,
    CAPTION_PROMPT,
    COLOURS,
    GRID_SIZE,
    POSITIONS,
    SyntheticImageCaptionDataset,
    denormalize_image,
    shuffled_images,
)
from m6.data.byte_tokenizer import ByteTokenizer

TOK = ByteTokenizer()
PHRASE_TO_CELL = {phrase: cell for cell, phrase in POSITIONS.items()}


# ---------------------------------------------------------------- tokenizer
def test_tokenizer_ids_and_vocab() -> None:
    assert TOK.vocab_size == 261
    ids = (TOK.pad_id, TOK.bos_id, TOK.eos_id, TOK.sep_id, TOK.img_id)
    assert ids == (256, 257, 258, 259, 260)


@pytest.mark.parametrize("text", ["", "a red circle at the top", "一个红色的圆在左上角", "mixé 中文 🙂\n"])
def test_tokenizer_round_trip(text: str) -> None:
    ids = TOK.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert TOK.decode(ids) == text


def test_tokenizer_decode_skips_specials_and_replaces_bad_bytes() -> None:
    ids = [TOK.bos_id, *TOK.encode("红 ok"), TOK.sep_id, TOK.img_id, TOK.eos_id, TOK.pad_id]
    assert TOK.decode(ids) == "红 ok"
    assert TOK.decode(torch.tensor(ids)) == "红 ok"
    # A Chinese character cut in half must not raise.
    assert TOK.decode(TOK.encode("红")[:2]) == "\ufffd"
    assert len(TOK.encode("红")) == 3


# ---------------------------------------------------------------- collate
def reference_labels(text_ids: list[int], segment_ids: list[int]) -> list[int]:
    """Obviously-correct rule: label p = token p+1 if p+1 is a target position, else ignore."""
    out = []
    for p in range(len(text_ids)):
        nxt = p + 1
        out.append(text_ids[nxt] if nxt < len(text_ids) and segment_ids[nxt] == SEG_TARGET else IGNORE_INDEX)
    return out


def test_collate_layout_exact() -> None:
    image = np.full((3, 4, 4), 0.5, dtype=np.float32)
    batch = collate([Sample(image, "ab", "xy"), Sample(None, "", "z")], TOK, 9, (3, 4, 4))
    B, S, E, P = TOK.bos_id, TOK.sep_id, TOK.eos_id, TOK.pad_id
    a, b, x, y, z = (ord(c) for c in "abxyz")
    assert batch.text_ids.tolist() == [[B, a, b, S, x, y, E, P, P], [B, S, z, E, P, P, P, P, P]]
    assert batch.segment_ids.tolist() == [[1, 1, 1, 1, 2, 2, 2, 0, 0], [1, 1, 2, 2, 0, 0, 0, 0, 0]]
    n = IGNORE_INDEX
    assert batch.labels.tolist() == [[n, n, n, x, y, E, n, n, n], [n, z, E, n, n, n, n, n, n]]
    assert batch.num_target_tokens == 5
    assert batch.has_image.tolist() == [True, False]
    assert torch.equal(batch.images[0], torch.full((3, 4, 4), 0.5))
    assert not batch.images[1].any()
    assert batch.text_ids.dtype == batch.segment_ids.dtype == batch.labels.dtype == torch.int64
    assert batch.images.dtype == torch.float32 and batch.has_image.dtype == torch.bool


def test_collate_matches_reference_rule() -> None:
    samples = [Sample(None, "src " * k, "tgt 中文" * (3 - k)) for k in range(4)]
    batch = collate(samples, TOK, 40, (3, 2, 2))
    for row in range(len(samples)):
        ids, seg = batch.text_ids[row].tolist(), batch.segment_ids[row].tolist()
        assert batch.labels[row].tolist() == reference_labels(ids, seg)
        # Segments are contiguous: source, then target, then pad.
        assert seg == sorted(seg, key=lambda s: {SEG_SOURCE: 0, SEG_TARGET: 1, SEG_PAD: 2}[s])
        pad = [i for i, s in enumerate(seg) if s == SEG_PAD]
        assert all(ids[i] == TOK.pad_id for i in pad)
        target = [t for t, s in zip(ids, seg) if s == SEG_TARGET]
        assert TOK.decode(target) == samples[row].target and target[-1] == TOK.eos_id
    assert batch.num_target_tokens == int((batch.labels != IGNORE_INDEX).sum())


def test_collate_truncates_target_end_first() -> None:
    source_len = 2 + len("hello")
    batch = collate([Sample(None, "hello", "abcdef")], TOK, source_len + 3, (1, 1, 1))
    assert TOK.decode(batch.text_ids[0]) == "helloabc"  # source intact, target cut at the end
    assert batch.segment_ids[0].tolist().count(SEG_TARGET) == 3
    assert TOK.eos_id not in batch.text_ids[0].tolist()
    # Tightest fit: only the first target token survives and is predicted at SEP.
    batch = collate([Sample(None, "hello", "abcdef")], TOK, source_len + 1, (1, 1, 1))
    assert batch.text_ids[0, -1] == ord("a") and batch.text_ids[0, -2] == TOK.sep_id
    assert batch.labels[0].tolist() == [IGNORE_INDEX] * (source_len - 1) + [ord("a"), IGNORE_INDEX]
    assert batch.num_target_tokens == 1


def test_collate_errors() -> None:
    with pytest.raises(ValueError, match=r"7 tokens.*seq_len=7"):
        collate([Sample(None, "hello", "x")], TOK, 7, (1, 1, 1))
    with pytest.raises(ValueError, match="image shape"):
        collate([Sample(np.zeros((3, 2, 2), np.float32), "", "x")], TOK, 8, (3, 4, 4))


def test_batch_to_keeps_count() -> None:
    batch = collate([Sample(None, "a", "bc")], TOK, 8, (3, 2, 2))
    moved = batch.to("meta")
    assert moved.text_ids.device.type == "meta" and moved.images.device.type == "meta"
    assert moved.num_target_tokens == batch.num_target_tokens == 3
    assert isinstance(moved, MultimodalBatch)


def test_densest_batch_has_no_padding_and_the_most_targets() -> None:
    batch = collate([Sample(np.ones((3, 2, 2), np.float32), "ab", "xy"), Sample(None, "", "z")], TOK, 9, (3, 2, 2))
    dense = batch.densest()
    assert dense.has_image.tolist() == [True, True]
    assert dense.segment_ids.tolist() == [[1] + [2] * 8] * 2
    assert dense.labels[:, :-1].tolist() == batch.text_ids[:, 1:].tolist()
    assert (dense.labels[:, -1] == IGNORE_INDEX).all()
    for row in range(2):  # the collate rule holds: a label where the next position is a target
        assert dense.labels[row].tolist() == reference_labels(dense.text_ids[row].tolist(), dense.segment_ids[row].tolist())
    assert dense.num_target_tokens == int((dense.labels != IGNORE_INDEX).sum()) == 2 * 8 > batch.num_target_tokens
    assert dense.images is batch.images and dense.text_ids is batch.text_ids


# ---------------------------------------------------------------- synthetic task
def samples_equal(a: Sample, b: Sample) -> bool:
    same_image = (a.image is None and b.image is None) or (
        a.image is not None and b.image is not None and np.array_equal(a.image, b.image)
    )
    return same_image and a.source == b.source and a.target == b.target


def test_synthetic_is_deterministic_per_index() -> None:
    d1 = SyntheticImageCaptionDataset(64, image_size=32, seed=3)
    d2 = SyntheticImageCaptionDataset(64, image_size=32, seed=3)
    assert all(samples_equal(d1[i], d2[i]) for i in range(64))
    assert samples_equal(d1[5], d1[5])
    assert not any(samples_equal(d1[i], d1[i + 1]) for i in range(63))
    other_seed = SyntheticImageCaptionDataset(64, image_size=32, seed=4)
    assert not all(samples_equal(d1[i], other_seed[i]) for i in range(8))


def test_synthetic_sharding_is_a_view_of_the_global_sequence() -> None:
    full = SyntheticImageCaptionDataset(30, seed=1)
    shards = [SyntheticImageCaptionDataset(30, seed=1, rank=r, world_size=4) for r in range(4)]
    assert [len(s) for s in shards] == [7, 7, 7, 7]
    seen = set()
    for rank, shard in enumerate(shards):
        for i in range(len(shard)):
            g = shard.global_index(i)
            assert g == rank + 4 * i and samples_equal(shard[i], full[g])
            seen.add(g)
    assert len(seen) == 28
    with pytest.raises(ValueError):
        SyntheticImageCaptionDataset(30, rank=4, world_size=4)


def test_synthetic_text_only_fraction() -> None:
    def count_text_only(fraction: float) -> int:
        ds = SyntheticImageCaptionDataset(400, seed=0, text_only_fraction=fraction)
        return sum(ds[i].image is None for i in range(len(ds)))

    assert count_text_only(0.0) == 0
    assert count_text_only(1.0) == 400
    assert 50 <= count_text_only(0.2) <= 110
    ds = SyntheticImageCaptionDataset(50, seed=0, text_only_fraction=1.0)
    assert all(ds[i].target and ds[i].source != CAPTION_PROMPT for i in range(50))


def parse_caption(caption: str) -> list[tuple[str, str, str, tuple[int, int]]]:
    """Caption -> [(size, colour, shape, cell)], using only the public vocab tables."""
    objects = []
    for part in caption.split(" and "):
        words = part.split(" ")
        assert words[0] == "a" and len(words) >= 5, caption
        objects.append((words[1], words[2], words[3], PHRASE_TO_CELL[" ".join(words[4:])]))
    return objects


def foreground_in_cell(raw: np.ndarray, cell: tuple[int, int]) -> np.ndarray:
    """Foreground pixels' RGB [N, 3] inside one grid cell of a raw image [3, H, W]."""
    size = raw.shape[-1]
    lo = lambda k: int(round(k * size / GRID_SIZE))  # noqa: E731
    patch = raw[:, lo(cell[0]) : lo(cell[0] + 1), lo(cell[1]) : lo(cell[1] + 1)].reshape(3, -1).T
    far_from_background = np.linalg.norm(patch - np.asarray(BACKGROUND_RGB), axis=1) > 0.3
    return patch[far_from_background]


@pytest.mark.parametrize("image_size", [32, 48])
def test_caption_describes_the_pixels(image_size: int) -> None:
    ds = SyntheticImageCaptionDataset(200, image_size=image_size, seed=7, text_only_fraction=0.0)
    pixel_counts: dict[tuple[str, str], list[int]] = {}
    for i in range(len(ds)):
        sample = ds[i]
        assert sample.image.shape == (3, image_size, image_size) and sample.image.dtype == np.float32
        assert sample.source == CAPTION_PROMPT
        raw = denormalize_image(sample.image)
        objects = parse_caption(sample.target)
        named_cells = {obj[3] for obj in objects}
        # Reading order makes the caption a function of the image (no two phrasings of one image).
        assert [obj[3] for obj in objects] == sorted(named_cells) and 1 <= len(objects) <= 2
        for size, colour, shape, cell in objects:
            fg = foreground_in_cell(raw, cell)
            assert len(fg) > 0, (i, sample.target)
            # The named colour is the one painted there, and it is closer than any other colour.
            mean_rgb = fg.mean(axis=0)
            dists = {c: np.linalg.norm(mean_rgb - np.asarray(rgb)) for c, rgb in COLOURS.items()}
            assert min(dists, key=dists.get) == colour and dists[colour] < 0.1, (i, sample.target)
            pixel_counts.setdefault((shape, size), []).append(len(fg))
        for cell in POSITIONS:
            if cell not in named_cells:
                assert len(foreground_in_cell(raw, cell)) == 0, (i, cell, sample.target)
    for shape in ("circle", "square", "triangle"):
        assert max(pixel_counts[(shape, "small")]) < min(pixel_counts[(shape, "large")]), shape


def test_shape_names_match_fill_ratio() -> None:
    """At high resolution a square fills its bounding box, a circle ~pi/4, a triangle ~1/2."""
    ds = SyntheticImageCaptionDataset(60, image_size=96, seed=2, text_only_fraction=0.0)
    expected = {"circle": (0.7, 0.86), "square": (0.9, 1.01), "triangle": (0.4, 0.62)}
    for i in range(len(ds)):
        sample = ds[i]
        raw = denormalize_image(sample.image)
        mask = np.linalg.norm(raw - np.asarray(BACKGROUND_RGB)[:, None, None], axis=0) > 0.3
        for _, _, shape, (row, col) in parse_caption(sample.target):
            cell_mask = mask[row * 32 : (row + 1) * 32, col * 32 : (col + 1) * 32]
            ys, xs = np.nonzero(cell_mask)
            box = (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1)
            low, high = expected[shape]
            assert low <= cell_mask.sum() / box <= high, (i, shape, cell_mask.sum() / box)


def test_different_captions_have_different_objects_in_pixels() -> None:
    ds = SyntheticImageCaptionDataset(40, seed=11, text_only_fraction=0.0)
    masks = {}
    for i in range(len(ds)):
        raw = denormalize_image(ds[i].image)
        masks.setdefault(ds[i].target, []).append(np.linalg.norm(raw - np.asarray(BACKGROUND_RGB)[:, None, None], axis=0) > 0.3)
    captions = list(masks)
    assert len(captions) > 30
    for a, b in zip(captions, captions[1:]):
        assert not np.array_equal(masks[a][0], masks[b][0])


# ---------------------------------------------------------------- shuffled images
def test_shuffled_images_permutes_only_image_rows() -> None:
    ds = SyntheticImageCaptionDataset(64, seed=5, text_only_fraction=0.4)
    batch = collate([ds[i] for i in range(16)], TOK, 128, ds.image_shape)
    has = batch.has_image
    assert 2 <= int(has.sum()) < 16  # the batch mixes both kinds, so the test can fail
    original = batch.images.clone()
    out = shuffled_images(batch, torch.Generator().manual_seed(0))
    assert torch.equal(batch.images, original)  # input untouched
    assert torch.equal(out.has_image, has) and torch.equal(out.text_ids, batch.text_ids)
    assert torch.equal(out.labels, batch.labels) and out.num_target_tokens == batch.num_target_tokens
    assert not out.images[~has].any()
    rows = has.nonzero().flatten().tolist()
    flat_in = [original[r].flatten() for r in rows]
    for r in rows:
        assert not torch.equal(out.images[r], original[r])  # nobody keeps its own image
        assert sum(torch.equal(out.images[r].flatten(), x) for x in flat_in) == 1
    # A permutation: every original image is used exactly once.
    for x in flat_in:
        assert sum(torch.equal(out.images[r].flatten(), x) for r in rows) == 1
    again = shuffled_images(batch, torch.Generator().manual_seed(0))
    assert torch.equal(again.images, out.images)


def test_synthetic_batch_labels_decode_to_captions() -> None:
    ds = SyntheticImageCaptionDataset(8, seed=9, text_only_fraction=0.5)
    samples = [ds[i] for i in range(8)]
    batch = collate(samples, TOK, 160, ds.image_shape)
    for row, sample in enumerate(samples):
        label_ids = batch.labels[row][batch.labels[row] != IGNORE_INDEX].tolist()
        assert label_ids[-1] == TOK.eos_id and TOK.decode(label_ids) == sample.target
