"""The index beside a token sidecar: each line's digest and size, so that a restore finds the lines it
needs without reading, or hashing, the others.

``token-lines-<hex>.index`` sits beside ``token-lines-<hex>.jsonl``; it is written with the sidecar,
made durable with it before the manifest is linked, and hard-linked with it into a later commit.
Its bytes: ``MAGIC``, then for each line of the sidecar in file order its SHA-256 (32 bytes) and its
size without the newline (4 bytes, little-endian), then the SHA-256 of all the bytes before it.

A reader trusts nothing in it: the trailing digest must match, the line digests must hash to the
sidecar's name (which is the SHA-256 of its lines' digests in order), and the sizes, a newline after
each line, must add up to the sidecar's size. An index that fails any of these is not used: the
sidecar is then read and hashed whole, as one without an index is. A line found through the index is
checked against its digest when it is read (the install reads and checks every line it installs);
lines a restore does not need are not read at all.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

__all__ = ["INDEX_SUFFIX", "MAGIC", "IndexedLine", "Line", "decode_index", "encode_index", "index_bytes",
           "index_chunks", "index_name", "max_index_bytes"]

INDEX_SUFFIX = ".index"
MAGIC = b"NGCKTLX1"
_ENTRY = struct.Struct("<32sI")
_DIGEST_BYTES = 32
_MIN_LINE_BYTES = 2
"""The shortest line a sidecar can hold, with its newline: ``{}`` is already longer."""


class Line(Protocol):
    """What the index keeps of a line: its hex SHA-256 and its size without the newline."""

    @property
    def digest(self) -> str: ...

    @property
    def size(self) -> int: ...


@dataclass(frozen=True)
class IndexedLine:
    """One line of a sidecar, as its index tells it: the line's hex SHA-256, offset and size."""

    digest: str
    offset: int
    size: int


def index_name(sidecar_name: str) -> str:
    """The index's file name beside the sidecar ``sidecar_name`` (``token-lines-<hex>.jsonl``)."""
    return sidecar_name.removesuffix(".jsonl") + INDEX_SUFFIX


def encode_index(lines: Iterable[Line]) -> bytes:
    """The index of a sidecar whose lines are ``lines`` (each a hex ``digest`` and a ``size`` without
    the newline), in order, in one piece."""
    return b"".join(index_chunks(lines))


def index_chunks(lines: Iterable[Line], per_chunk: int = 4096) -> Iterator[bytes]:
    """The bytes of ``encode_index`` a piece at a time (``per_chunk`` lines each): whatever the
    number of lines, the index is never whole in memory while it is written."""
    digest = hashlib.sha256(MAGIC)
    yield MAGIC
    batch = bytearray()
    for number, line in enumerate(lines, 1):
        batch += _ENTRY.pack(bytes.fromhex(line.digest), line.size)
        if number % per_chunk == 0:
            digest.update(batch)
            yield bytes(batch)
            batch.clear()
    digest.update(batch)
    yield bytes(batch)
    yield digest.digest()


def index_bytes(lines: int) -> int:
    """The size of the index of a sidecar of ``lines`` lines."""
    return len(MAGIC) + _ENTRY.size * lines + _DIGEST_BYTES


def max_index_bytes(sidecar_bytes: int) -> int:
    """The most bytes the index of a sidecar of ``sidecar_bytes`` can hold: a longer file is not read."""
    return index_bytes(sidecar_bytes // _MIN_LINE_BYTES)


def decode_index(data: bytes, lines_digest: str, sidecar_bytes: int) -> list[IndexedLine] | None:
    """The lines the index ``data`` gives for the sidecar named by ``lines_digest`` (hex) and holding
    ``sidecar_bytes``, or ``None`` when the index is damaged or is not that sidecar's."""
    body, trailer = data[:-_DIGEST_BYTES], data[-_DIGEST_BYTES:]
    entries = len(body) - len(MAGIC)
    if (len(data) > max_index_bytes(sidecar_bytes) or not body.startswith(MAGIC) or entries % _ENTRY.size
            or hashlib.sha256(body).digest() != trailer):
        return None
    digests, lines, offset = hashlib.sha256(), [], 0
    for raw, size in _ENTRY.iter_unpack(memoryview(body)[len(MAGIC):]):
        digests.update(raw)
        lines.append(IndexedLine(raw.hex(), offset, size))
        offset += size + 1
    if digests.hexdigest() != lines_digest or offset != sidecar_bytes:
        return None
    return lines
