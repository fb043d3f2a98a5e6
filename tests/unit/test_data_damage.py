"""Damaged inputs: every record a truncated or damaged shard, manifest or text file costs is counted
under a reason and named (file, key or byte offset); the eval hold-out counts its bad records like the
training range; training goes on with the rest."""

from __future__ import annotations

import gzip
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from m6.config import load
from m6.config_loader import ConfigError
from m6.data.make_sample import sample_png
from m6.data.pipeline import build_training_data
from m6.data.record_dataset import RUNTIME_SKIP_REASONS
from m6.data.record_index import build_index
from m6.data.sources import SHARD_KEY, SkipCounter, iter_tar_samples, split_member_name
from m6.train.state import SkipLedger
from test_data_sources import write_tar

BLOCK = tarfile.BLOCKSIZE


def records(n: int, first: int = 0) -> list[tuple[str, bytes, str]]:
    """(key, png, caption) of ``n`` sample pairs; captions of varied length so that member data
    ends at varied places within its last tar block."""
    out = []
    for i in range(first, first + n):
        png, caption = sample_png(i)
        out.append((f"{i:03d}", png, caption + " " + "x" * (i * 37 % 600)))
    return out


def write_shard(path: Path, recs: list[tuple[str, bytes, str]]) -> str:
    return write_tar(path, [m for key, png, cap in recs for m in ((f"{key}.png", png), (f"{key}.txt", cap.encode()))])


def member_table(path: str) -> list[tarfile.TarInfo]:
    with tarfile.open(path) as tar:
        return tar.getmembers()


def files_cfg(sources: str, *extra: str):
    return load(None, ["data.kind=files", f"data.sources={sources}", "data.eval_samples=0", "data.seq_len=128",
                       "model.max_text_len=128", "model.image_size=32", "data.num_workers=0", *extra])


