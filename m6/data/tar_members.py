"""The members of a tar shard, and every stretch of it that holds no readable member.

``tarfile`` takes a header it cannot read for the end of the archive: a shard cut right before or
inside a header, or with one damaged header, looks whole and simply ends there, and a member whose
data was cut off is listed at its full size. Reading a shard through ``iter_tar_members`` instead
yields each member and, in order, a TarDamage for each such stretch (a cut or an unreadable
header), so that the caller can count the records it costs; reading goes on after an unreadable
header. Compressed shards are streamed (their decompressors say when the stream was cut).
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import tarfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

BLOCK = tarfile.BLOCKSIZE
# Errors a damaged tar (or its gzip/bz2/xz wrapper) raises while being read.
TAR_ERRORS = (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError)
COMPRESSION_MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"))
_OPENERS = {"gzip": gzip.open, "bzip2": bz2.open, "xz": lzma.open}
_HEADER_DIGITS = frozenset(b"01234567 \0")  # what a header's mode/uid/gid/size/mtime/checksum fields hold

MemberValue = Callable[[tarfile.TarFile, tarfile.TarInfo], object]


@dataclass(frozen=True)
class TarDamage:
    """Bytes of a shard that hold no readable member: ``name`` is the member they hit when its name
    could still be read; ``truncated`` when the shard was cut there (else a header is unreadable)."""

    name: str | None
    detail: str
    truncated: bool

    @property
    def reason(self) -> str:
        """The skip reason of the records this damage costs."""
        return "truncated_shard" if self.truncated else "corrupt_shard"


def compression_of(path: str) -> str | None:
    """"gzip", "bzip2" or "xz" when ``path`` starts with that format's magic bytes, else None."""
    with open(path, "rb") as f:
        magic = f.read(6)
    return next((kind for prefix, kind in COMPRESSION_MAGIC if magic.startswith(prefix)), None)


def iter_tar_members(path: str, value: MemberValue) -> Iterator[tuple[tarfile.TarInfo, object] | TarDamage]:
    """``(member, value(tar, member))`` for every member of the tar ``path`` (value None for
    members that are not files), with a TarDamage in its place in the order wherever bytes hold
    no readable member. ``value`` runs before the next header is read (streams cannot go back)."""
    kind = compression_of(path)
    if kind is None:
        yield from _file_members(path, value)
    else:
        yield from _stream_members(path, kind, value)


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _file_members(path: str, value: MemberValue) -> Iterator[tuple[tarfile.TarInfo, object] | TarDamage]:
    """Random access: each member's data is checked to lie inside the file, and the bytes between
    members and after the last one are checked to be zeros (the end-of-archive marker)."""
    size = os.path.getsize(path)
    expected = 0  # where the next header starts when nothing is damaged
    last = None  # name of the last member read
    with open(path, "rb") as f:
        try:
            # ignore_zeros: go on past a block that is not a header instead of ending there; the
            # stretches it steps over are checked below.
            tar: tarfile.TarFile | None = tarfile.TarFile(fileobj=f, mode="r", ignore_zeros=True)
        except TAR_ERRORS:
            tar = None
        while tar is not None:
            try:
                member = tar.next()
            except TAR_ERRORS:  # an unreadable extended (pax / GNU long name) header
                if tar.offset + BLOCK >= size:
                    break
                tar.offset += BLOCK
                f.seek(tar.offset)
                continue
            if member is None:
                break
            if member.offset > expected:
                damage = _unreadable_stretch(f, expected, member.offset)
                if damage is not None:
                    yield damage
            end = member.offset_data + member.size
            if end > size:
                yield TarDamage(member.name, f"the shard ends at byte {size}, inside the data of {member.name} "
                                f"(bytes {member.offset_data}..{end})", truncated=True)
                return
            yield member, (value(tar, member) if member.isfile() else None)
            last = member.name
            expected = member.offset_data + _padded(member.size)
        damage = _tail_damage(f, expected, size, last)
        if damage is not None:
            yield damage


def _first_nonzero_block(f, start: int, stop: int) -> int | None:
    """Offset of the first block (counted from ``start``) in [start, stop) holding a non-zero byte."""
    f.seek(start)
    pos = start
    while pos < stop:
        chunk = f.read(min(1 << 20, stop - pos))
        if not chunk:
            return None
        stripped = chunk.lstrip(b"\0")
        if stripped:
            first = pos + len(chunk) - len(stripped)
            return start + (first - start) // BLOCK * BLOCK
        pos += len(chunk)
    return None


