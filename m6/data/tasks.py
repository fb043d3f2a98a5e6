"""The M6 pretraining tasks: turn one decoded record (image or None, text) into a training Sample.

Four tasks, one drawn per record by ``TaskMix`` among those the record can serve:

    task           needs image   image in Sample   source                 target
    caption        yes           kept              CAPTION_PROMPT         text
    denoise        no            dropped           text with masked spans text
    continue       no            dropped           first words of text    the remaining words
    image_denoise  yes           kept              text with masked spans text

Corruption follows T5/M6 span corruption: ~NOISE_DENSITY of the units are masked in a few
contiguous spans of mean MEAN_SPAN_LENGTH units, each span replaced by one MASK_TOKEN. A unit is a
word when the text contains whitespace, else a character when the text holds CJK-range characters
(Chinese and Japanese are written without spaces), else the whole text is one word ("hello").
MASK_TOKEN is plain text: the byte tokenizer has no special id for it.
Every task needs some text (it is the target), so a blank text has no applicable task.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from m6.data.batch import Sample
from m6.data.synthetic import CAPTION_PROMPT  # one prompt for synthetic and real captions

MASK_TOKEN = "<mask>"
NOISE_DENSITY = 0.15
MEAN_SPAN_LENGTH = 3.0
IMAGE_TASKS = ("caption", "image_denoise")
TEXT_TASKS = ("denoise", "continue")
DEFAULT_TASK_WEIGHTS: dict[str, float] = {"caption": 0.5, "denoise": 0.15, "continue": 0.15, "image_denoise": 0.2}
_WORD = re.compile(r"\S+")
# From CJK Radicals on (kana, ideographs, Hangul, full-width forms, supplementary planes): scripts
# where a space-less text is a run of words, not one word.
FIRST_CHARACTER_LEVEL_CODEPOINT = 0x2E80


class NoApplicableTask(ValueError):
    """No task with weight > 0 can serve this record; the caller counts it as skipped ('no_task')."""

    reason = "no_task"


def task_names() -> tuple[str, ...]:
    """Names of every task, in a fixed order (the order TaskMix draws in)."""
    return ("caption", "denoise", "continue", "image_denoise")


@dataclass(frozen=True)
class TextUnits:
    """A text cut into units: words (with their character spans) or single characters."""

    text: str
    units: list[str]
    starts: list[int]  # character offset of each unit in ``text``
    by_word: bool

    @property
    def joiner(self) -> str:
        """What goes between two units when a text is rebuilt from them."""
        return " " if self.by_word else ""


def split_units(text: str) -> TextUnits:
    """Cut ``text`` into words when it holds whitespace or no CJK-range character, else into characters."""
    stripped = text.strip()
    has_space = any(ch.isspace() for ch in stripped)
    if has_space or all(ord(ch) < FIRST_CHARACTER_LEVEL_CODEPOINT for ch in stripped):
        matches = list(_WORD.finditer(text))
        return TextUnits(text, [m.group() for m in matches], [m.start() for m in matches], by_word=True)
    offset = len(text) - len(text.lstrip())
    return TextUnits(text, list(stripped), list(range(offset, offset + len(stripped))), by_word=False)


def _random_partition(total: int, num_parts: int, rng: np.random.Generator) -> list[int]:
    """Split ``total`` into ``num_parts`` non-negative integers, uniformly over compositions."""
    if num_parts == 1:
        return [total]
    # Stars and bars: choose the bar positions among total + num_parts - 1 slots.
    bars = np.sort(rng.choice(total + num_parts - 1, size=num_parts - 1, replace=False))
    edges = np.concatenate([[-1], bars, [total + num_parts - 1]])
    return [int(n) for n in np.diff(edges) - 1]


def span_mask(
    num_units: int,
    rng: np.random.Generator,
    noise_density: float = NOISE_DENSITY,
    mean_span_length: float = MEAN_SPAN_LENGTH,
) -> np.ndarray:
    """Bool [num_units], True where a unit is masked: round(density * n) units (at least 1) in separate spans."""
    if num_units <= 0:
        return np.zeros(0, dtype=bool)
    num_noise = min(num_units, max(1, round(noise_density * num_units)))
    num_kept = num_units - num_noise
    # Spans must be separated by at least one kept unit, or two of them would merge.
    num_spans = max(1, min(round(num_noise / mean_span_length), num_kept + 1))
    # Each span has >= 1 unit; the kept units form num_spans + 1 gaps whose inner ones have >= 1.
    span_lengths = [n + 1 for n in _random_partition(num_noise - num_spans, num_spans, rng)]
    gaps = _random_partition(num_kept - (num_spans - 1), num_spans + 1, rng)
    gaps = [gaps[0], *(g + 1 for g in gaps[1:-1]), gaps[-1]]
    mask = np.zeros(num_units, dtype=bool)
    position = 0
    for gap, length in zip(gaps, span_lengths):
        position += gap
        mask[position : position + length] = True
        position += length
    assert position + gaps[-1] == num_units and int(mask.sum()) == num_noise
    return mask


def corrupt_text(text: str, rng: np.random.Generator) -> str:
    """``text`` with its span_mask'd units replaced by one MASK_TOKEN per span, units rejoined."""
    split = split_units(text)
    mask = span_mask(len(split.units), rng)
    pieces: list[str] = []
    for i, unit in enumerate(split.units):
        if not mask[i]:
            pieces.append(unit)
        elif i == 0 or not mask[i - 1]:
            pieces.append(MASK_TOKEN)
    return split.joiner.join(pieces)


