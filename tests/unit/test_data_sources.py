"""Real-data readers: shard expansion, tar/JSONL/text readers, skip accounting, image decoding, prepare CLI."""

from __future__ import annotations

import csv
import io
import json
import os
import shlex
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from m6.data import prepare
from m6.config import load
from m6.data.images import IMAGE_MEAN, IMAGE_STD, BadRecord, decode_image, to_rgb
from m6.data.sources import (
    SHARD_KEY,
    RawRecord,
    SkipCounter,
    decode_record,
    expand_braces,
    expand_shards,
    iter_jsonl_manifest,
    iter_tar_samples,
    iter_text_corpus,
    split_member_name,
)

S = 8


def image_bytes(fmt: str = "PNG", mode: str = "RGB", size: tuple[int, int] = (12, 10), colour=(200, 30, 60)) -> bytes:
    """Encode a solid image of ``mode`` in ``fmt``."""
    if mode == "L":
        colour = colour[0]
    elif mode == "RGBA":
        colour = (*colour, 255)
    buf = io.BytesIO()
    Image.new(mode, size, colour).save(buf, format=fmt)
    return buf.getvalue()


def gradient_png(width: int, height: int) -> bytes:
    """A PNG whose red channel encodes x and green encodes y, so crops are identifiable."""
    xx, yy = np.meshgrid(np.arange(width), np.arange(height))
    arr = np.stack([xx * 10, yy * 10, np.zeros_like(xx)], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def noise_bytes(fmt: str = "PNG", size: int = 32) -> bytes:
    """Encode random pixels, which do not compress, so that cutting the file really truncates the pixel data."""
    arr = np.random.default_rng(0).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format=fmt)
    return buf.getvalue()


def raw_rgb(image: np.ndarray) -> np.ndarray:
    """Undo the normalisation: [3, H, W] back to 0..255 pixel values."""
    mean = np.asarray(IMAGE_MEAN, dtype=np.float32)[:, None, None]
    std = np.asarray(IMAGE_STD, dtype=np.float32)[:, None, None]
    return (image * std + mean) * 255.0


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> str:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


