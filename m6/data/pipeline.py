"""Everything the trainer needs from ``cfg.data``, built in one call: tokenizer, train loader, eval set."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from m6.config import Config, micro_batch_size, num_patches
from m6.config_loader import ConfigError
from m6.data.batch import Sample
from m6.data.loader import BatchCollator, TrainLoader
from m6.data.record_dataset import SyntheticRecords, UserSamples, build_file_datasets
from m6.data.sources import SkipCounter, relative_to_cwd_note
from m6.data.synthetic import SyntheticImageCaptionDataset
from m6.data.tokenizer import TextTokenizer, load_tokenizer

EVAL_SEED_OFFSET = 7919  # synthetic eval samples: same distribution, different seed


@dataclass
class TrainingData:
    tokenizer: TextTokenizer
    loader: TrainLoader
    eval_set: Sequence[Sample]  # image-caption samples; empty = no caption eval possible
    collator: BatchCollator
    index_skips: SkipCounter  # records skipped while indexing (the same on every rank)
    source_records: list[int]  # usable training records per data source (synthetic: one source)


def build_tokenizer(cfg: Config) -> TextTokenizer:
    """The configured tokenizer, checked against model.vocab_size."""
    try:
        tokenizer = load_tokenizer(cfg.data.tokenizer)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"data.tokenizer: {e}{relative_to_cwd_note([str(cfg.data.tokenizer)])}") from e
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's "
                          f"{tokenizer.vocab_size} ids (data.tokenizer={cfg.data.tokenizer!r})")
    return tokenizer


def build_training_data(cfg: Config, rank: int, world_size: int, pin_memory: bool = False,
                        dataset: Sequence[Sample] | None = None,
                        eval_samples: Sequence[Sample] | None = None) -> TrainingData:
    """Index/prepare the configured data (or take ``dataset``, which replaces data.kind and
    data.sources) and the loader of this rank's micro-batches."""
    d, m, seed = cfg.data, cfg.model, cfg.run.seed
    tokenizer = build_tokenizer(cfg)
    image_shape = (m.image_channels, m.image_size, m.image_size)
    collator = BatchCollator(tokenizer, d.seq_len, image_shape, num_patches(m))
    if dataset is not None:
        if len(dataset) == 0:
            raise ConfigError("the dataset passed to Trainer is empty")
        train, sizes, weights, skips = UserSamples(dataset, image_shape), [len(dataset)], [1.0], SkipCounter()
        eval_set = list(eval_samples or [])
    elif d.kind == "synthetic":
        train = SyntheticRecords(SyntheticImageCaptionDataset(d.num_samples, m.image_size, seed=seed,
                                                              text_only_fraction=d.text_only_fraction))
        sizes, weights, skips = [d.num_samples], [1.0], SkipCounter()
        eval_set = SyntheticImageCaptionDataset(max(d.eval_samples, 1), m.image_size, seed=seed + EVAL_SEED_OFFSET,
                                                text_only_fraction=0.0) if d.eval_samples else []
    else:
        files = build_file_datasets(d, m.image_size, seed)
        train, sizes, weights, skips, eval_set = files.train, files.sizes, files.weights, files.index_skips, files.eval_samples
    loader = TrainLoader(train, sizes, weights, seed, cfg.train.global_batch_size, micro_batch_size(cfg.train, world_size),
                         rank, world_size, collator, d.num_workers, d.prefetch_factor, pin_memory)
    return TrainingData(tokenizer, loader, eval_set, collator, skips, list(sizes))