def expected_loss(members: list[tarfile.TarInfo], cut: int) -> tuple[str, str] | None:
    """(key, reason) a cut at byte ``cut`` must be counted under, None when nothing is lost: the
    record whose member the cut falls in, when that member's name is still readable; else the last
    record read if the cut left it without its caption; else the shard (SHARD_KEY)."""
    for m in members:
        if m.offset <= cut < m.offset_data + m.size:
            if cut >= m.offset_data or cut - m.offset > len(m.name):  # data cut, or the name's NUL is there
                return split_member_name(m.name)[0], "truncated_shard"
            if m.offset == 0:  # a few bytes with no readable name: cannot be told from a file that is no tar
                return SHARD_KEY, "corrupt_shard"
            break
    done = [m for m in members if m.offset_data + m.size <= cut]
    last_end = members[-1].offset_data + -(-members[-1].size // BLOCK) * BLOCK
    if len(done) == len(members) and cut > last_end:
        return None  # only the end-of-archive marker was cut
    if done and done[-1].name.endswith(".png"):
        return split_member_name(done[-1].name)[0], "truncated_shard"
    return SHARD_KEY, "truncated_shard"


# ---------------------------------------------------------------- (a) truncated tar shards
def test_a_cut_anywhere_in_a_shard_is_one_counted_loss_and_every_kept_record_is_whole(tmp_path):
    recs = records(5)
    full = write_shard(tmp_path / "full.tar", recs)
    members = member_table(full)
    data = Path(full).read_bytes()
    by_key = {key: (png, cap) for key, png, cap in recs}
    last_end = members[-1].offset_data + -(-members[-1].size // BLOCK) * BLOCK
    cuts = sorted(set(range(1, last_end + 2 * BLOCK, 61)) | set(range(BLOCK, last_end + BLOCK + 1, BLOCK))
                  | {m.offset + len(m.name) + d for m in members for d in (0, 1)})
    for cut in cuts:
        path = tmp_path / f"cut{cut}.tar"
        path.write_bytes(data[:cut])
        skips = SkipCounter()
        index = build_index("tar", str(path), skips)
        loss = expected_loss(members, cut)
        lost = loss[0] if loss else None
        if loss is None:
            assert skips.total == 0, (cut, skips.examples)
        else:
            assert skips.total == 1, (cut, skips.examples)
            (ex,) = skips.examples
            assert (ex.source, ex.key, ex.reason) == (str(path), *loss), (cut, ex)
            assert f"byte {cut}" in ex.detail or ex.reason == "corrupt_shard", (cut, ex)
        whole = [k for k in by_key if all(m.offset_data + m.size <= cut for m in members
                                           if split_member_name(m.name)[0] == k)]
        assert index.keys == [k for k in whole if k != lost], cut
        for i, key in enumerate(index.keys):  # never a record with part of its bytes
            raw = index.read(i)
            assert (raw.image_bytes, raw.text) == by_key[key], (cut, key)


def test_a_shard_cut_at_64kib_is_reported_with_file_key_and_offset_and_training_goes_on(tmp_path, capsys):
    recs = records(60)
    write_shard(tmp_path / "c-000000.tar", recs[:20])
    cut_path = write_shard(tmp_path / "c-000001.tar", recs[20:])
    members = member_table(cut_path)
    full_size = Path(cut_path).stat().st_size
    assert full_size > 65536
    Path(cut_path).write_bytes(Path(cut_path).read_bytes()[:65536])  # an interrupted copy
    hit = next(m for m in members if m.offset <= 65536 < m.offset_data + m.size)
    lost_key = split_member_name(hit.name)[0]

    cfg = files_cfg(f"[{{path: '{tmp_path}/c-*.tar'}}]", "train.global_batch_size=4", "data.seq_len=1024",
                    "model.max_text_len=1024")  # room for the longest caption
    data = build_training_data(cfg, 0, 1)
    assert dict(data.index_skips.counts) == {"truncated_shard": 1}
    SkipLedger(data.index_skips, lambda values: values, 0).report(data.index_skips, "while indexing data.sources")
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"skipped record while indexing data.sources (rank 0): {cut_path} [{lost_key}] "
                           "truncated_shard: "), line
    assert "byte 65536" in line and hit.name in line, line
    # Training goes on with every whole record, none of them skipped when read.
    kept = sum(1 for m in members if m.offset_data + m.size <= 65536 and m.name.endswith(".txt")
               and split_member_name(m.name)[0] != lost_key)
    assert data.loader.sizes == [20 + kept]
    seen = Counter()
    for _ in range(-(-(20 + kept) // 4)):
        batches, _ = data.loader.next_step()
        for b in batches:
            assert not b.skips
            seen.update(key for _, key in b.origins)
    assert lost_key not in seen and len(seen) == 20 + kept
    data.loader.close()


def test_an_unreadable_header_mid_shard_costs_its_record_only(tmp_path):
    recs = records(6)
    path = write_shard(tmp_path / "s.tar", recs)
    members = member_table(path)
    raw = bytearray(Path(path).read_bytes())
    bad = members[5]  # 002.txt: the header of record 002's caption
    raw[bad.offset + 148:bad.offset + 156] = b"0000000\0"  # wrong checksum: tarfile cannot read this header
    Path(path).write_bytes(bytes(raw))
    skips = SkipCounter()
    index = build_index("tar", path, skips)
    assert dict(skips.counts) == {"corrupt_shard": 1}
    (ex,) = skips.examples
    assert ex.key == "002" and f"byte {bad.offset}" in ex.detail
    assert index.keys == ["000", "001", "003", "004", "005"]  # the records after it are read again
    assert [index.read(i).text for i in range(len(index))] == [cap for k, _, cap in recs if k != "002"]


def test_a_shard_cut_after_indexing_is_counted_when_read(tmp_path):
    recs = records(3)
    path = write_shard(tmp_path / "s.tar", recs)
    members = member_table(path)
    cfg = files_cfg(f"[{{path: '{path}'}}]", "train.global_batch_size=3")
    data = build_training_data(cfg, 0, 1)
    assert data.index_skips.total == 0
    caption = members[-1]  # cut inside the last caption: its record must not train on half a caption
    Path(path).write_bytes(Path(path).read_bytes()[:caption.offset_data + caption.size // 2])
    item = data.loader.dataset[(0, 2, 0)]
    assert item.sample is None and item.skip.reason == "truncated_shard" and item.skip.key == "002"
    assert item.skip.reason in RUNTIME_SKIP_REASONS


def test_truncated_gzip_shard_is_counted_by_the_streaming_reader(tmp_path):
    recs = records(4)
    plain = Path(write_shard(tmp_path / "s.tar", recs)).read_bytes()
    packed = gzip.compress(plain)
    gz = tmp_path / "s.tar.gz"
    gz.write_bytes(packed[:len(packed) * 2 // 3])
    skips = SkipCounter()
    got = [r.key for r in iter_tar_samples(str(gz), skips)]
    assert skips.total == 1 and skips.counts["truncated_shard"] == 1, skips.examples
    (ex,) = skips.examples
    assert ex.source == str(gz) and ex.key not in got
    assert got == [k for k, _, _ in recs][:len(got)] and len(got) < 4
    # The indexed (training) path refuses compressed shards at start-up, naming the source.
    with pytest.raises(ConfigError, match=r"data.sources\[0\].*compressed"):
        build_training_data(files_cfg(f"[{{path: '{gz}'}}]"), 0, 1)


# ---------------------------------------------------------------- (b) the eval hold-out
def bad_tail_shard(path: Path) -> str:
    """8 good records, then the 4 that a hold-out of 4 takes: no caption, corrupt image, caption
    that is not UTF-8, good; and a key without an image (counted while indexing)."""
    recs = records(9)
    members = [m for key, png, cap in recs[:8] for m in ((f"{key}.png", png), (f"{key}.txt", cap.encode()))]
    members += [("h0.png", recs[8][1]),
                ("h1.png", b"\x89PNG not an image"), ("h1.txt", b"a caption"),
                ("h2.png", recs[8][1]), ("h2.txt", b"\xff\xfe caption"),
                ("h3.png", recs[8][1]), ("h3.txt", recs[8][2].encode()),
                ("noimage.txt", b"caption without an image")]
    return write_tar(path, members)


def test_bad_records_in_the_eval_hold_out_are_counted_like_training_ones(tmp_path, capsys):
    path = bad_tail_shard(tmp_path / "s.tar")
    train_only = build_training_data(files_cfg(f"[{{path: '{path}'}}]", "train.global_batch_size=4"), 0, 1)
    as_training = {}
    for record in range(8, 11):
        item = train_only.loader.dataset[(0, record, 0)]
        as_training[item.skip.key] = item.skip.reason

    data = build_training_data(files_cfg(f"[{{path: '{path}'}}]", "train.global_batch_size=4",
                                         "data.eval_samples=4"), 0, 1)
    assert data.loader.sizes == [8] and len(data.eval_set) == 1
    held = {ex.key: ex.reason for ex in data.index_skips.examples if ex.key.startswith("h")}
    assert held == as_training == {"h0": "missing_caption", "h1": "corrupt_image", "h2": "undecodable_text"}
    assert all("eval hold-out" in ex.detail for ex in data.index_skips.examples if ex.key.startswith("h"))
    # They reach the ledger the training range reports to: the job-wide total and the summary by reason.
    ledger = SkipLedger(data.index_skips, lambda values: values, 0)
    assert ledger.total == 4
    assert ledger.by_reason() == {"corrupt_image": 1, "missing_caption": 1, "missing_image": 1,
                                  "undecodable_text": 1}
    ledger.report(data.index_skips, "while indexing data.sources")
    printed = capsys.readouterr().out
    assert f"{path} [h0] missing_caption: no caption (eval hold-out)" in printed


# ---------------------------------------------------------------- more damage of the same class
def test_empty_non_tar_manifest_and_text_damage_is_counted_and_named(tmp_path):
    good = write_shard(tmp_path / "good.tar", records(4))
    (tmp_path / "empty.tar").write_bytes(b"")
    (tmp_path / "notatar.tar").write_bytes(b"<html>404 Not Found</html>\n" * 50)
    (tmp_path / "img").mkdir()
    lines = []
    for i, (key, png, cap) in enumerate(records(3)):
        (tmp_path / "img" / f"{key}.png").write_bytes(png)
        lines.append(f'{{"image": "img/{key}.png", "text": "{cap}"}}')
    lines.insert(1, '{"image": "img/001.png", "text": "cut off')  # a broken line in the middle
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "t.txt").write_bytes("first document\n".encode() + "caf\xe9 latin-1\n".encode("latin-1")
                                      + "third document\n".encode())
    sources = (f"[{{path: ['{good}', '{tmp_path}/empty.tar', '{tmp_path}/notatar.tar']}}, "
               f"{{path: '{tmp_path}/m.jsonl', format: jsonl}}, {{path: '{tmp_path}/t.txt', format: text}}]")
    data = build_training_data(files_cfg(sources, "train.global_batch_size=3"), 0, 1)
    named = {(ex.source, ex.key, ex.reason) for ex in data.index_skips.examples}
    assert named == {(f"{tmp_path}/empty.tar", SHARD_KEY, "empty_shard"),
                     (f"{tmp_path}/notatar.tar", SHARD_KEY, "corrupt_shard"),
                     (f"{tmp_path}/m.jsonl", "line 2", "bad_manifest_line"),
                     (f"{tmp_path}/t.txt", "line 2", "undecodable_text")}
    assert data.loader.sizes == [4, 3, 2]
    for _ in range(3):  # the rest trains, nothing else skipped
        batches, _ = data.loader.next_step()
        assert not [s for b in batches for s in b.skips]
    data.loader.close()


def test_a_source_with_nothing_usable_names_the_damage(tmp_path):
    (tmp_path / "notatar.tar").write_bytes(b"\x00\x01garbage" * 200)
    with pytest.raises(ConfigError, match=rf"data.sources\[0\].*{tmp_path}/notatar.tar \[<shard>\] corrupt_shard"):
        build_training_data(files_cfg(f"[{{path: '{tmp_path}/notatar.tar'}}]"), 0, 1)
    (tmp_path / "utf16.txt").write_text("one document\nanother\n", encoding="utf-16")
    with pytest.raises(ConfigError, match=r"data.sources\[0\].*utf16.txt \[line 1\] undecodable_text"):
        build_training_data(files_cfg(f"[{{path: '{tmp_path}/utf16.txt', format: text}}]"), 0, 1)