def _raw_name(block: bytes) -> str | None:
    """The name field of a (possibly cut or damaged) header block, with its ustar prefix when the
    block reaches it (a cut one may lack its directory); None when it cannot be read or the block
    does not look like a header (its numeric fields, as far as they are there, octal)."""
    field = block[:100]
    end = field.find(b"\0")
    if end < 0 and len(field) < 100:
        return None  # the name itself was cut
    raw = field if end < 0 else field[:end]
    if not set(block[100:156]) <= _HEADER_DIGITS:
        return None
    if len(block) >= 500 and block[257:262] == b"ustar" and block[345] != 0:
        raw = block[345:500].split(b"\0", 1)[0] + b"/" + raw
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return name if name and name.isprintable() else None


def _header_name(block: bytes) -> str | None:
    """The member a (possibly cut or damaged) header block names; None for none or an extended
    (pax / GNU long name) header, whose member's name lies beyond it."""
    name = _raw_name(block)
    return None if name is None or name.startswith("././@") else name


def _unreadable_stretch(f, start: int, stop: int) -> TarDamage | None:
    """The damage between two readable members (None when those bytes are only zeros)."""
    first = _first_nonzero_block(f, start, stop)
    if first is None:
        return None
    f.seek(first)
    name = _header_name(f.read(BLOCK))
    what = f" ({name})" if name else ""
    return TarDamage(name, f"unreadable member header at byte {first}{what}: {stop - first} bytes skipped, "
                           f"reading resumes at byte {stop}", truncated=False)


def _tail_damage(f, expected: int, size: int, last: str | None) -> TarDamage | None:
    """What follows the last readable member (``last``): zeros (the end-of-archive marker, whole or
    cut: no record lost) or damage: nothing (the shard was cut after a member), a cut header, or
    an unreadable one (or a file that is no tar at all)."""
    any_member = last is not None
    if expected >= size:
        if not any_member:
            return None
        return TarDamage(None, f"the shard ends at byte {size}, right after {last}, with no end-of-archive marker: "
                               "it was cut there, and the members after that point are lost", truncated=True)
    first = _first_nonzero_block(f, expected, size)
    if first is None:
        return None
    f.seek(first)
    block = f.read(BLOCK)
    name = _header_name(block)
    what = f" ({name})" if name else ""
    if not any_member and _raw_name(block) is None:
        return TarDamage(None, f"not a tar archive: no readable member header in its {size} bytes", truncated=False)
    if len(block) < BLOCK:
        return TarDamage(name, f"the shard ends at byte {size}, inside the member header at byte {first}{what}",
                         truncated=True)
    if _is_header(block) or (size % BLOCK and name is not None):
        # A header with a valid checksum that yields no member is an extended (pax / GNU long
        # name) header whose data or member was cut off; and a tar is whole blocks.
        return TarDamage(name, f"the shard ends at byte {size}, inside the member headers that start at byte "
                               f"{first}{what}", truncated=True)
    return TarDamage(name, f"unreadable member header at byte {first}{what}: the {size - first} bytes from there "
                           "to the end of the shard hold no readable member", truncated=False)


def _is_header(block: bytes) -> bool:
    """``block`` is a tar header with a valid checksum."""
    try:
        tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return False
    return True


def _stream_members(path: str, kind: str, value: MemberValue) -> Iterator[tuple[tarfile.TarInfo, object] | TarDamage]:
    """Compressed shards, read front to back; reading stops at the first error (a cut stream: the
    decompressor finds no end-of-stream marker)."""
    member = None
    try:
        with _OPENERS[kind](path, "rb") as raw, tarfile.open(fileobj=_ProducedSoFar(raw), mode="r|") as tar:
            for member in tar:
                yield member, (value(tar, member) if member.isfile() else None)
                member = None
    except TAR_ERRORS as e:
        cut = isinstance(e, EOFError) or "unexpected end of data" in str(e)
        where = f" while reading {member.name}" if member is not None else ""
        yield TarDamage(member.name if member is not None else None,
                        f"{kind}-compressed shard{where}: {type(e).__name__}: {e}", truncated=cut)


class _ProducedSoFar:
    """A decompressing reader whose reads return what the decompressor has produced (``read1``),
    so a cut file gives up every member before the cut first, then raises the decompressor's
    error (a plain ``read`` raises it at once and drops the bytes it had)."""

    def __init__(self, stream) -> None:
        self.read = stream.read1
