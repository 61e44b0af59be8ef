"""The index beside a token sidecar: each line's digest and size, so that a restore finds the lines it
needs without reading, or hashing, the others.

``token-lines-<hex>.index`` sits beside ``token-lines-<hex>.jsonl``; it is written with the sidecar,
made durable with it before the manifest is linked, and hard-linked with it into a later commit.
Its bytes: ``MAGIC``; the SHA-256 of each line of the sidecar, in file order (32 bytes each: the very
bytes whose SHA-256 names the sidecar); each line's size without its newline, in the same order (4
bytes each, little-endian); then the SHA-256 of all the bytes before it. Two blocks rather than one
record a line: each is made and checked by a few calls into C, whatever the number of lines.

A reader trusts nothing in it: the trailing digest must match, the digests block must hash to the
sidecar's name, and the sizes, a newline after each line, must add up to the sidecar's size. An
index that fails any of these is not used: the sidecar is then read and hashed whole, as one
without an index is. A line found through the index is checked against its digest when it is read
(the install reads and checks every line it installs); lines a restore does not need are not read.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["INDEX_SUFFIX", "MAGIC", "IndexedLine", "Line", "decode_index", "encode_index", "index_bytes",
           "index_chunks", "index_name", "max_index_bytes"]

INDEX_SUFFIX = ".index"
MAGIC = b"NGCKTLX2"
_DIGEST_BYTES = 32
_SIZE_BYTES = 4
_LINE_BYTES = _DIGEST_BYTES + _SIZE_BYTES
_MIN_LINE_BYTES = 64
"""Fewer bytes than the shortest line the model writes, with its newline (88: its four keys with empty
arrays): an index of more lines than a sidecar of its size can hold is not read, so an index never
takes more memory than 36/64 of its sidecar's bytes."""
assert array("I").itemsize == _SIZE_BYTES, "the index's sizes are 4-byte unsigned integers"
_PER_CHUNK = 4096
"""Lines per piece of an index being written: its memory does not grow with the sidecar."""


class Line(Protocol):
    """What the index keeps of a line: its hex SHA-256 and its size without the newline."""

    @property
    def digest(self) -> str: ...

    @property
    def size(self) -> int: ...


@dataclass(frozen=True, slots=True)
class IndexedLine:
    """One line of a sidecar, as its index tells it: the line's hex SHA-256, offset and size."""

    digest: str
    offset: int
    size: int


def index_name(sidecar_name: str) -> str:
    """The index's file name beside the sidecar ``sidecar_name`` (``token-lines-<hex>.jsonl``)."""
    return sidecar_name.removesuffix(".jsonl") + INDEX_SUFFIX


def encode_index(lines: Sequence[Line]) -> bytes:
    """The index of a sidecar whose lines are ``lines`` (each a hex ``digest`` and a ``size`` without
    the newline), in order, in one piece."""
    return b"".join(index_chunks(lines))


def index_chunks(lines: Sequence[Line]) -> Iterator[bytes]:
    """The bytes of ``encode_index`` a piece at a time (``_PER_CHUNK`` lines each)."""
    whole = hashlib.sha256(MAGIC)
    yield MAGIC
    for start in range(0, len(lines), _PER_CHUNK):
        digests = bytes.fromhex("".join([line.digest for line in lines[start : start + _PER_CHUNK]]))
        whole.update(digests)
        yield digests
    for start in range(0, len(lines), _PER_CHUNK):
        sizes = _little_endian(array("I", [line.size for line in lines[start : start + _PER_CHUNK]])).tobytes()
        whole.update(sizes)
        yield sizes
    yield whole.digest()


def index_bytes(lines: int) -> int:
    """The size of the index of a sidecar of ``lines`` lines."""
    return len(MAGIC) + _LINE_BYTES * lines + _DIGEST_BYTES


def max_index_bytes(sidecar_bytes: int) -> int:
    """The most bytes the index of a sidecar of ``sidecar_bytes`` can hold: a longer file is not read."""
    return index_bytes(sidecar_bytes // _MIN_LINE_BYTES)


def decode_index(
    data: bytes, lines_digest: str, sidecar_bytes: int, wanted: Container[str]
) -> list[IndexedLine] | None:
    """The lines of ``wanted`` digests (hex) that the index ``data`` places in the sidecar named by
    ``lines_digest`` (hex) and holding ``sidecar_bytes``, or ``None`` when the index is damaged or is
    not that sidecar's (checked whole, whatever is wanted)."""
    count, left = divmod(len(data) - len(MAGIC) - _DIGEST_BYTES, _LINE_BYTES)
    if (count < 0 or left or len(data) > max_index_bytes(sidecar_bytes) or not data.startswith(MAGIC)
            or hashlib.sha256(memoryview(data)[:-_DIGEST_BYTES]).digest() != data[-_DIGEST_BYTES:]):
        return None
    sizes_at = len(MAGIC) + _DIGEST_BYTES * count
    digests = memoryview(data)[len(MAGIC) : sizes_at]
    sizes = _little_endian(array("I", data[sizes_at:-_DIGEST_BYTES]))
    if hashlib.sha256(digests).hexdigest() != lines_digest or sum(sizes) + count != sidecar_bytes:
        return None
    hexes, lines, offset = digests.hex(), [], 0
    for number, size in enumerate(sizes):
        digest = hexes[64 * number : 64 * number + 64]
        if digest in wanted:
            lines.append(IndexedLine(digest, offset, size))
        offset += size + 1
    return lines


def _little_endian(sizes: array[int]) -> array[int]:
    """``sizes`` as the index stores them (little-endian), on any machine."""
    if sys.byteorder != "little":
        sizes.byteswap()
    return sizes
