"""Pack a folder of images and a caption file into WebDataset-style tar shards.

    python -m m6.data.prepare --images DIR --captions FILE --out DIR [--shard-size 1000] [--prefix shard]

FILE is a .csv with columns ``file,caption`` or a .jsonl with ``{"image": ..., "text": ...}`` lines,
image names relative to DIR. Each record becomes ``<key>.<ext>`` + ``<key>.txt`` in
``<prefix>-000000.tar``, ``<prefix>-000001.tar``, ... Every image is decoded with Pillow before it is
written; rows that cannot be used are counted by reason and reported at the end, followed by what
to put in the config: the shards' brace pattern for ``data.sources`` and the images' per-channel
pixel mean and standard deviation for ``data.image_mean`` / ``data.image_std``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shlex
import sys
import tarfile
import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
from PIL import Image

from m6.data.images import BadRecord, open_image, to_rgb
from m6.data.sources import SkipCounter

# Pillow format -> extension the shard readers accept; other formats are re-encoded losslessly as PNG.
FORMAT_EXTENSIONS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}
KEY_DIGITS = 9
SHARD_DIGITS = 6
PROGRESS_INTERVAL_S = 0.2


class CaptionRow(NamedTuple):
    """One row of the captions file: its label for reports, image file name, caption, or a parse error."""

    label: str
    file_name: str
    caption: str
    error: str = ""


def read_captions(path: str) -> Iterator[CaptionRow]:
    """Yield rows of a .csv (columns file,caption) or .jsonl (image,text) file; ValueError on a bad header."""
    if path.endswith(".csv"):
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            missing = {"file", "caption"} - set(reader.fieldnames or ())
            if missing:
                raise ValueError(f"{path}: CSV header lacks column(s) {sorted(missing)}; expected file,caption")
            for row_no, row in enumerate(reader, start=2):
                yield CaptionRow(f"row {row_no}", row["file"] or "", row["caption"] or "")
    elif path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                label = f"line {line_no}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    yield CaptionRow(label, "", "", f"invalid JSON: {e}")
                    continue
                if not isinstance(obj, dict) or not isinstance(obj.get("image"), str):
                    yield CaptionRow(label, "", "", 'expected an object with a string "image"')
                    continue
                text = obj.get("text", obj.get("caption", ""))
                yield CaptionRow(label, obj["image"], text if isinstance(text, str) else "")
    else:
        raise ValueError(f"{path}: captions file must end in .csv or .jsonl")


class PixelStats:
    """Per-channel mean and standard deviation of RGB pixels on the 0-1 scale the loader normalises
    from (every image converted as the loader converts it: alpha over white, grey to RGB), summed
    in float64 over all pixels of all images."""

    def __init__(self) -> None:
        self.sum = np.zeros(3)
        self.sum_sq = np.zeros(3)
        self.count = 0

    def add(self, img: Image.Image) -> None:
        pixels = np.asarray(to_rgb(img), dtype=np.float64).reshape(-1, 3) / 255.0
        self.sum += pixels.sum(0)
        self.sum_sq += np.square(pixels).sum(0)
        self.count += len(pixels)

    def mean_std(self) -> tuple[list[float], list[float]]:
        mean = self.sum / self.count
        std = np.sqrt(np.maximum(self.sum_sq / self.count - np.square(mean), 0.0))
        return [round(float(v), 4) for v in mean], [round(float(v), 4) for v in std]


def config_lines(out_dir: str, prefix: str, num_shards: int, stats: PixelStats) -> list[str]:
    """What to put in the config for the shards written: data.sources' brace pattern (the form
    data.sources expands) and data.image_mean / data.image_std measured on the images."""
    last = f"{num_shards - 1:0{SHARD_DIGITS}d}"
    names = f"{prefix}-{{{0:0{SHARD_DIGITS}d}..{last}}}.tar" if num_shards > 1 else f"{prefix}-{last}.tar"
    pattern = os.path.join(out_dir, names)
    mean, std = stats.mean_std()
    sources = f'[{{path: "{pattern}", format: tar}}]'
    return ["in the config (YAML):",
            f"  data.sources: {sources}",
            f"  data.image_mean: {mean}",
            f"  data.image_std: {std}",
            "or as overrides:",
            f"  data.kind=files data.sources={shlex.quote(sources)} data.image_mean={shlex.quote(str(mean))} "
            f"data.image_std={shlex.quote(str(std))}"]


def encoded_image(data: bytes, stats: PixelStats | None = None) -> tuple[bytes, str]:
    """Verify ``data`` decodes with Pillow; return (bytes to store, extension), re-encoding odd
    formats as PNG; the decoded pixels are added to ``stats``."""
    img = open_image(data)
    if stats is not None:
        stats.add(img)
    ext = FORMAT_EXTENSIONS.get(img.format or "")
    if ext is not None:
        return data, ext
    buffer = io.BytesIO()
    try:
        img.save(buffer, format="PNG")
    except (OSError, ValueError) as e:
        raise BadRecord(f"cannot re-encode {img.format} image as PNG: {e}") from e
    return buffer.getvalue(), "png"


class ShardWriter:
    """Writes members into ``<prefix>-NNNNNN.tar`` files of at most ``shard_size`` records each."""

    def __init__(self, out_dir: str, prefix: str, shard_size: int) -> None:
        self.out_dir, self.prefix, self.shard_size = out_dir, prefix, shard_size
        self.num_shards = 0
        self.num_in_shard = 0
        self.tar: tarfile.TarFile | None = None
        self.tmp_path = self.final_path = ""

    def _add(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), 0o644, 0  # fixed mtime: same input, same bytes
        assert self.tar is not None
        self.tar.addfile(info, io.BytesIO(data))

    def write(self, key: str, image: bytes, ext: str, caption: str) -> None:
        """Add one record (image + caption) to the current shard, starting a new shard when full."""
        if self.tar is None:
            self.final_path = os.path.join(self.out_dir, f"{self.prefix}-{self.num_shards:0{SHARD_DIGITS}d}.tar")
            self.tmp_path = self.final_path + ".tmp"
            self.tar = tarfile.open(self.tmp_path, "w")
        self._add(f"{key}.{ext}", image)
        self._add(f"{key}.txt", caption.encode("utf-8"))
        self.num_in_shard += 1
        if self.num_in_shard == self.shard_size:
            self.close()

    def close(self) -> None:
        """Finish the current shard; it appears under its final name only once complete."""
        if self.tar is None:
            return
        self.tar.close()
        os.replace(self.tmp_path, self.final_path)
        self.tar, self.num_in_shard = None, 0
        self.num_shards += 1


def _progress(done: int, total: int, written: int, skipped: int, final: bool = False) -> None:
    """Rewrite one status line on stderr."""
    sys.stderr.write(f"\rrows {done}/{total}  written {written}  skipped {skipped}" + ("\n" if final else ""))
    sys.stderr.flush()


def build_parser() -> argparse.ArgumentParser:
    """Command-line options of ``python -m m6.data.prepare``."""
    parser = argparse.ArgumentParser(prog="python -m m6.data.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", required=True, help="folder the caption file's image names are relative to")
    parser.add_argument("--captions", required=True, help=".csv (file,caption) or .jsonl (image,text)")
    parser.add_argument("--out", required=True, help="output folder for the tar shards")
    parser.add_argument("--shard-size", type=int, default=1000, help="records per shard")
    parser.add_argument("--prefix", default="shard", help="shard file name prefix")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the packer; returns the process exit code (0 ok, 1 nothing written, 2 bad arguments/input)."""
    args = build_parser().parse_args(argv)
    if not os.path.isdir(args.images):
        print(f"error: --images folder not found: {args.images}", file=sys.stderr)
        return 2
    if not os.path.isfile(args.captions):
        print(f"error: --captions file not found: {args.captions}", file=sys.stderr)
        return 2
    if args.shard_size <= 0:
        print(f"error: --shard-size must be positive, got {args.shard_size}", file=sys.stderr)
        return 2
    if "/" in args.prefix or not args.prefix:
        print(f"error: --prefix must be a plain file name prefix, got {args.prefix!r}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    # Stale shards of an earlier run would silently mix into this dataset.
    existing = sorted(n for n in os.listdir(args.out) if n.startswith(f"{args.prefix}-") and n.endswith(".tar"))
    if existing:
        print(f"error: --out {args.out} already holds {len(existing)} '{args.prefix}-*.tar' shards "
              f"(e.g. {existing[0]}); use an empty folder or another --prefix", file=sys.stderr)
        return 2

    skips = SkipCounter()
    stats = PixelStats()
    writer = ShardWriter(args.out, args.prefix, args.shard_size)
    written = done = 0
    last_progress = 0.0
    try:
        # Read every row first, so that an unreadable captions file fails before any shard exists.
        rows = list(read_captions(args.captions))
    except ValueError as e:  # includes UnicodeDecodeError
        print(f"error: {args.captions}: {e}", file=sys.stderr)
        return 2
    for label, file_name, caption, error in rows:
        done += 1
        if error:
            skips.record(args.captions, label, "bad_manifest_line", error)
        elif not caption.strip():
            skips.record(args.captions, label, "empty_caption", file_name)
        else:
            try:
                with open(os.path.join(args.images, file_name), "rb") as f:
                    data = f.read()
                image, ext = encoded_image(data, stats)
            except OSError as e:
                skips.record(args.captions, label, "missing_file", f"{file_name}: {e}")
            except BadRecord as e:
                skips.record(args.captions, label, "corrupt_image", f"{file_name}: {e}")
            else:
                writer.write(f"{written:0{KEY_DIGITS}d}", image, ext, caption)
                written += 1
        if time.monotonic() - last_progress > PROGRESS_INTERVAL_S:
            _progress(done, len(rows), written, skips.total)
            last_progress = time.monotonic()
    writer.close()
    _progress(done, len(rows), written, skips.total, final=True)

    print(f"written {written} records to {writer.num_shards} shard(s) in {args.out}")
    print(f"skipped {skips.total}" + "".join(f"\n  {reason}: {n}" for reason, n in sorted(skips.counts.items())))
    for ex in skips.examples:
        print(f"  e.g. {ex.source} {ex.key}: {ex.reason} ({ex.detail})")
    if written == 0:
        print("error: no records written", file=sys.stderr)
        return 1
    print("\n".join(config_lines(args.out, args.prefix, writer.num_shards, stats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
