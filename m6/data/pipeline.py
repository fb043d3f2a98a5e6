"""Everything the trainer needs from ``cfg.data``, built in one call: tokenizer, train loader, eval set."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from m6.config import Config, micro_batch_size, num_patches, to_dict
from m6.config_loader import ConfigError
from m6.data.batch import Sample
from m6.data.hf_tokenizer import OPTIONAL_ROLES, MissingSpecialTokens
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
    held_out: list[int]  # records held out of each source for the caption eval (data.eval_samples)


def build_tokenizer(cfg: Config) -> TextTokenizer:
    """The configured tokenizer with data.special_tokens mapped, checked against model.vocab_size."""
    try:
        tokenizer = load_tokenizer(cfg.data.tokenizer, to_dict(cfg.data.special_tokens))
    except MissingSpecialTokens as e:
        raise ConfigError(missing_tokens_message(e)) from e
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"data.tokenizer: {e}{relative_to_cwd_note([str(cfg.data.tokenizer)])}") from e
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's "
                          f"{tokenizer.vocab_size} ids (data.tokenizer={cfg.data.tokenizer!r}): set "
                          f"model.vocab_size={tokenizer.vocab_size} (or more)")
    return tokenizer


def missing_tokens_message(e: MissingSpecialTokens) -> str:
    """One line naming each unmapped role's config key and token, the file, and tokens it does have."""
    keys = ", ".join(f"data.special_tokens.{role}={token!r}" for role, token in e.missing.items())
    have = ", ".join(e.available) if e.available else "none that look special"
    hint = "map each role to a token of the file"
    optional = [role for role in e.missing if role in OPTIONAL_ROLES]
    if optional:
        names = ", ".join(f"data.special_tokens.{role}" for role in optional)
        hint += f"; {names} may be null (m6 uses no image token id)"
    return f"{keys}: not in the vocabulary of data.tokenizer ({e.path}); its special tokens include {have}; {hint}"


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
        held_out = [0]
        eval_set = list(eval_samples or [])
    elif d.kind == "synthetic":
        train = SyntheticRecords(SyntheticImageCaptionDataset(d.num_samples, m.image_size, seed=seed,
                                                              text_only_fraction=d.text_only_fraction))
        sizes, weights, skips, held_out = [d.num_samples], [1.0], SkipCounter(), [0]
        eval_set = SyntheticImageCaptionDataset(max(d.eval_samples, 1), m.image_size, seed=seed + EVAL_SEED_OFFSET,
                                                text_only_fraction=0.0) if d.eval_samples else []
    else:
        files = build_file_datasets(d, m.image_size, seed)
        train, sizes, weights, skips, eval_set = files.train, files.sizes, files.weights, files.index_skips, files.eval_samples
        held_out = files.held_out
    # An uneven split (parallel.balance) is given to the loader by the trainer (TrainLoader.set_shares).
    micro = micro_batch_size(cfg.train, world_size) if cfg.parallel.balance == "even" else None
    loader = TrainLoader(train, sizes, weights, seed, cfg.train.global_batch_size, micro,
                         rank, world_size, collator, d.num_workers, d.prefetch_factor, pin_memory)
    return TrainingData(tokenizer, loader, eval_set, collator, skips, list(sizes), list(held_out))
