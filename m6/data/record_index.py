"""Random-access indexes over training sources: where each record's bytes are, found once at start-up.

An index lets any rank or DataLoader worker read record ``i`` directly (a seek and a read), so the
loader can shard one seeded global order by rank and worker with no sample read twice or skipped,
and resume mid-epoch by position alone. Problems visible from the structure (a key with no image,
a damaged, cut or empty shard, a bad manifest line, a missing image file, a text line that is not
UTF-8) are counted here, once; problems in the contents (an undecodable image or caption) are
counted when the record is read.

Formats: uncompressed WebDataset tars (``key.jpg|png|webp`` + ``key.txt|json``), JSONL manifests
(``{"image": relpath, "text": caption}``), and text corpora (one document per non-empty line).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from m6.data.images import BadRecord
from m6.data.sources import (RawRecord, SkipCounter, caption_from, decode_text, expand_shards,
                             iter_manifest_entries, iter_member_groups)
from m6.data.tar_members import compression_of

NO_MEMBER = -1  # offset of an absent member (a tar key with no caption file)


@dataclass
class TarIndex:
    """Records of WebDataset tar shards: per record its shard, key, and (offset, size) of image and text."""

    shards: list[str]
    shard_of: np.ndarray  # [N] int32
    keys: list[str]
    image_at: np.ndarray  # [N, 2] int64 (offset, size) of the image member's data
    text_at: np.ndarray  # [N, 2] int64, NO_MEMBER when the key has no caption member
    text_ext: list[str]  # "txt" | "json" | "" per record

    def __len__(self) -> int:
        return len(self.keys)

    def where(self, i: int) -> tuple[str, str]:
        """(shard, key) of record ``i``, for reports."""
        return self.shards[int(self.shard_of[i])], self.keys[i]

    def read(self, i: int) -> RawRecord:
        """Record ``i``'s bytes, read with two seeks; BadRecord if the caption bytes cannot be decoded
        or the shard no longer holds them all (cut after indexing)."""
        path, key = self.shards[int(self.shard_of[i])], self.keys[i]
        with open(path, "rb") as f:
            image = read_span(f, path, self.image_at[i], f"the image of {key}")
            text = None
            if self.text_at[i, 0] != NO_MEMBER:
                ext = self.text_ext[i]
                text = caption_from(ext, read_span(f, path, self.text_at[i], f"{key}.{ext}"))
        return RawRecord(path, key, image, text)


@dataclass
class ManifestIndex:
    """Records of JSONL manifests: image path (resolved) and caption per line."""

    sources: list[str] = field(default_factory=list)  # the manifest each record came from
    keys: list[str] = field(default_factory=list)
    image_paths: list[str] = field(default_factory=list)
    texts: list[str | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.keys)

    def where(self, i: int) -> tuple[str, str]:
        return self.sources[i], self.keys[i]

    def read(self, i: int) -> RawRecord:
        try:
            with open(self.image_paths[i], "rb") as f:
                image = f.read()
        except OSError as e:  # deleted after start-up
            raise BadRecord(f"cannot read {self.image_paths[i]}: {e}") from e
        return RawRecord(self.sources[i], self.keys[i], image, self.texts[i])


@dataclass
class TextIndex:
    """Non-empty lines of text files: file, byte offset and length per document."""

    files: list[str]
    file_of: np.ndarray  # [N] int32
    span: np.ndarray  # [N, 2] int64 (offset, size)
    line_no: np.ndarray  # [N] int64, for reports

    def __len__(self) -> int:
        return len(self.file_of)

    def where(self, i: int) -> tuple[str, str]:
        return self.files[int(self.file_of[i])], f"line {int(self.line_no[i])}"

    def read(self, i: int) -> RawRecord:
        path = self.files[int(self.file_of[i])]
        key = f"line {int(self.line_no[i])}"
        with open(path, "rb") as f:
            raw = read_span(f, path, self.span[i], key)
        return RawRecord(path, key, None, decode_text(raw, "line").strip())


RecordIndex = TarIndex | ManifestIndex | TextIndex


def read_span(f, path: str, span: np.ndarray, what: str) -> bytes:
    """The ``(offset, size)`` bytes of an open file; BadRecord (truncated_shard) if the file ends first."""
    offset, size = int(span[0]), int(span[1])
    f.seek(offset)
    data = f.read(size)
    if len(data) < size:
        raise BadRecord(f"{path} ends at byte {offset + len(data)}, inside {what} (bytes {offset}..{offset + size}): "
                        "cut after indexing", "truncated_shard")
    return data


def index_tar_shards(paths: list[str], skips: SkipCounter) -> TarIndex:
    """Scan the headers (not the data) of uncompressed tars; ValueError for a compressed one. Each
    record a cut or an unreadable header costs is counted in ``skips`` (see iter_member_groups)."""
    shard_of, keys, image_at, text_at, text_ext = [], [], [], [], []

    for shard, path in enumerate(paths):
        kind = compression_of(path)
        if kind is not None:
            raise ValueError(f"{path}: {kind}-compressed tar shards cannot be read by offset; store shards "
                             "uncompressed (python -m m6.data.prepare writes plain .tar)")
        # Headers only: a member's value is where its data lies (checked to lie inside the file).
        for group in iter_member_groups(path, skips, lambda _, m: (m.offset_data, m.size)):
            ext = "txt" if "txt" in group.texts else ("json" if "json" in group.texts else "")
            shard_of.append(shard)
            keys.append(group.key)
            image_at.append(group.image)
            text_at.append(group.texts[ext] if ext else (NO_MEMBER, 0))
            text_ext.append(ext)
    return TarIndex(paths, np.asarray(shard_of, dtype=np.int32), keys,
                    np.asarray(image_at, dtype=np.int64).reshape(-1, 2),
                    np.asarray(text_at, dtype=np.int64).reshape(-1, 2), text_ext)


def index_manifests(paths: list[str], skips: SkipCounter) -> ManifestIndex:
    """Parse JSONL manifests; lines that are not records, or whose image file is missing, are counted."""
    index = ManifestIndex()
    for path in paths:
        for key, image_path, text in iter_manifest_entries(path, skips):
            if not os.path.isfile(image_path):
                skips.record(path, key, "missing_file", f"no such image file {image_path}")
                continue
            index.sources.append(path)
            index.keys.append(key)
            index.image_paths.append(image_path)
            index.texts.append(text)
    return index


def index_text_files(paths: list[str], skips: SkipCounter) -> TextIndex:
    """Byte spans of the non-blank lines of each file (blank lines separate nothing and are not
    records); lines that are not UTF-8 text are counted here, once, instead of at every draw."""
    file_of, spans, line_nos = [], [], []
    for file_id, path in enumerate(paths):
        offset = 0
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                if raw.strip():
                    try:
                        decode_text(raw, "line")
                    except BadRecord as e:
                        skips.record(path, f"line {line_no}", "undecodable_text", str(e))
                    else:
                        file_of.append(file_id)
                        spans.append((offset, len(raw)))
                        line_nos.append(line_no)
                offset += len(raw)
    return TextIndex(paths, np.asarray(file_of, dtype=np.int32), np.asarray(spans, dtype=np.int64).reshape(-1, 2),
                     np.asarray(line_nos, dtype=np.int64))


def build_index(kind: str, spec: str | list[str], skips: SkipCounter) -> RecordIndex:
    """Index of one source: ``kind`` is tar | jsonl | text, ``spec`` paths, globs or brace patterns."""
    paths = expand_shards(spec)
    if kind == "tar":
        return index_tar_shards(paths, skips)
    if kind == "jsonl":
        return index_manifests(paths, skips)
    if kind == "text":
        return index_text_files(paths, skips)
    raise ValueError(f"unknown source format {kind!r} (expected tar, jsonl or text)")