# ---------------------------------------------------------------- images
@pytest.mark.parametrize(
    ("fmt", "mode"), [("PNG", "RGB"), ("JPEG", "RGB"), ("WEBP", "RGB"), ("PNG", "L"), ("PNG", "RGBA"), ("JPEG", "CMYK")]
)
def test_decode_image_formats_and_modes(fmt: str, mode: str) -> None:
    colour = (200, 30, 60) if mode != "CMYK" else (0, 0, 0, 0)  # CMYK zero ink = white
    out = decode_image(image_bytes(fmt, mode, colour=colour), S, train=False, rng=None)
    assert out.shape == (3, S, S) and out.dtype == np.float32
    pixel = raw_rgb(out)[:, S // 2, S // 2]
    expected = {"L": (200, 200, 200), "CMYK": (255, 255, 255)}.get(mode, (200, 30, 60))
    np.testing.assert_allclose(pixel, expected, atol=6 if fmt == "PNG" else 20)


def test_decode_image_alpha_and_palette() -> None:
    transparent = io.BytesIO()
    Image.new("RGBA", (9, 9), (10, 10, 10, 0)).save(transparent, format="PNG")
    np.testing.assert_allclose(raw_rgb(decode_image(transparent.getvalue(), S, False, None)), 255.0, atol=0.5)
    palette = io.BytesIO()
    Image.new("RGB", (9, 9), (0, 0, 255)).convert("P").save(palette, format="PNG")
    np.testing.assert_allclose(raw_rgb(decode_image(palette.getvalue(), S, False, None))[:, 0, 0], (0, 0, 255), atol=1)


def test_decode_image_center_and_random_crop() -> None:
    # 40x8 (wide) stays 40x8 after resizing the shorter side to 8: only the x offset varies.
    data = gradient_png(40, 8)
    center = raw_rgb(decode_image(data, S, train=False, rng=None))
    np.testing.assert_allclose(center[0, 0, :], np.arange(16, 24) * 10, atol=0.5)
    np.testing.assert_allclose(center[1, :, 0], np.arange(8) * 10, atol=0.5)

    lefts = set()
    for seed in range(6):
        a = decode_image(data, S, train=True, rng=np.random.default_rng(seed))
        b = decode_image(data, S, train=True, rng=np.random.default_rng(seed))
        np.testing.assert_array_equal(a, b)
        lefts.add(int(round(raw_rgb(a)[0, 0, 0] / 10)))
    assert len(lefts) > 1 and all(0 <= left <= 32 for left in lefts)
    with pytest.raises(ValueError, match="rng"):
        decode_image(data, S, train=True, rng=None)


def test_decode_image_resizes_shorter_side() -> None:
    out = decode_image(image_bytes("PNG", size=(64, 32)), 16, train=False, rng=None)
    assert out.shape == (3, 16, 16)


@pytest.mark.parametrize(
    ("data", "reason"),
    [(b"", "empty"), (b"not an image at all", "cannot decode"), (noise_bytes("JPEG")[:600], "cannot decode")],
)
def test_decode_image_bad_data(data: bytes, reason: str) -> None:
    with pytest.raises(BadRecord, match=reason):
        decode_image(data, S, train=False, rng=None)


def test_truncated_png_is_bad() -> None:
    data = noise_bytes("PNG")
    with pytest.raises(BadRecord, match="truncated"):
        decode_image(data[: len(data) // 2], S, False, None)


# ---------------------------------------------------------------- shard expansion
def test_expand_braces() -> None:
    assert expand_braces("s-{000..002}.tar") == ["s-000.tar", "s-001.tar", "s-002.tar"]
    assert expand_braces("{a,b}/x-{8..10}") == ["a/x-8", "a/x-9", "a/x-10", "b/x-8", "b/x-9", "b/x-10"]
    assert expand_braces("plain{x}") == ["plain{x}"]
    with pytest.raises(ValueError, match="descending"):
        expand_braces("s-{5..1}")
    with pytest.raises(ValueError, match="unbalanced"):
        expand_braces("s-{0..1")


def test_expand_shards(tmp_path: Path) -> None:
    for i in range(4):
        (tmp_path / f"shard-{i:06d}.tar").write_bytes(b"")
    (tmp_path / "other.tar").write_bytes(b"")

    def names(paths: list[str]) -> list[str]:
        return [os.path.basename(p) for p in paths]

    braces = expand_shards(str(tmp_path / "shard-{000001..000003}.tar"))
    assert names(braces) == ["shard-000001.tar", "shard-000002.tar", "shard-000003.tar"]
    globbed = expand_shards([str(tmp_path / "shard-*.tar"), str(tmp_path / "shard-000000.tar")])
    assert names(globbed) == [f"shard-{i:06d}.tar" for i in range(4)]  # sorted, de-duplicated
    with pytest.raises(FileNotFoundError, match=r"shard-\{000002\.\.000005\}.*2 missing.*shard-000004"):
        expand_shards(str(tmp_path / "shard-{000002..000005}.tar"))
    with pytest.raises(FileNotFoundError, match="nothing-"):
        expand_shards(str(tmp_path / "nothing-*.tar"))
    with pytest.raises(ValueError, match="empty"):
        expand_shards([])


# ---------------------------------------------------------------- tar reader
def test_split_member_name() -> None:
    assert split_member_name("dir/sub/abc.seg.PNG") == ("dir/sub/abc", "seg.png")
    assert split_member_name("abc.txt") == ("abc", "txt")


def test_tar_reader_groups_and_skips(tmp_path: Path) -> None:
    good = image_bytes("PNG")
    members = [
        ("a/0001.jpg", image_bytes("JPEG")), ("a/0001.txt", "一只猫坐在垫子上".encode()),
        ("a/0002.png", b"\x89PNG garbage"), ("a/0002.txt", b"corrupt image"),
        ("a/0003.png", noise_bytes("PNG")[:1000]), ("a/0003.txt", b"truncated image"),
        ("a/0004.png", good),  # no caption at all
        ("a/0005.png", good), ("a/0005.txt", b"\xff\xfe bad utf8"),
        ("a/0006.png", good), ("a/0006.json", json.dumps({"caption": "from json", "id": 6}).encode()),
        ("a/0007.txt", b"caption without image"),
        ("b/0001.png", good), ("b/0001.txt", b"  same stem, other dir \n"), ("b/0001.cls", b"3"),
    ]
    path = write_tar(tmp_path / "mixed.tar", members)
    skips = SkipCounter(max_examples=10)
    records = list(iter_tar_samples(path, skips))
    assert [r.key for r in records] == ["a/0001", "a/0002", "a/0003", "a/0004", "a/0006", "b/0001"]
    samples = {r.key: decode_record(r, S, False, None, skips) for r in records}
    assert {k for k, v in samples.items() if v is not None} == {"a/0001", "a/0006", "b/0001"}
    assert samples["a/0001"].target == "一只猫坐在垫子上"
    assert samples["a/0006"].target == "from json"
    assert samples["b/0001"].target == "same stem, other dir"
    assert samples["b/0001"].image.shape == (3, S, S) and samples["b/0001"].source == ""
    assert dict(skips.counts) == {
        "corrupt_image": 2, "missing_caption": 1, "undecodable_text": 1, "missing_image": 1
    }
    reported = {(ex.source, ex.key, ex.reason) for ex in skips.examples}
    assert reported == {
        (path, "a/0002", "corrupt_image"), (path, "a/0003", "corrupt_image"), (path, "a/0004", "missing_caption"),
        (path, "a/0005", "undecodable_text"), (path, "a/0007", "missing_image"),
    }


def test_empty_and_damaged_shards(tmp_path: Path) -> None:
    empty_tar = write_tar(tmp_path / "empty.tar", [])
    zero_bytes = tmp_path / "zero.tar"
    zero_bytes.write_bytes(b"")
    good = image_bytes("PNG")
    long_caption = b"caption " * 200  # 1600 bytes: four tar blocks
    members = [m for i in range(3) for m in ((f"{i}.png", good), (f"{i}.txt", long_caption))]
    full = write_tar(tmp_path / "full.tar", members)
    data = Path(full).read_bytes()
    cut = tmp_path / "cut.tar"
    # header(0.png) + data(0.png, < 1 block) + header(0.txt) + part of 0.txt's data
    assert len(good) < 512
    cut.write_bytes(data[: 512 * 3 + 700])
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"this is not a tar file" * 40)

    skips = SkipCounter()
    assert list(iter_tar_samples(empty_tar, skips)) == []
    assert list(iter_tar_samples(str(zero_bytes), skips)) == []
    assert list(iter_tar_samples(str(garbage), skips)) == []
    cut_records = list(iter_tar_samples(str(cut), skips))
    assert dict(skips.counts) == {"empty_shard": 2, "corrupt_shard": 1, "truncated_shard": 1}
    shard_examples = [ex for ex in skips.examples if ex.key == SHARD_KEY]
    assert {ex.source for ex in shard_examples} == {empty_tar, str(zero_bytes), str(garbage)}
    # The cut fell in record 0's caption: the record is lost, counted under its key.
    assert cut_records == []
    assert [(ex.source, ex.key, ex.reason) for ex in skips.examples if ex.key != SHARD_KEY] == [
        (str(cut), "0", "truncated_shard")]
    assert len(list(iter_tar_samples(full, SkipCounter()))) == 3


# ---------------------------------------------------------------- JSONL, text, counter
def test_jsonl_manifest(tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(image_bytes("PNG", mode="L"))
    lines = [
        json.dumps({"image": "img/a.png", "text": "灰色的方块"}, ensure_ascii=False),
        "",
        json.dumps({"image": "img/missing.png", "text": "gone"}),
        "{not json",
        json.dumps({"image": "img/a.png"}),
    ]
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    skips = SkipCounter()
    records = list(iter_jsonl_manifest(str(manifest), skips))
    assert [r.key for r in records] == ["line 1: img/a.png", "line 5: img/a.png"]
    sample = decode_record(records[0], S, True, np.random.default_rng(0), skips)
    assert sample is not None and sample.target == "灰色的方块" and sample.image.shape == (3, S, S)
    assert decode_record(records[1], S, False, None, skips) is None
    assert dict(skips.counts) == {"missing_file": 1, "bad_manifest_line": 1, "missing_caption": 1}
    assert skips.examples[0][:3] == (str(manifest), "line 3: img/missing.png", "missing_file")


def test_text_corpus(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes("first doc\n\n  \n第二篇文档\n".encode())
    (tmp_path / "b.txt").write_bytes(b"third\n\xff\xfe\n")
    skips = SkipCounter()
    records = list(iter_text_corpus(str(tmp_path / "*.txt"), skips))
    assert [r.text for r in records] == ["first doc", "第二篇文档", "third"]
    assert all(r.image_bytes is None for r in records)
    sample = decode_record(records[1], S, False, None, skips)
    assert sample is not None and sample.image is None and sample.target == "第二篇文档"
    assert dict(skips.counts) == {"undecodable_text": 1}
    assert skips.examples[0][:3] == (str(tmp_path / "b.txt"), "line 2", "undecodable_text")


def test_skip_counter_merge_and_summary() -> None:
    a, b = SkipCounter(max_examples=2), SkipCounter()
    a.record("s0", "k0", "corrupt_image", "bad")
    for i in range(3):
        b.record("s1", f"k{i}", "missing_caption")
    a.merge(b)
    summary = a.summary()
    assert summary["total"] == 4
    assert summary["by_reason"] == {"corrupt_image": 1, "missing_caption": 3}
    assert [(e["source"], e["key"]) for e in summary["examples"]] == [("s0", "k0"), ("s1", "k0")]
    empty = RawRecord("s", "k", image_bytes(), "   ")
    assert decode_record(empty, S, False, None, a) is None and a.counts["missing_caption"] == 4


# ---------------------------------------------------------------- prepare CLI round trip
def test_prepare_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    images = tmp_path / "images"
    images.mkdir()
    files = {
        "red.jpg": image_bytes("JPEG"), "grey.png": image_bytes("PNG", mode="L"),
        "alpha.png": image_bytes("PNG", mode="RGBA"), "pic.webp": image_bytes("WEBP"),
        "old.bmp": image_bytes("BMP"), "bad.jpg": b"\xff\xd8 not really", "cut.png": noise_bytes("PNG")[:1000],
    }
    for name, data in files.items():
        (images / name).write_bytes(data)
    rows = [
        ("red.jpg", "红色的图片"), ("grey.png", "a grey square"), ("alpha.png", "with, a \"comma\""),
        ("pic.webp", "webp"), ("old.bmp", "bitmap re-encoded"), ("bad.jpg", "corrupt"),
        ("cut.png", "truncated"), ("nowhere.png", "missing file"), ("red.jpg", "   "),
    ]
    captions = tmp_path / "captions.csv"
    with open(captions, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["file", "caption"])
        writer.writerows(rows)
    out = tmp_path / "shards"
    argv = ["--images", str(images), "--captions", str(captions), "--out", str(out), "--shard-size", "2"]
    assert prepare.main(argv) == 0
    printed = capsys.readouterr().out
    assert "written 5 records to 3 shard(s)" in printed
    for reason in ("corrupt_image: 2", "missing_file: 1", "empty_caption: 1"):
        assert reason in printed

    shards = expand_shards(str(out / "shard-{000000..000002}.tar"))
    skips = SkipCounter()
    samples = [decode_record(r, S, False, None, skips) for p in shards for r in iter_tar_samples(p, skips)]
    assert skips.total == 0
    expected = ["红色的图片", "a grey square", 'with, a "comma"', "webp", "bitmap re-encoded"]
    assert [s.target for s in samples] == expected
    assert all(s.image.shape == (3, S, S) and s.image.dtype == np.float32 for s in samples)
    with tarfile.open(shards[-1]) as tar:
        assert tar.getnames() == ["000000004.png", "000000004.txt"]
    # What to put in the config: the brace pattern of the shards written and the images' statistics,
    # as overrides that load (and name exactly the three shards).
    overrides = shlex.split(printed.splitlines()[-1])
    cfg = load(str(Path(__file__).parents[2] / "configs" / "tiny.yaml"), overrides)
    assert [s.format for s in cfg.data.sources] == ["tar"]
    assert expand_shards(cfg.data.sources[0].path) == shards
    pixels = np.concatenate([np.asarray(to_rgb(Image.open(images / name)), np.float64).reshape(-1, 3) / 255
                             for name in ("red.jpg", "grey.png", "alpha.png", "pic.webp", "old.bmp")])
    assert np.allclose(cfg.data.image_mean, pixels.mean(0), atol=1e-4)
    assert np.allclose(cfg.data.image_std, pixels.std(0), atol=1e-4)
    assert f'data.sources: [{{path: "{out}/shard-{{000000..000002}}.tar", format: tar}}]' in printed
    # A second run into the same folder would mix stale shards in: refused.
    assert prepare.main(argv) == 2


def test_prepare_jsonl_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    images = tmp_path / "images"
    images.mkdir()
    (images / "x.png").write_bytes(image_bytes())
    captions = tmp_path / "c.jsonl"
    captions.write_text(json.dumps({"image": "x.png", "text": "hello"}) + "\n", encoding="utf-8")
    assert prepare.main(["--images", str(images), "--captions", str(captions), "--out", str(tmp_path / "o")]) == 0
    assert sorted(os.listdir(tmp_path / "o")) == ["shard-000000.tar"]

    assert prepare.main(["--images", str(tmp_path / "nope"), "--captions", str(captions), "--out", "x"]) == 2
    assert "nope" in capsys.readouterr().err
    assert prepare.main(["--images", str(images), "--captions", str(tmp_path / "no.csv"), "--out", "x"]) == 2
    assert "no.csv" in capsys.readouterr().err
    bad_header = tmp_path / "bad.csv"
    bad_header.write_text("path,text\nx.png,hi\n", encoding="utf-8")
    assert prepare.main(["--images", str(images), "--captions", str(bad_header), "--out", str(tmp_path / "o2")]) == 2
    assert "file" in capsys.readouterr().err
