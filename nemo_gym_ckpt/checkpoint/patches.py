"""Patches: a record that changed a little since the base, written as the base line's bytes it keeps
and the bytes it inserts (docs/protocol.md section 6.1, "Patches").

An agent session's record holds the whole conversation, and one more turn changes a few hundred of
its thousands of bytes; an environment's boundary grows the same way. Written again whole, such
records were most of an incremental checkpoint at 1,024 rollouts in flight. A patch line is::

    {"episode_id": {...}, "patch_of": "<sha256 of the record's bytes>", "records_file": "records-<sha256>.jsonl",
     "offset": <byte offset of the base line>, "length": <its bytes, newline included>,
     "keep_head": <bytes kept from its start>, "keep_tail": <bytes kept from its end, before the newline>,
     "insert": "<the bytes between them, as a string>"}

and stands for ``base[:keep_head] + insert + base[len(base) - keep_tail:]`` (``base`` without its
newline), whose SHA-256 is ``patch_of``. The base line is an inline line of another records file of
the same directory (linked in like a span's file): one hop, never a patch of a patch. Head and tail
are cut on UTF-8 character boundaries, so the insert is text.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import orjson

from nemo_gym_ckpt.checkpoint.records import PATCH_KEY, Record, is_reference
from nemo_gym_ckpt.errors import InvalidCheckpointState

__all__ = ["PATCH_KEYS", "PATCH_WORTH", "Patch", "PatchLine", "apply_patch", "patch_between", "patch_line",
           "read_patch_line"]

PATCH_KEYS = ("episode_id", PATCH_KEY, "records_file", "offset", "length", "keep_head", "keep_tail", "insert")
_PATCH_KEY_SET = frozenset(PATCH_KEYS)
PATCH_WORTH = 0.5
"""A changed record is written as a patch only when the patch line is at most this share of its bytes."""
_LINE_OVERHEAD = 330
"""About the bytes of a patch line besides its insert (keys, digest, file name, numbers, episode)."""


@dataclass(frozen=True, slots=True)
class Patch:
    """A record as bytes kept from its base line ``base`` (at ``offset`` of ``records_file``, ``length``
    bytes with the newline) around an insert; ``line``, once made, is the patch line (a record that
    stays as it was is that line again at the next commit)."""

    base: bytes
    records_file: str
    offset: int
    length: int
    keep_head: int
    keep_tail: int
    line: bytes | None = field(default=None, compare=False)


def _common_head(new: bytes, old: bytes) -> int:
    low, high = 0, min(len(new), len(old))
    while low < high:  # the longest equal prefix, found with slice comparisons (no byte loop in Python;
        # bytes slices: a copy and one memcmp each, where a memoryview's == compares item by item, 5-16x slower)
        middle = (low + high + 1) // 2
        if new[:middle] == old[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _common_tail(new: bytes, old: bytes, head: int) -> int:
    low, high = 0, min(len(new), len(old)) - head
    while low < high:
        middle = (low + high + 1) // 2
        if new[len(new) - middle:] == old[len(old) - middle:]:
            low = middle
        else:
            high = middle - 1
    return low


def _continues_a_character(data: bytes, at: int) -> bool:
    return at < len(data) and data[at] & 0xC0 == 0x80


def patch_between(new: bytes, old: bytes, records_file: str, offset: int) -> Patch | None:
    """The patch that writes ``new`` from the base line ``old`` (at ``offset`` of ``records_file``), or
    ``None`` when it would not be worth it (``PATCH_WORTH``)."""
    if PATCH_WORTH * len(new) < _LINE_OVERHEAD:  # too short for any patch to be worth it: no search
        return None
    head = _common_head(new, old)
    tail = _common_tail(new, old, head)
    while head and _continues_a_character(new, head):
        head -= 1
    while tail and _continues_a_character(new, len(new) - tail):
        tail -= 1
    if _LINE_OVERHEAD + len(new) - head - tail > PATCH_WORTH * len(new):
        return None
    return Patch(old, records_file, offset, len(old) + 1, head, tail)


def patch_line(record: Record, patch: Patch) -> bytes:
    """The line that stands for ``record`` (its bytes hashed here, unless the patch has its line)."""
    if patch.line is not None:
        return patch.line
    insert = record.raw[patch.keep_head:len(record.raw) - patch.keep_tail].decode()
    return orjson.dumps({"episode_id": record.episode.to_json(), PATCH_KEY: hashlib.sha256(record.raw).hexdigest(),
                         "records_file": patch.records_file, "offset": patch.offset, "length": patch.length,
                         "keep_head": patch.keep_head, "keep_tail": patch.keep_tail, "insert": insert})


@dataclass(frozen=True, slots=True)
class PatchLine:
    """A patch line read back, its fields checked (not yet its base)."""

    record: Record
    digest: str
    records_file: str
    offset: int
    length: int
    keep_head: int
    keep_tail: int
    insert: bytes


def read_patch_line(record: Record, checked: dict[str, Any], max_record_bytes: int) -> PatchLine:
    """``record`` (a patch line) as a ``PatchLine``; ``checked`` holds its digest, records file and
    numbers already checked by the caller (as a span's are). Anything else malformed: 422."""
    where = f"record of {record.episode.capture_key}"
    if record.data.keys() != _PATCH_KEY_SET:
        raise InvalidCheckpointState(f"{where}: a patch is {{{', '.join(PATCH_KEYS)}}}")
    insert = record.data["insert"]
    if not isinstance(insert, str):
        raise InvalidCheckpointState(f"{where}: a patch's insert is a string")
    raw_insert = insert.encode()
    if b"\n" in raw_insert:  # a record is one line: what a patch makes could not be written again
        raise InvalidCheckpointState(f"{where}: a patch's insert holds no newline")
    head, tail, length = checked["keep_head"], checked["keep_tail"], checked["length"]
    if not (0 < length <= max_record_bytes + 1 and head + tail <= length - 1
            and head + len(raw_insert) + tail <= max_record_bytes):
        raise InvalidCheckpointState(f"{where}: a patch keeps {head} + {tail} bytes of a {length}-byte line and "
                                     f"inserts {len(raw_insert)} (records of at most {max_record_bytes} bytes)")
    return PatchLine(record, checked["digest"], checked["records_file"], checked["offset"], length, head, tail,
                     raw_insert)


def apply_patch(patch: PatchLine, base_line: bytes) -> Record:
    """The record ``patch`` stands for, from its base line (read at its offset, newline included)."""
    where = f"patch of {patch.record.episode.capture_key} into {patch.records_file}"
    if len(base_line) != patch.length or base_line.find(b"\n") != patch.length - 1:
        raise InvalidCheckpointState(f"{where}: no whole line of {patch.length} bytes at offset {patch.offset}")
    base = base_line[:-1]
    if is_reference(Record.from_raw(base)):
        raise InvalidCheckpointState(f"{where}: a patch's base is an inline line")
    raw = base[:patch.keep_head] + patch.insert + base[len(base) - patch.keep_tail:]
    if hashlib.sha256(raw).hexdigest() != patch.digest:
        raise InvalidCheckpointState(f"{where}: the patched bytes do not hash to the patch's digest")
    record = Record.from_raw(raw)
    if record.episode != patch.record.episode or is_reference(record):
        raise InvalidCheckpointState(f"{where}: the patched record is an inline record of the patch's episode_id")
    return record
