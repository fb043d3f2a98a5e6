"""The banner's data lines: how many records of each source train and how many the caption eval
holds out (capped at half a small source), and a warning when other images are normalised with
the sample corpus's statistics."""

from __future__ import annotations

from pathlib import Path

import torch

from m6.config import load
from m6.data.make_sample import SAMPLE_IMAGE_MEAN, SAMPLE_IMAGE_STD, sample_png
from m6.data.prepare import ShardWriter
from m6.data.record_dataset import build_file_datasets
from m6.model import build_meta_model
from m6.model.flops import count_parameters
from m6.train.banner import RunFacts, startup_banner

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def _banner(cfg, tmp_path: Path) -> str:
    files = build_file_datasets(cfg.data, cfg.model.image_size, cfg.run.seed)
    facts = RunFacts(world_size=1, expert_parallel_size=1, micro_batch=32, accumulation=1, device=torch.device("cpu"),
                     precision="fp32", size=count_parameters(build_meta_model(cfg.model)), moe_blocks=[1, 3],
                     source_records=files.sizes, tokenizer="byte (vocab 261)", run_dir=tmp_path, start="fresh start",
                     wandb=None, held_out=files.held_out, eval_samples=len(files.eval_samples))
    return startup_banner(cfg, facts)


def _shard(folder: Path, num_images: int) -> Path:
    writer = ShardWriter(str(folder), "mine", 100)
    for i in range(num_images):
        png, caption = sample_png(i)
        writer.write(f"{i:09d}", png, "png", caption)
    writer.close()
    return folder / "mine-000000.tar"


def test_a_small_source_says_how_many_records_train_and_how_many_evaluate(tmp_path):
    shard = _shard(tmp_path, 10)
    cfg = load(TINY, ["data.kind=files", f"data.sources=[{{path: '{shard}', format: tar}}]", "data.eval_samples=128"])
    files = build_file_datasets(cfg.data, cfg.model.image_size, cfg.run.seed)
    assert files.sizes == [5] and files.held_out == [5] and len(files.eval_samples) == 5
    banner = _banner(cfg, tmp_path)
    assert "weight 1, 5 records to train, 5 held out for eval, data.eval_samples=128 capped at half the source\n" in banner
    # Not the sample corpus, normalised with its statistics (tiny.yaml's): named, with both keys.
    warning = [line for line in banner.splitlines() if line.startswith("!! data: images normalised")]
    assert len(warning) == 1 and f"data.image_mean {list(SAMPLE_IMAGE_MEAN)}" in warning[0], banner
    assert f"data.image_std {list(SAMPLE_IMAGE_STD)}" in warning[0]
    own = load(TINY, ["data.kind=files", f"data.sources=[{{path: '{shard}', format: tar}}]", "data.eval_samples=2",
                      "data.image_mean=[0.13, 0.13, 0.13]"])
    banner = _banner(own, tmp_path)
    assert "weight 1, 8 records to train, 2 held out for eval\n" in banner and "!!" not in banner


def test_the_sample_corpus_with_its_own_statistics_gets_no_warning_and_text_only_no_eval(tmp_path, monkeypatch):
    monkeypatch.chdir(TINY.parents[1])  # tiny.yaml's data paths are relative to the repository
    cfg = load(TINY, [])
    assert (list(cfg.data.image_mean), list(cfg.data.image_std)) == (list(SAMPLE_IMAGE_MEAN), list(SAMPLE_IMAGE_STD))
    banner = _banner(cfg, tmp_path)
    assert "weight 0.9, 1,408 records to train, 128 held out for eval\n" in banner and "!!" not in banner
    text_only = load(TINY, ["data.sources=[{path: data/sample/text.txt, format: text}]"])
    banner = _banner(text_only, tmp_path)
    assert "no caption eval: data.eval_samples=128 but no image source" in banner and "!!" not in banner
