"""Training samples from configured sources: index lookup -> read -> decode -> M6 task.

``build_file_datasets(cfg.data, ...)`` indexes every source once at start-up (failing there, naming
the config key, for a missing path or an empty source list), holds a few image records out for
evaluation, and returns the map-style training dataset the loader draws ``(source, record, epoch)``
items from. A record that cannot be used becomes ``None`` plus a SkipExample, never an exception;
the held-out records are read and decoded by the same ``load_record``, and theirs are counted with
the indexing skips (start-up, once per job), so they reach the same skip ledger.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from m6.config import DataConfig, DataSourceConfig
from m6.config_loader import ConfigError
from m6.data.batch import Sample
from m6.data.images import BadRecord
from m6.data.record_index import ManifestIndex, RecordIndex, TarIndex, build_index
from m6.data.sources import SkipCounter, SkipExample, decode_fields, relative_to_cwd_note
from m6.data.synthetic import CAPTION_PROMPT, SyntheticImageCaptionDataset
from m6.data.tasks import NoApplicableTask, TaskMix


# Why RecordDataset can skip a record while reading it (indexing skips are counted in record_index).
RUNTIME_SKIP_REASONS = ("corrupt_image", "missing_caption", "missing_file", "no_task", "too_long",
                        "truncated_shard", "undecodable_text")


@dataclass
class LoadedItem:
    """One drawn item: its Sample, or None with the reason it was skipped."""

    sample: Sample | None
    skip: SkipExample | None = None
    origin: tuple[str, str] = ("", "")  # (file, key) of the record, for reports


def load_record(index: RecordIndex, record: int, image_size: int, train: bool, rng: np.random.Generator | None,
                image_mean: Sequence[float], image_std: Sequence[float]) -> tuple[np.ndarray | None, str] | SkipExample:
    """Read and decode record ``record`` of ``index``: (image [3, S, S] or None, caption), or the
    SkipExample saying why it cannot be used. Training and the eval hold-out both read through here."""
    try:
        raw = index.read(record)
    except BadRecord as e:
        reason = e.reason or ("missing_file" if isinstance(index, ManifestIndex) else "undecodable_text")
        return SkipExample(*index.where(record), reason, str(e))
    return decode_fields(raw, image_size, train, rng, image_mean, image_std)


class RecordDataset:
    """Map-style: ``(source, record, epoch)`` -> LoadedItem; a sample depends only on (seed, item)."""

    def __init__(self, indexes: Sequence[RecordIndex], sizes: Sequence[int], tasks: TaskMix, image_size: int,
                 seed: int, image_mean: Sequence[float], image_std: Sequence[float]) -> None:
        self.indexes, self.sizes = list(indexes), list(sizes)
        self.tasks, self.image_size, self.seed = tasks, image_size, seed
        self.image_mean, self.image_std = tuple(image_mean), tuple(image_std)

    def __getitem__(self, item: tuple[int, int, int]) -> LoadedItem:
        source, record, epoch = item
        index = self.indexes[source]
        # Per (seed, source, record, epoch): crops and tasks vary by epoch, never by rank or worker.
        rng = np.random.default_rng([self.seed, source, record, epoch])
        loaded = load_record(index, record, self.image_size, True, rng, self.image_mean, self.image_std)
        if isinstance(loaded, SkipExample):
            return LoadedItem(None, loaded, (loaded.source, loaded.key))
        image, text = loaded
        origin = index.where(record)
        try:
            return LoadedItem(self.tasks.build(image, text, rng), origin=origin)
        except NoApplicableTask as e:
            return LoadedItem(None, SkipExample(*origin, NoApplicableTask.reason, str(e)), origin)


class SyntheticRecords:
    """The built-in synthetic task behind the same ``(source, record, epoch)`` interface."""

    def __init__(self, dataset: SyntheticImageCaptionDataset) -> None:
        self.dataset = dataset

    def __getitem__(self, item: tuple[int, int, int]) -> LoadedItem:
        return LoadedItem(self.dataset.sample_at(item[1]), origin=("synthetic", f"sample {item[1]}"))


class UserSamples:
    """A user's map-style dataset (``len`` and ``[i] -> Sample``, the Python API's ``dataset=``)
    behind the ``(source, record, epoch)`` interface. Each item is checked as it is drawn, so a
    wrong one stops the run naming its index instead of failing inside the collator."""

    def __init__(self, dataset: Sequence[Sample], image_shape: tuple[int, int, int]) -> None:
        self.dataset, self.image_shape = dataset, tuple(image_shape)

    def __getitem__(self, item: tuple[int, int, int]) -> LoadedItem:
        sample = self.dataset[item[1]]
        where = f"dataset[{item[1]}]"
        if not isinstance(sample, Sample):
            raise TypeError(f"{where} is a {type(sample).__name__}; the dataset passed to Trainer must return "
                            "m6.data.batch.Sample(image, source, target)")
        if sample.image is not None and tuple(np.shape(sample.image)) != self.image_shape:
            raise ValueError(f"{where}.image has shape {tuple(np.shape(sample.image))}; the model takes "
                             f"{self.image_shape} (normalised float32 [C, H, W]: model.image_channels, model.image_size)")
        return LoadedItem(sample, origin=("dataset", str(item[1])))


@dataclass
class FileData:
    """What the trainer needs from configured files: training items, source sizes and weights, eval samples."""

    train: RecordDataset
    sizes: list[int]
    weights: list[float]
    eval_samples: list[Sample]
    index_skips: SkipCounter  # counted while indexing (identical on every rank)
    held_out: list[int]  # records held out for eval per source (not in ``sizes``): data.eval_samples, at most half


def _index_source(i: int, src: DataSourceConfig, skips: SkipCounter) -> RecordIndex:
    key = f"data.sources[{i}]"
    where = relative_to_cwd_note([src.path] if isinstance(src.path, str) else src.path)
    mine = SkipCounter()
    try:
        index = build_index(src.format, src.path, mine)
    except FileNotFoundError as e:
        raise ConfigError(f"{key}.path: {e}{where}") from e
    except OSError as e:  # unreadable (permissions, I/O error): not a record-level problem
        raise ConfigError(f"{key}.path: cannot read {e.filename}: {e.strerror or e}{where}") from e
    except ValueError as e:
        raise ConfigError(f"{key}: {e}{where}") from e
    if len(index) == 0:
        first = "".join(f"; first: {ex.source} [{ex.key}] {ex.reason}: {ex.detail}" for ex in mine.examples[:1])
        raise ConfigError(f"{key}.path {src.path!r} holds no usable record ({mine.total} skipped: "
                          f"{dict(mine.counts)}{first}){where}")
    skips.merge(mine)
    return index


def build_file_datasets(data: DataConfig, image_size: int, seed: int) -> FileData:
    """Index ``data.sources``; the last ``data.eval_samples`` records of the first image source are held out."""
    if not data.sources:
        raise ConfigError("data.sources is empty: data.kind=files needs at least one source "
                          "(path + format tar|jsonl|text)")
    skips = SkipCounter()
    indexes = [_index_source(i, src, skips) for i, src in enumerate(data.sources)]
    sizes = [len(ix) for ix in indexes]
    eval_samples: list[Sample] = []
    held_out = [0] * len(sizes)
    image_source = next((i for i, ix in enumerate(indexes) if isinstance(ix, (TarIndex, ManifestIndex))), None)
    if data.eval_samples and image_source is not None:
        # At most half of the source, so that a small one still trains; the banner says how many.
        held = held_out[image_source] = min(data.eval_samples, sizes[image_source] // 2)
        sizes[image_source] -= held  # training draws records [0, size - held) of that source
        ix = indexes[image_source]
        for record in range(sizes[image_source], sizes[image_source] + held):
            loaded = load_record(ix, record, image_size, False, None, data.image_mean, data.image_std)
            if isinstance(loaded, SkipExample):  # counted with the indexing skips: once per job, in the ledger
                skips.record(*loaded[:3], f"{loaded.detail} (eval hold-out)")
                continue
            image, text = loaded
            assert image is not None, "tar and manifest records always have an image"
            eval_samples.append(Sample(image=image, source=CAPTION_PROMPT, target=text))
    try:
        tasks = TaskMix(data.tasks, seed=seed)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return FileData(RecordDataset(indexes, sizes, tasks, image_size, seed, data.image_mean, data.image_std), sizes,
                    [float(s.weight) for s in data.sources], eval_samples, skips, held_out)
