"""The file-backed data path: record indexes, the weighted mixture, and the rank/worker-sharded,
resumable loader (real DataLoader worker processes)."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from m6.config import load
from m6.config_loader import ConfigError
from m6.data.make_sample import sample_png, text_document, write_sample
from m6.data.pipeline import build_training_data
from m6.data.prepare import ShardWriter
from m6.data.record_index import build_index
from m6.data.sampler import MixtureSampler
from m6.data.sources import SkipCounter

REPO = Path(__file__).resolve().parents[2]


def write_corpus(root: Path, num_records: int, shard_size: int) -> str:
    root.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(str(root), "c", shard_size)
    for i in range(num_records):
        png, caption = sample_png(i)
        writer.write(f"{i:05d}", png, "png", caption)
    writer.close()
    return str(root / "c-*.tar")


def files_cfg(sources: str, *extra: str):
    return load(None, ["data.kind=files", f"data.sources={sources}", "data.eval_samples=0", "data.seq_len=128",
                       "model.max_text_len=128", "model.image_size=32", "data.num_workers=2", *extra])


def run_rank(cfg, rank: int, world: int, steps: int, state: dict | None = None):
    """(origins per step as seen by this rank, loader state after the steps)."""
    loader = build_training_data(cfg, rank, world).loader
    if state is not None:
        loader.load_state_dict(state)
    seen = []
    for _ in range(steps):
        batches, wait = loader.next_step()
        assert wait >= 0.0
        seen.append([o for b in batches for o in b.origins])
    out = loader.state_dict()
    loader.close()
    return seen, out


def test_every_record_once_per_epoch_at_world_1_2_4_with_two_workers(tmp_path):
    pattern = write_corpus(tmp_path, 48, 10)
    cfg = files_cfg(f"[{{path: '{pattern}'}}]", "train.global_batch_size=8", "train.micro_batch_size=2")
    keys = {f"{i:05d}" for i in range(48)}
    global_orders = {}
    for world in (1, 2, 4):
        per_step = [[] for _ in range(6)]  # 6 steps x 8 = one epoch of 48
        for rank in range(world):
            seen, _ = run_rank(cfg, rank, world, 6)
            for step, origins in enumerate(seen):
                per_step[step].extend(origins)  # ranks in order: the global batch
        flat = [key for step in per_step for _, key in step]
        assert Counter(flat) == Counter(keys), f"world {world}: duplicates or gaps in the epoch"
        global_orders[world] = per_step
    # The split over ranks does not change which samples form each global batch, or their order.
    assert global_orders[1] == global_orders[2] == global_orders[4]


def test_resume_mid_epoch_yields_what_an_uninterrupted_run_sees(tmp_path):
    pattern = write_corpus(tmp_path, 30, 7)
    cfg = files_cfg(f"[{{path: '{pattern}'}}]", "train.global_batch_size=4", "train.micro_batch_size=1")
    straight, _ = run_rank(cfg, 1, 2, 12)  # crosses the epoch boundary (30 / 4 = 7.5 steps)
    first, state = run_rank(cfg, 1, 2, 5)
    rest, _ = run_rank(cfg, 1, 2, 7, state)
    assert first + rest == straight
    # Resuming on a different world size continues the same global stream.
    rank0_of_1, _ = run_rank(cfg, 0, 1, 7, state)
    assert [o[2:] for o in rank0_of_1] == rest  # rank 1 of 2 held the second half of each global batch


def test_mixture_follows_weights_and_each_source_has_whole_epochs():
    mix = MixtureSampler([5, 1000], [0.25, 0.75], seed=3)
    items = mix.take(400)
    per_source = Counter(s for s, _, _ in items)
    assert per_source == {0: 100, 1: 300}
    small = [(r, e) for s, r, e in items if s == 0]
    for epoch in range(20):
        assert sorted(r for r, e in small if e == epoch) == list(range(5))
    # State round trip mid-stream.
    again = MixtureSampler([5, 1000], [0.25, 0.75], seed=3)
    again.take(123)
    state = again.state_dict()
    fresh = MixtureSampler([5, 1000], [0.25, 0.75], seed=3)
    fresh.load_state_dict(state)
    assert fresh.take(277) == items[123:]


def test_bad_records_are_skipped_counted_and_reported(tmp_path):
    good = write_corpus(tmp_path / "good", 6, 6)
    bad = tmp_path / "bad.tar"
    with tarfile.open(bad, "w") as tar:
        def add(name, data):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        add("a.png", b"not an image at all")  # corrupt image
        add("a.txt", b"a caption")
        add("b.png", sample_png(0)[0])  # no caption member
        add("c.txt", b"caption without an image")  # missing image (counted while indexing)
        add("d.png", sample_png(1)[0])
        add("d.txt", b"\xff\xfe bad utf-8")  # undecodable caption
        add("e.png", sample_png(2)[0])
        add("e.txt", b"a fine caption")
    (tmp_path / "empty.tar").write_bytes(b"")
    truncated = tmp_path / "trunc.tar"
    truncated.write_bytes(Path(good.replace("*", "000000")).read_bytes()[:5000])
    sources = (f"[{{path: ['{good}', '{bad}', '{tmp_path / 'empty.tar'}', '{truncated}']}}]")
    cfg = files_cfg(sources, "train.global_batch_size=4", "data.num_workers=0")
    data = build_training_data(cfg, 0, 1)
    assert data.index_skips.counts["missing_image"] == 1
    assert data.index_skips.counts["empty_shard"] == 1
    assert data.index_skips.counts["truncated_shard"] == 1
    loader = data.loader
    size = loader.sizes[0]
    rows, skips = [], []
    for _ in range((size + 3) // 4):
        batches, _ = loader.next_step()
        for b in batches:
            assert b.batch.batch_size == 4  # skipped records become padding rows: shapes stay fixed
            rows.extend(b.origins)
            skips.extend(b.skips)
    reasons = Counter(s.reason for s in skips)
    assert reasons["corrupt_image"] >= 1 and reasons["missing_caption"] >= 1 and reasons["undecodable_text"] >= 1
    bad_keys = {s.key for s in skips if s.source == str(bad)}
    assert {"a", "b", "d"} <= bad_keys and "e" not in bad_keys
    assert loader.skip_counts == Counter(s.reason for s in skips)


def test_start_up_errors_name_the_source(tmp_path):
    with pytest.raises(ConfigError, match=r"data.sources\[0\].path.*missing"):
        build_training_data(files_cfg(f"[{{path: '{tmp_path}/none-{{0..3}}.tar'}}]"), 0, 1)
    with pytest.raises(ConfigError, match="data.sources is empty"):
        load(None, ["data.kind=files"])
    gz = tmp_path / "x.tar.gz"
    with gzip.open(gz, "wb") as f:
        f.write(b"\0" * 1024)
    with pytest.raises(ConfigError, match=r"data.sources\[1\].*compressed"):
        build_training_data(files_cfg(f"[{{path: '{write_corpus(tmp_path, 2, 2)}'}}, {{path: '{gz}'}}]"), 0, 1)
    (tmp_path / "blank.txt").write_text("\n\n")
    with pytest.raises(ConfigError, match=r"data.sources\[0\].path.*no usable record"):
        build_training_data(files_cfg(f"[{{path: '{tmp_path}/blank.txt', format: text}}]"), 0, 1)
    with pytest.raises(ConfigError, match="data.tokenizer"):
        build_training_data(files_cfg(f"[{{path: '{tmp_path}/c-*.tar'}}]", f"data.tokenizer={tmp_path}/tok.json"), 0, 1)


def test_text_and_manifest_sources_and_hf_tokenizer(tmp_path):
    from m6.data.bpe_tokenizer import train_bpe
    write_sample(str(tmp_path), pairs=8, shard_size=8, docs=20)
    (tmp_path / "img").mkdir()
    lines = []
    for i in range(4):
        png, caption = sample_png(100 + i)
        (tmp_path / "img" / f"{i}.png").write_bytes(png)
        lines.append(f'{{"image": "img/{i}.png", "text": "{caption}"}}')
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    tok = tmp_path / "tok.json"
    train_bpe([str(tmp_path / "text.txt")], vocab_size=300, out_path=tok)
    cfg = files_cfg(f"[{{path: '{tmp_path}/m.jsonl', format: jsonl}}, {{path: '{tmp_path}/text.txt', format: text}}]",
                    f"data.tokenizer={tok}", "model.vocab_size=300", "train.global_batch_size=6",
                    "data.num_workers=0")
    data = build_training_data(cfg, 0, 1)
    assert data.tokenizer.vocab_size <= 300
    batches, _ = data.loader.next_step()
    origins = [o for b in batches for o in b.origins]
    assert Counter(os.path.basename(f) for f, _ in origins) == {"m.jsonl": 3, "text.txt": 3}
    assert all(not b.skips for b in batches)
    texts = {text_document(i) for i in range(20)}
    assert any(key.startswith("line ") for _, key in origins) and texts


def test_embedded_sample_indexes_cleanly():
    cfg = load(str(REPO / "configs" / "tiny.yaml"), ["data.num_workers=0"])
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        data = build_training_data(cfg, 0, 1)
    finally:
        os.chdir(cwd)
    assert data.index_skips.total == 0
    assert data.loader.sizes == [1536 - cfg.data.eval_samples, 1024] and len(data.eval_set) == cfg.data.eval_samples


def test_sample_generation_is_deterministic(tmp_path):
    write_sample(str(tmp_path / "a"), pairs=5, shard_size=3, docs=4)
    write_sample(str(tmp_path / "b"), pairs=5, shard_size=3, docs=4)
    for name in ("sample-000000.tar", "sample-000001.tar", "text.txt"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    index = build_index("tar", str(tmp_path / "a" / "sample-*.tar"), SkipCounter())
    assert len(index) == 5 and index.read(4).text == sample_png(4)[1]
