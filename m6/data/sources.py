"""Readers for real training data: WebDataset-style tar shards, JSONL manifests and text corpora.

Every reader yields RawRecords (undecoded bytes + text) and records each record it cannot use
in a SkipCounter, with a reason, so that nothing is dropped without being counted and the
first few bad records can be reported by shard and key. ``decode_fields`` is the one decoding
of a RawRecord (image and caption, or why not) that training, the eval hold-out and
``decode_record`` (the ``Sample`` that ``collate`` consumes) share.
"""

from __future__ import annotations

import glob
import json
import os
import re
import tarfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from m6.data.batch import Sample
from m6.data.images import IMAGE_MEAN, IMAGE_STD, BadRecord, decode_image
from m6.data.tar_members import TarDamage, iter_tar_members

IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "webp"})
TEXT_EXTENSIONS = frozenset({"txt", "json"})
JSON_CAPTION_FIELDS = ("caption", "text")
SHARD_KEY = "<shard>"  # the key reported when a whole shard is skipped
DEFAULT_MAX_EXAMPLES = 5

@dataclass(frozen=True)
class RawRecord:
    """One undecoded record: where it came from (file, key), encoded image bytes or None, caption or None."""

    source: str
    key: str
    image_bytes: bytes | None
    text: str | None


class SkipExample(NamedTuple):
    """One skipped record for reporting: file, key within it, reason category, and the error detail."""

    source: str
    key: str
    reason: str
    detail: str


class SkipCounter:
    """Counts skipped records by reason and keeps the first ``max_examples`` of them for reporting."""

    def __init__(self, max_examples: int = DEFAULT_MAX_EXAMPLES) -> None:
        self.max_examples = max_examples
        self.counts: Counter[str] = Counter()
        self.examples: list[SkipExample] = []

    def record(self, source: str, key: str, reason: str, detail: str = "") -> None:
        """Count one skipped record of ``source``/``key`` under ``reason``."""
        self.counts[reason] += 1
        if len(self.examples) < self.max_examples:
            self.examples.append(SkipExample(source, key, reason, detail))

    @property
    def total(self) -> int:
        """Number of skips over all reasons."""
        return sum(self.counts.values())

    def merge(self, other: SkipCounter) -> None:
        """Add ``other``'s counts and (up to the limit) its examples into this counter."""
        self.counts.update(other.counts)
        room = self.max_examples - len(self.examples)
        self.examples.extend(other.examples[: max(room, 0)])

    def summary(self) -> dict:
        """Plain dict for logs: total, counts by reason, and the kept examples."""
        return {
            "total": self.total,
            "by_reason": dict(sorted(self.counts.items())),
            "examples": [ex._asdict() for ex in self.examples],
        }

    def __repr__(self) -> str:
        return f"SkipCounter(total={self.total}, by_reason={dict(self.counts)})"


# ---------------------------------------------------------------- shard lists
_BRACE_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


def _find_brace(pattern: str) -> tuple[int, int] | None:
    """Index of the first top-level '{' and its matching '}', or None; ValueError if unbalanced."""
    depth, start = 0, -1
    for i, ch in enumerate(pattern):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}":
            if depth == 0:
                raise ValueError(f"unbalanced '}}' in shard pattern {pattern!r}")
            depth -= 1
            if depth == 0:
                return start, i
    if depth:
        raise ValueError(f"unbalanced '{{' in shard pattern {pattern!r}")
    return None


def _split_top_level(body: str) -> list[str]:
    """Split a brace body on commas that are not inside nested braces."""
    parts, depth, current = [], 0, []
    for ch in body:
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        depth += ch == "{"
        depth -= ch == "}"
        current.append(ch)
    parts.append("".join(current))
    return parts


