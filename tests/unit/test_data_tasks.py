"""M6 pretraining tasks: span corruption, continuation, and the per-record task mix."""

from __future__ import annotations

import numpy as np
import pytest

from m6.data.batch import SEG_TARGET, Sample, collate
from m6.data.synthetic import CAPTION_PROMPT
from m6.data.tasks import (
    DEFAULT_TASK_WEIGHTS,
    MASK_TOKEN,
    NoApplicableTask,
    TaskMix,
    build_caption,
    build_continue,
    build_denoise,
    build_image_denoise,
    corrupt_text,
    span_mask,
    split_continuation,
    task_names,
)
from m6.data.byte_tokenizer import ByteTokenizer

IMAGE_SHAPE = (3, 8, 8)
IMAGE = np.arange(np.prod(IMAGE_SHAPE), dtype=np.float32).reshape(IMAGE_SHAPE)
TEXT = " ".join(f"w{i}" for i in range(40))  # 40 distinct words
CHINESE = "一个红色的圆在左上角和一个蓝色的方块在右下角旁边还有一只小猫在睡觉"


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def spans_of(mask: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs of True as (start, end) pairs, by a plain loop."""
    spans, start = [], None
    for i, m in enumerate(list(mask) + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def expand(corrupted_units: list[str], original_units: list[str]) -> list[bool] | None:
    """Match corrupted units against the original: each MASK_TOKEN stands for >= 1 original unit.

    Returns the per-original-unit mask of one consistent alignment, or None if none exists
    (kept units out of order, altered, or masks that cannot be filled).
    """
    memo: dict[tuple[int, int], list[bool] | None] = {}

    def solve(i: int, j: int) -> list[bool] | None:
        if (i, j) in memo:
            return memo[(i, j)]
        if i == len(corrupted_units):
            out = [] if j == len(original_units) else None
        elif corrupted_units[i] == MASK_TOKEN:
            out = None
            for k in range(j + 1, len(original_units) + 1):
                rest = solve(i + 1, k)
                if rest is not None:
                    out = [True] * (k - j) + rest
                    break
        elif j < len(original_units) and corrupted_units[i] == original_units[j]:
            rest = solve(i + 1, j + 1)
            out = None if rest is None else [False] + rest
        else:
            out = None
        memo[(i, j)] = out
        return out

    return solve(0, 0)


# ---------------------------------------------------------------- each task's shape
def test_caption_keeps_image_and_prompts() -> None:
    sample = build_caption(IMAGE, "a red circle", rng())
    assert sample.image is IMAGE
    assert (sample.source, sample.target) == (CAPTION_PROMPT, "a red circle")


def test_denoise_drops_image_image_denoise_keeps_it() -> None:
    text_sample = build_denoise(IMAGE, TEXT, rng(1))
    image_sample = build_image_denoise(IMAGE, TEXT, rng(1))
    assert text_sample.image is None and image_sample.image is IMAGE
    assert text_sample.target == TEXT and image_sample.target == TEXT
    # Same rng -> same corruption: the two differ only in the image.
    assert text_sample.source == image_sample.source
    assert MASK_TOKEN in text_sample.source and text_sample.source != TEXT


def test_continue_drops_image() -> None:
    sample = build_continue(IMAGE, TEXT, rng(2))
    assert sample.image is None
    assert sample.source and sample.target
    assert MASK_TOKEN not in sample.source


# ---------------------------------------------------------------- span corruption
@pytest.mark.parametrize("num_units", [1, 2, 5, 7, 20, 40, 101])
def test_span_mask_counts_and_spans(num_units: int) -> None:
    for seed in range(50):
        mask = span_mask(num_units, rng(seed))
        assert mask.shape == (num_units,) and mask.dtype == bool
        expected = min(num_units, max(1, round(0.15 * num_units)))
        assert int(mask.sum()) == expected
        spans = spans_of(mask)
        assert 1 <= len(spans) <= max(1, round(expected / 3))


def test_span_mask_mean_span_length_and_coverage() -> None:
    lengths, hit = [], np.zeros(200)
    for seed in range(400):
        mask = span_mask(200, rng(seed))
        lengths += [end - start for start, end in spans_of(mask)]
        hit += mask
    assert 2.5 <= np.mean(lengths) <= 3.5  # 30 noise units in 10 spans -> exactly 3
    # Spans land everywhere, including the first and last unit.
    assert hit.min() > 0 and abs(hit.mean() / 400 - 0.15) < 1e-9


def test_denoise_words_masked_in_spans_order_kept() -> None:
    original = TEXT.split(" ")
    for seed in range(30):
        corrupted = corrupt_text(TEXT, rng(seed)).split(" ")
        assert len(corrupted) < len(original)
        masked = expand(corrupted, original)
        assert masked is not None, corrupted  # kept words are the original ones, in order
        # Mask markers are never adjacent (a span is one marker), so this alignment is the only one.
        assert all(not (a == b == MASK_TOKEN) for a, b in zip(corrupted, corrupted[1:]))
        assert sum(masked) == 6  # 15% of 40
        assert sum(u == MASK_TOKEN for u in corrupted) == len(spans_of(np.array(masked))) == 2


def test_denoise_chinese_is_character_level() -> None:
    for seed in range(20):
        corrupted = corrupt_text(CHINESE, rng(seed))
        assert " " not in corrupted
        units: list[str] = []
        rest = corrupted
        while rest:  # split into characters and whole MASK_TOKENs
            if rest.startswith(MASK_TOKEN):
                units.append(MASK_TOKEN)
                rest = rest[len(MASK_TOKEN) :]
            else:
                units.append(rest[0])
                rest = rest[1:]
        masked = expand(units, list(CHINESE))
        assert masked is not None
        assert sum(masked) == round(0.15 * len(CHINESE))
    sample = build_denoise(None, CHINESE, rng(3))
    assert sample.target == CHINESE


def test_denoise_one_word_masks_it() -> None:
    assert corrupt_text("hello", rng()) == MASK_TOKEN
    assert corrupt_text("猫", rng()) == MASK_TOKEN
    assert build_denoise(None, "hello", rng()).target == "hello"


# ---------------------------------------------------------------- continuation
def test_continuation_reconstructs_words() -> None:
    cuts = set()
    for seed in range(200):
        source, target = split_continuation(TEXT, rng(seed))
        assert source and target
        assert source + " " + target == TEXT
        cuts.add(len(source.split(" ")))
    assert cuts == set(range(1, 40))  # every boundary reachable, none at the ends


def test_continuation_chinese_and_one_word() -> None:
    for seed in range(20):
        source, target = split_continuation(CHINESE, rng(seed))
        assert source and target and source + target == CHINESE
    assert split_continuation("hello", rng()) == ("", "hello")
    assert split_continuation("a b", rng()) == ("a", "b")
    assert build_continue(None, "猫", rng()) == Sample(None, "", "猫")


# ---------------------------------------------------------------- TaskMix
def draw_counts(mix: TaskMix, image: np.ndarray | None, num_draws: int, seed: int = 0) -> dict[str, int]:
    generator = rng(seed)
    counts = dict.fromkeys(task_names(), 0)
    for _ in range(num_draws):
        counts[mix.choose(image is not None, TEXT, generator)] += 1
    return counts


def test_taskmix_frequencies_match_weights() -> None:
    mix = TaskMix(DEFAULT_TASK_WEIGHTS, seed=0)
    num_draws = 20000
    counts = draw_counts(mix, IMAGE, num_draws)
    for name, weight in DEFAULT_TASK_WEIGHTS.items():
        assert abs(counts[name] / num_draws - weight) < 0.015, (name, counts)
    # Text-only records: renormalised over denoise/continue, never an image task.
    counts = draw_counts(mix, None, num_draws, seed=1)
    assert counts["caption"] == counts["image_denoise"] == 0
    assert abs(counts["denoise"] / num_draws - 0.5) < 0.015


def test_taskmix_build_matches_chosen_task() -> None:
    mix = TaskMix({"caption": 1, "denoise": 1, "continue": 1, "image_denoise": 1}, seed=0)
    generator = rng(5)
    seen = set()
    for _ in range(200):
        sample = mix.build(IMAGE, TEXT, generator)
        if sample.source == CAPTION_PROMPT:
            seen.add("caption")
            assert sample.image is IMAGE and sample.target == TEXT
        elif MASK_TOKEN in sample.source:
            seen.add("image_denoise" if sample.image is not None else "denoise")
            assert sample.target == TEXT
        else:
            seen.add("continue")
            assert sample.image is None and sample.source + " " + sample.target == TEXT
        text_only = mix.build(None, TEXT, generator)
        assert text_only.image is None and text_only.source != CAPTION_PROMPT
    assert seen == set(task_names())


def test_taskmix_deterministic() -> None:
    mix = TaskMix(DEFAULT_TASK_WEIGHTS, seed=7)
    twin = TaskMix(DEFAULT_TASK_WEIGHTS, seed=7)
    a = [mix.build(IMAGE if i % 2 else None, TEXT, mix.record_rng(i)) for i in range(50)]
    b = [twin.build(IMAGE if i % 2 else None, TEXT, twin.record_rng(i)) for i in range(50)]
    assert [(s.source, s.target, s.image is None) for s in a] == [(s.source, s.target, s.image is None) for s in b]
    c = [mix.build(IMAGE, TEXT, TaskMix(DEFAULT_TASK_WEIGHTS, seed=8).record_rng(i)) for i in range(50)]
    assert [s.source for s in c] != [s.source for s in a]


def test_taskmix_errors() -> None:
    with pytest.raises(ValueError, match=r"data\.tasks\.captions.*caption, denoise, continue, image_denoise"):
        TaskMix({"captions": 1.0}, seed=0)
    with pytest.raises(ValueError, match=r"data\.tasks\.denoise.*>= 0"):
        TaskMix({"caption": 1.0, "denoise": -0.1}, seed=0)
    with pytest.raises(ValueError, match=r"data\.tasks\.denoise"):
        TaskMix({"denoise": float("nan")}, seed=0)
    with pytest.raises(ValueError, match="zero"):
        TaskMix({"caption": 0.0, "denoise": 0.0}, seed=0)


def test_no_applicable_task() -> None:
    image_only = TaskMix({"caption": 1.0, "image_denoise": 0.5}, seed=0)
    assert image_only.build(IMAGE, TEXT, rng()).image is IMAGE
    with pytest.raises(NoApplicableTask) as info:
        image_only.build(None, TEXT, rng())
    assert isinstance(info.value, ValueError) and info.value.reason == "no_task"
    # Every task's target is the text, so a blank text fits none.
    with pytest.raises(NoApplicableTask):
        TaskMix(DEFAULT_TASK_WEIGHTS, seed=0).build(IMAGE, "  ", rng())


# ---------------------------------------------------------------- collation
def test_samples_collate() -> None:
    mix = TaskMix(DEFAULT_TASK_WEIGHTS, seed=0)
    records = [(IMAGE, TEXT), (None, TEXT), (IMAGE, CHINESE), (None, "hello"), (IMAGE, "猫")] * 4
    samples = [mix.build(image, text, mix.record_rng(i)) for i, (image, text) in enumerate(records)]
    tokenizer = ByteTokenizer()
    batch = collate(samples, tokenizer, seq_len=512, image_shape=IMAGE_SHAPE)
    assert batch.batch_size == len(samples) and batch.seq_len == 512
    assert batch.has_image.tolist() == [s.image is not None for s in samples]
    for b, sample in enumerate(samples):
        target_ids = batch.text_ids[b][batch.segment_ids[b] == SEG_TARGET].tolist()
        assert tokenizer.decode(target_ids) == sample.target