def split_continuation(text: str, rng: np.random.Generator) -> tuple[str, str]:
    """(prefix, rest) of ``text`` cut at a random unit boundary, >= 1 unit each side; 1 unit -> ('', text)."""
    split = split_units(text)
    if len(split.units) < 2:
        return "", text.strip()
    cut = int(rng.integers(1, len(split.units)))
    start = split.starts[cut]
    return text[:start].strip(), text[start:].strip()


def build_caption(image: np.ndarray, text: str, rng: np.random.Generator) -> Sample:
    """Image -> text."""
    return Sample(image=image, source=CAPTION_PROMPT, target=text)


def build_denoise(image: np.ndarray | None, text: str, rng: np.random.Generator) -> Sample:
    """Corrupted text -> text, image dropped."""
    return Sample(image=None, source=corrupt_text(text, rng), target=text)


def build_continue(image: np.ndarray | None, text: str, rng: np.random.Generator) -> Sample:
    """First part of the text -> the rest, image dropped."""
    prefix, rest = split_continuation(text, rng)
    return Sample(image=None, source=prefix, target=rest)


def build_image_denoise(image: np.ndarray, text: str, rng: np.random.Generator) -> Sample:
    """Image + corrupted caption -> caption."""
    return Sample(image=image, source=corrupt_text(text, rng), target=text)


_BUILDERS = {
    "caption": build_caption,
    "denoise": build_denoise,
    "continue": build_continue,
    "image_denoise": build_image_denoise,
}


class TaskMix:
    """Draws one task per record with the given weights, renormalised over the tasks the record can serve.

    Tasks missing from ``weights`` get weight 0. ``seed`` seeds ``record_rng`` (one generator per
    record index, so a sample depends only on (seed, index), not on sharding or resume point).
    """

    def __init__(self, weights: Mapping[str, float] | None = None, seed: int = 0) -> None:
        weights = dict(DEFAULT_TASK_WEIGHTS if weights is None else weights)
        valid = task_names()
        for name, weight in weights.items():
            if name not in valid:
                raise ValueError(f"data.tasks.{name}: unknown task; valid tasks are {', '.join(valid)}")
            if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
                raise ValueError(f"data.tasks.{name}: weight must be a finite number >= 0, got {weight!r}")
        if not any(weight > 0 for weight in weights.values()):
            raise ValueError(f"data.tasks: every task weight is zero ({weights}); give at least one a weight > 0")
        self.weights: dict[str, float] = {name: float(weights.get(name, 0.0)) for name in valid}
        self.seed = seed
        # has_image -> (applicable task names, cumulative renormalised weights), built once.
        self._table: dict[bool, tuple[list[str], np.ndarray]] = {}
        for has_image in (False, True):
            names = [n for n, w in self.weights.items() if w > 0 and (has_image or n not in IMAGE_TASKS)]
            total = sum(self.weights[n] for n in names)
            self._table[has_image] = (names, np.cumsum([self.weights[n] / total for n in names]))

    def applicable_tasks(self, has_image: bool, text: str) -> list[str]:
        """Tasks with weight > 0 that a record with/without an image and this text can serve."""
        return list(self.probabilities(has_image, text))

    def probabilities(self, has_image: bool, text: str = "x") -> dict[str, float]:
        """Probability of each task for such a record (weights renormalised over applicable tasks)."""
        names, cumulative = self._table[has_image] if text.strip() else ([], np.zeros(0))
        return {name: float(c - prev) for name, c, prev in zip(names, cumulative, [0.0, *cumulative])}

    def choose(self, has_image: bool, text: str, rng: np.random.Generator) -> str:
        """Name of the task drawn for such a record; NoApplicableTask when none can serve it."""
        names, cumulative = self._table[has_image] if text.strip() else ([], np.zeros(0))
        if not names:
            raise NoApplicableTask(
                f"no task with weight > 0 fits a record with{'' if has_image else 'out'} an image "
                f"and {len(text.strip())} non-blank characters (weights {self.weights})"
            )
        index = int(np.searchsorted(cumulative, rng.random(), side="right"))
        return names[min(index, len(names) - 1)]  # min: guards cumulative[-1] rounding below 1

    def build(self, record_image: np.ndarray | None, record_text: str, rng: np.random.Generator) -> Sample:
        """The Sample of the task drawn for this record; all randomness comes from ``rng``."""
        name = self.choose(record_image is not None, record_text, rng)
        return _BUILDERS[name](record_image, record_text, rng)

    def record_rng(self, index: int) -> np.random.Generator:
        """Generator for record ``index``, a function of (seed, index) only."""
        return np.random.default_rng([self.seed, index])

    def __repr__(self) -> str:
        return f"TaskMix(weights={self.weights}, seed={self.seed})"