def expand_braces(pattern: str) -> list[str]:
    """Expand ``{000..127}`` numeric ranges (zero padding kept) and ``{a,b}`` lists, in order."""
    span = _find_brace(pattern)
    if span is None:
        return [pattern]
    start, end = span
    head, body, tail = pattern[:start], pattern[start + 1 : end], pattern[end + 1 :]
    match = _BRACE_RANGE.match(body)
    if match:
        lo, hi = int(match.group(1)), int(match.group(2))
        if lo > hi:
            raise ValueError(f"descending range {{{body}}} in shard pattern {pattern!r}")
        # "{000..127}" pads to the width of the written bounds; "{0..127}" does not pad.
        padded = match.group(1).startswith("0") and len(match.group(1)) > 1
        width = max(len(match.group(1)), len(match.group(2))) if padded else 0
        options = [str(n).zfill(width) for n in range(lo, hi + 1)]
    elif "," in body:
        options = _split_top_level(body)
    else:
        # "{x}" has no expansion in bash either: keep it literally, but still expand the tail.
        return [head + "{" + body + "}" + rest for rest in expand_braces(tail)]
    return [expanded for option in options for expanded in expand_braces(head + option + tail)]


def relative_to_cwd_note(paths: Sequence[str]) -> str:
    """' (relative paths resolve against the working directory DIR)' when any of ``paths`` is
    relative, else ''. Data paths in a config are relative to where the job starts, not to the
    config file, as with torchrun and Slurm scripts; every message about them says which folder."""
    if all(os.path.isabs(p) for p in paths):
        return ""
    return f" (relative paths resolve against the working directory {os.getcwd()})"


def expand_shards(spec: str | list[str]) -> list[str]:
    """Expand paths, globs and brace patterns into a sorted, de-duplicated list of existing files."""
    patterns = [spec] if isinstance(spec, str) else list(spec)
    if not patterns or not all(p.strip() for p in patterns):
        raise ValueError(f"empty shard spec {spec!r}")
    paths: set[str] = set()
    for pattern in patterns:
        matched: set[str] = set()
        missing = []
        for candidate in expand_braces(pattern):
            if glob.has_magic(candidate):
                matched.update(p for p in glob.glob(candidate) if os.path.isfile(p))
            elif os.path.isfile(candidate):
                matched.add(candidate)
            else:
                missing.append(candidate)
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            raise FileNotFoundError(f"shard pattern {pattern!r}: {len(missing)} missing file(s): {shown}")
        if not matched:
            raise FileNotFoundError(f"shard pattern {pattern!r} matched no files")
        paths |= matched
    return sorted(paths)


# ---------------------------------------------------------------- tar shards
def split_member_name(name: str) -> tuple[str, str]:
    """WebDataset key and extension: 'dir/a.b.jpg' -> ('dir/a', 'b.jpg'); the key keeps its directory."""
    directory, base = os.path.split(name)
    stem, _, ext = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), ext.lower()


def decode_text(data: bytes, what: str) -> str:
    """``data`` as text; BadRecord (undecodable_text) unless it is UTF-8 without NUL characters
    (those mean UTF-16 or binary data, which decodes as UTF-8 often enough to pass unnoticed)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord(f"{what} is not valid UTF-8: {e}", "undecodable_text") from e
    if "\0" in text:
        raise BadRecord(f"{what} holds NUL characters: not UTF-8 text (UTF-16 or binary data?)", "undecodable_text")
    return text


def caption_from(ext: str, data: bytes) -> str | None:
    """Caption text of a .txt or .json member; None if the JSON has no caption; BadRecord if undecodable."""
    text = decode_text(data, f".{ext}")
    if ext == "txt":
        return text
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRecord(f".json is not valid JSON: {e}", "undecodable_text") from e
    if isinstance(obj, dict):
        for field in JSON_CAPTION_FIELDS:
            if isinstance(obj.get(field), str):
                return obj[field]
    return None


class MemberGroup:
    """The members of one WebDataset key gathered while reading a tar: its image and its .txt /
    .json, each as the reader's value (the bytes when streaming, (offset, size) when indexing), and
    the damage just before its first member that no record has been charged with yet."""

    def __init__(self, key: str, damage: TarDamage | None = None) -> None:
        self.key = key
        self.image = None
        self.texts: dict[str, object] = {}
        self.damage = damage

    def whole(self) -> bool:
        """It has an image and a caption member (damage next to a record that lacks one took it)."""
        return self.image is not None and bool(self.texts)


def iter_member_groups(path: str, skips: SkipCounter,
                       value: Callable[[tarfile.TarFile, tarfile.TarInfo], object]) -> Iterator[MemberGroup]:
    """Consecutive file members of the tar ``path`` grouped by key, each member stored as
    ``value(tar, member)``: the first image, the first .txt and .json (other extensions are extra
    fields m6 does not use). Counted in ``skips``: a member with an empty key or a second image, a
    key without an image (not yielded), a tar without file members, and every record that damage
    (a cut, an unreadable header: see tar_members) costs, under the key it hit. The records read
    before and after the damage are kept."""
    if os.path.getsize(path) == 0:
        skips.record(path, SHARD_KEY, "empty_shard", "file is empty")
        return

    def finish(group: MemberGroup | None) -> MemberGroup | None:
        """The group to yield, or None once it is counted as skipped."""
        if group is None:
            return None
        if group.damage is not None:
            if not group.whole():  # the damage took its first members
                skips.record(path, group.key, group.damage.reason, group.damage.detail)
                return None
            skips.record(path, SHARD_KEY, group.damage.reason, group.damage.detail)
        if group.image is None:
            skips.record(path, group.key, "missing_image", "no .jpg/.jpeg/.png/.webp member")
            return None
        return group

    group: MemberGroup | None = None
    pending: TarDamage | None = None  # damage that hit no known record yet: the next group may be its victim
    lost = None  # key of a record already counted as lost to damage: its readable members are dropped
    seen = False
    for event in iter_tar_members(path, value):
        if isinstance(event, TarDamage):
            seen = True
            hit = split_member_name(event.name)[0] if event.name else None
            if group is not None and hit is not None and group.key.endswith("/" + hit):
                hit = group.key  # a cut ustar header: its directory (the prefix field) was lost
            if group is not None and (hit == group.key or (hit is None and not group.whole())):
                if group.damage is not None:  # earlier damage, next to this record: counted on its own
                    skips.record(path, SHARD_KEY, group.damage.reason, group.damage.detail)
                skips.record(path, group.key, event.reason, event.detail)
                group, lost = None, group.key
                continue
            done = finish(group)
            group = None
            if done is not None:
                yield done
            if pending is not None:
                skips.record(path, SHARD_KEY, pending.reason, pending.detail)
                pending = None
            if hit is not None:
                skips.record(path, hit, event.reason, event.detail)
                lost = hit
            else:
                pending = event
            continue
        member, data = event
        if not member.isfile():
            continue
        key, ext = split_member_name(member.name)
        if not key.rsplit("/", 1)[-1]:
            skips.record(path, member.name, "bad_member_name", "member name has an empty key")
            continue
        if key == lost:
            continue
        lost = None
        if group is None or group.key != key:
            done = finish(group)
            if done is not None:
                yield done
            group, pending, seen = MemberGroup(key, pending), None, True
        if ext in IMAGE_EXTENSIONS:
            if group.image is not None:
                skips.record(path, key, "duplicate_member", f"second image member {member.name}")
                continue
            group.image = data
        elif ext in TEXT_EXTENSIONS:
            group.texts.setdefault(ext, data)
    done = finish(group)
    if done is not None:
        yield done
    if pending is not None:
        skips.record(path, SHARD_KEY, pending.reason, pending.detail)
    if not seen:
        skips.record(path, SHARD_KEY, "empty_shard", "tar has no file members")


def _member_bytes(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    fileobj = tar.extractfile(member)
    return fileobj.read() if fileobj is not None else b""


def _finish_group(path: str, group: MemberGroup, skips: SkipCounter) -> RawRecord | None:
    """Turn a collected group into a RawRecord, or count why it cannot be one."""
    text = None
    for ext in ("txt", "json"):  # .txt wins when both are present
        if ext in group.texts:
            try:
                text = caption_from(ext, group.texts[ext])
            except BadRecord as e:
                skips.record(path, group.key, "undecodable_text", str(e))
                return None
            break
    return RawRecord(path, group.key, group.image, text)


def iter_tar_samples(path: str, skips: SkipCounter) -> Iterator[RawRecord]:
    """Read a WebDataset tar front to back (compressed ones too), one RawRecord per key; damage is
    counted, not raised."""
    for group in iter_member_groups(path, skips, _member_bytes):
        record = _finish_group(path, group, skips)
        if record is not None:
            yield record


# ---------------------------------------------------------------- manifests and text
def parse_manifest_line(path: str, base_dir: str, line_no: int, raw: bytes,
                        skips: SkipCounter) -> tuple[str, str, str | None] | None:
    """(key, image path, caption or None) of one manifest line; None (counted) if it is not a record."""
    line_key = f"line {line_no}"
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        skips.record(path, line_key, "bad_manifest_line", f"{type(e).__name__}: {e}")
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("image"), str):
        skips.record(path, line_key, "bad_manifest_line", 'expected an object with a string "image"')
        return None
    text = next((obj[k] for k in ("text", "caption") if isinstance(obj.get(k), str)), None)
    return f"{line_key}: {obj['image']}", os.path.join(base_dir, obj["image"]), text


def iter_manifest_entries(path: str, skips: SkipCounter) -> Iterator[tuple[str, str, str | None]]:
    """(key, image path, caption or None) of every record line of a JSONL manifest; blank lines
    are skipped, lines that are not records counted."""
    base_dir = os.path.dirname(os.path.abspath(path))
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if raw.strip():
                parsed = parse_manifest_line(path, base_dir, line_no, raw, skips)
                if parsed is not None:
                    yield parsed


def iter_jsonl_manifest(path: str, skips: SkipCounter) -> Iterator[RawRecord]:
    """Yield records of a JSONL manifest of ``{"image": relpath, "text": caption}`` lines (paths relative to it)."""
    for key, image_path, text in iter_manifest_entries(path, skips):
        try:
            with open(image_path, "rb") as image_file:
                image_bytes = image_file.read()
        except OSError as e:
            skips.record(path, key, "missing_file", f"{type(e).__name__}: {e}")
            continue
        yield RawRecord(path, key, image_bytes, text)


def iter_text_corpus(spec: str | list[str], skips: SkipCounter) -> Iterator[RawRecord]:
    """Yield one text-only record per non-empty line of the .txt files that ``spec`` expands to."""
    for path in expand_shards(spec):
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                try:
                    text = decode_text(raw, "line").strip()
                except BadRecord as e:
                    skips.record(path, f"line {line_no}", "undecodable_text", str(e))
                    continue
                if text:
                    yield RawRecord(path, f"line {line_no}", None, text)


# ---------------------------------------------------------------- decoding
def decode_fields(
    rec: RawRecord,
    image_size: int,
    train: bool,
    rng: np.random.Generator | None,
    image_mean: Sequence[float] = IMAGE_MEAN,
    image_std: Sequence[float] = IMAGE_STD,
) -> tuple[np.ndarray | None, str] | SkipExample:
    """The one decoding of a record (training, the eval hold-out, the streaming reader): its image
    [3, S, S] (None for text) and caption, or the SkipExample saying why it cannot be used."""
    caption = rec.text.strip() if rec.text is not None else ""
    if not caption:
        return SkipExample(rec.source, rec.key, "missing_caption", "no caption" if rec.text is None else "empty caption")
    image = None
    if rec.image_bytes is not None:
        try:
            image = decode_image(rec.image_bytes, image_size, train, rng, image_mean, image_std)
        except BadRecord as e:
            return SkipExample(rec.source, rec.key, "corrupt_image", str(e))
    return image, caption


def decode_record(
    rec: RawRecord,
    image_size: int,
    train: bool,
    rng: np.random.Generator | None,
    skips: SkipCounter,
) -> Sample | None:
    """Decode ``rec`` into Sample(image [3, S, S] or None, source="", target=caption); None (counted) if unusable."""
    decoded = decode_fields(rec, image_size, train, rng)
    if isinstance(decoded, SkipExample):
        skips.record(*decoded)
        return None
    image, caption = decoded
    return Sample(image=image, source="", target=caption)
