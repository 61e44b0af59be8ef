"""Incremental checkpoints: records that did not change since this participant's previous committed
checkpoint are referenced, not written again (docs/protocol.md section 6.1).

Every line a commit writes is either a record itself (**inline**) or a **span**: one line that
stands for a run of consecutive inline lines of another records file of the same directory::

    {"episode_id": {...}, "same_as": "<sha256 of the run's bytes>", "records_file": "records-<sha256>.jsonl",
     "offset": <byte offset of the run>, "length": <bytes, newlines included>, "lines": <records in the run>}

``episode_id`` is the run's first record's. The file is an earlier checkpoint's records file,
hard-linked into the new checkpoint's directory under its own name before any line refers to it, so
every directory holds all it needs: the directory it came from is never modified, and deleting
(pruning) an earlier checkpoint never breaks a later one. A span always stands for inline lines
(never another span): one hop. A run of unchanged records costs one line of about 230 bytes however
long it is; a run no longer than a span line would be is written inline.

``BaseIndex`` is what a participant remembers of its previous committed checkpoint (or of the one it
restored from): the directory, the size of each records file, and for each record's bytes the file
and offset of the inline line holding them. ``plan`` finds the runs: records consecutive in the new
commit whose lines are consecutive in one base file. A file whose records still in use add up to
less than half of its size is not linked (its records are written inline again), so no checkpoint
keeps more than about twice the bytes it needs; a link that fails (another file system, a pruned or
replaced directory) also falls back to inline. A commit asked with ``incremental: false`` references
nothing.

Reading (``resolve``): each span's bytes are read from its file at its offset, line by line with the
record bound, and checked: its digest, its length, its line count, inline lines only, and the first
one's ``episode_id``. Spans into one file may not overlap, so a restore reads each byte at most
once. Every byte installed is checked against a digest.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from nemo_gym_ckpt.checkpoint.fileops import FileOps, file_size
from nemo_gym_ckpt.checkpoint.records import Record, Scope
from nemo_gym_ckpt.errors import InternalError, InvalidCheckpointState

__all__ = [
    "KEEP_RATIO",
    "REFERENCE_KEY",
    "SPAN_KEYS",
    "BaseIndex",
    "IndexBuilder",
    "Inline",
    "Plan",
    "Span",
    "is_reference",
    "link_files",
    "plan",
    "refuse_reserved",
    "resolve",
    "span_line",
]

REFERENCE_KEY = "same_as"
SPAN_KEYS = ("episode_id", REFERENCE_KEY, "records_file", "offset", "length", "lines")
_SPAN_KEY_SET = frozenset(SPAN_KEYS)
KEEP_RATIO = 0.5
"""A base file is linked only if the records still in use fill at least this share of it."""
RECORDS_FILE = re.compile(r"records-[0-9a-f]{64}\.jsonl")
SPAN_BYTES = 256
"""About the length of a span line: a run no longer than this is written inline."""
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class Inline:
    """Where a record's bytes are written inline: a records file and the offset of the line."""

    records_file: str
    offset: int


@dataclass
class BaseIndex:
    """A committed (or restored-from) checkpoint of this participant, as the next commit sees it."""

    directory: Path
    lines: dict[bytes, Inline] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Span:
    """Records ``start:stop`` of a commit, whose lines are ``length`` bytes of a base file at ``where``."""

    start: int
    stop: int
    where: Inline
    length: int


@dataclass
class Plan:
    """One commit's choice: the base files to link, and the runs of records written as spans."""

    links: list[str]
    spans: list[Span]


def plan(records: Sequence[Record], base: BaseIndex | None) -> Plan:
    """The runs worth a span (longer than a span line, their file kept at least ``KEEP_RATIO`` full)."""
    if base is None:
        return Plan([], [])
    runs = [run for run in _runs(records, _located(records, base)) if run.length > SPAN_BYTES]
    live: dict[str, int] = {}
    for run in runs:
        live[run.where.records_file] = live.get(run.where.records_file, 0) + run.length
    kept = {name for name, size in live.items() if size >= KEEP_RATIO * base.sizes.get(name, 0)}
    return Plan(sorted(kept), [run for run in runs if run.where.records_file in kept])


def _located(records: Sequence[Record], base: BaseIndex) -> list[Inline | None]:
    """Each record's inline line in the base; a line is used once (the same bytes again are inline)."""
    used: set[Inline] = set()
    found: list[Inline | None] = []
    for record in records:
        where = base.lines.get(record.raw)
        if where is not None and where in used:
            where = None
        elif where is not None:
            used.add(where)
        found.append(where)
    return found


def _runs(records: Sequence[Record], found: Sequence[Inline | None]) -> list[Span]:
    """Maximal runs of records whose base lines follow each other in one file."""
    runs: list[Span] = []
    start, first, length = 0, None, 0
    for number, (record, where) in enumerate(zip(records, found, strict=True)):
        follows = (where is not None and first is not None and where.records_file == first.records_file
                   and where.offset == first.offset + length)
        if not follows:
            if first is not None:
                runs.append(Span(start, number, first, length))
            start, first, length = number, where, 0
        length += len(record.raw) + 1
    if first is not None:
        runs.append(Span(start, len(records), first, length))
    return runs


def span_line(records: Sequence[Record], span: Span) -> bytes:
    """The line that stands for ``records[span.start:span.stop]`` (their bytes hashed here)."""
    run = records[span.start:span.stop]
    digest = hashlib.sha256()
    for record in run:
        digest.update(record.raw)
        digest.update(b"\n")
    return orjson.dumps({"episode_id": run[0].episode.to_json(), REFERENCE_KEY: digest.hexdigest(),
                         "records_file": span.where.records_file, "offset": span.where.offset,
                         "length": span.length, "lines": len(run)})


def link_files(
    ops: FileOps, source: Path, sizes: Mapping[str, int], names: Iterable[str], directory: Path
) -> set[str]:
    """Hard-link each named file of ``source`` into ``directory``: the names now there with the size
    ``sizes`` says (a file that cannot be linked, or is not the size it was, is left out)."""
    linked = set()
    for name in names:
        target = directory / name
        try:
            ops.link(source / name, target)
        except FileExistsError:
            pass
        except OSError:
            continue
        try:
            if target.stat().st_size == sizes.get(name):
                linked.add(name)
        except OSError:
            continue
    return linked


class IndexBuilder:
    """Collects where each record of one commit lives; ``finish`` names the new records file."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._inline: list[tuple[bytes, int]] = []
        self._referenced: list[tuple[bytes, Inline]] = []
        self.sizes: dict[str, int] = {}

    def inline(self, raw: bytes, offset: int) -> None:
        self._inline.append((raw, offset))

    def referenced(self, run: Sequence[Record], where: Inline, size: int) -> None:
        offset = where.offset
        for record in run:
            self._referenced.append((record.raw, Inline(where.records_file, offset)))
            offset += len(record.raw) + 1
        self.sizes[where.records_file] = size

    def finish(self, records_file: str, size: int) -> BaseIndex:
        lines = dict(self._referenced)
        lines.update((raw, Inline(records_file, offset)) for raw, offset in self._inline)
        return BaseIndex(self.directory, lines, {**self.sizes, records_file: size})


def refuse_reserved(record: Record) -> None:
    """An adapter's record may not look like a span (a bug, like a token array)."""
    if REFERENCE_KEY in record.data:
        raise InternalError(f"records never carry the key {REFERENCE_KEY!r} (it marks a reference)")


# ---- reading --------------------------------------------------------------------------------------


def is_reference(record: Record) -> bool:
    return REFERENCE_KEY in record.data


@dataclass(frozen=True, slots=True)
class _SpanLine:
    record: Record
    digest: str
    records_file: str
    offset: int
    length: int
    lines: int


def _span_of(record: Record, records_file: str, max_record_bytes: int) -> _SpanLine:
    data: dict[str, Any] = record.data
    where = f"record of {record.episode.capture_key}"
    if data.keys() != _SPAN_KEY_SET:
        raise InvalidCheckpointState(f"{where}: a span is {{{', '.join(SPAN_KEYS)}}}")
    digest, name = data[REFERENCE_KEY], data["records_file"]
    numbers = [data[key] for key in ("offset", "length", "lines")]
    if not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
        raise InvalidCheckpointState(f"{where}: a span's {REFERENCE_KEY} is a SHA-256 hex digest")
    if not isinstance(name, str) or not RECORDS_FILE.fullmatch(name) or name == records_file:
        raise InvalidCheckpointState(f"{where}: a span names another records-<sha256>.jsonl of its directory")
    if any(type(value) is not int or value < 0 for value in numbers):
        raise InvalidCheckpointState(f"{where}: a span's offset, length and lines are non-negative integers")
    offset, length, lines = numbers
    if not 0 < lines <= length <= lines * (max_record_bytes + 1):
        raise InvalidCheckpointState(f"{where}: a span of {lines} lines cannot be {length} bytes "
                                     f"(records of at most {max_record_bytes} bytes)")
    return _SpanLine(record, digest, name, offset, length, lines)


def _check_disjoint(spans: Iterable[_SpanLine]) -> None:
    """Spans into one file may not overlap: each byte of a restore is read once."""
    ends: dict[str, int] = {}
    for span in sorted(spans, key=lambda span: (span.records_file, span.offset)):
        if span.offset < ends.get(span.records_file, 0):
            raise InvalidCheckpointState(f"spans into {span.records_file} overlap at offset {span.offset}")
        ends[span.records_file] = span.offset + span.length


class _Files:
    """The base files a restore reads, each opened once (never through a symlink) and sized."""

    def __init__(self, ops: FileOps, directory: Path, stack: ExitStack) -> None:
        self.ops, self.directory, self.stack = ops, directory, stack
        self.open: dict[str, BinaryIO] = {}
        self.sizes: dict[str, int] = {}

    def at(self, name: str, offset: int, length: int) -> BinaryIO:
        file = self.open.get(name)
        try:
            if file is None:
                file = self.open[name] = self.stack.enter_context(self.ops.open_read(self.directory / name))
                self.sizes[name] = file_size(file)
            if offset + length > self.sizes[name]:
                raise InvalidCheckpointState(f"a span reaches past the end of {name} "
                                             f"({offset + length} > {self.sizes[name]} bytes)")
            file.seek(offset)
        except OSError as error:
            raise InvalidCheckpointState(f"cannot read the records file {name}: {error.strerror}") from None
        return file


def _read_span(files: _Files, span: _SpanLine, scope: Scope, max_record_bytes: int) -> list[tuple[Record, int]]:
    """The records of a span that are in ``scope``, with their offsets, once the whole span is checked
    (records out of scope are parsed, checked and dropped as they are read)."""
    file = files.at(span.records_file, span.offset, span.length)
    digest, read, found = hashlib.sha256(), 0, []
    where = f"span of {span.record.episode.capture_key} into {span.records_file}"
    for number in range(span.lines):
        line = file.readline(min(max_record_bytes + 2, span.length - read + 1))
        if not line.endswith(b"\n") or len(line) - 1 > max_record_bytes or read + len(line) > span.length:
            raise InvalidCheckpointState(f"{where}: its {span.lines} lines are not {span.length} bytes of whole lines")
        digest.update(line)
        record = Record.from_raw(line[:-1])
        if is_reference(record) or (number == 0 and record.episode != span.record.episode):
            raise InvalidCheckpointState(f"{where}: a span stands for inline lines, the first of its episode_id")
        if record.episode in scope:
            found.append((record, span.offset + read))
        read += len(line)
    if read != span.length:
        raise InvalidCheckpointState(f"{where}: its {span.lines} lines are not {span.length} bytes of whole lines")
    if digest.hexdigest() != span.digest:
        raise InvalidCheckpointState(f"{where}: the bytes at offset {span.offset} do not hash to the span's digest")
    return found


def resolve(
    ops: FileOps, directory: Path, read: Sequence[tuple[Record, int]], records_file: str, scope: Scope,
    max_record_bytes: int,
) -> tuple[list[Record], BaseIndex]:
    """The records in ``scope``, in order, each span replaced by the records it stands for (checked);
    and the index of where each lives (``read``: the lines of ``records_file`` kept, with offsets)."""
    lines_read = [(record, offset, _span_of(record, records_file, max_record_bytes) if is_reference(record) else None)
                  for record, offset in read]
    _check_disjoint(span for _, _, span in lines_read if span is not None)
    index = BaseIndex(directory)
    resolved = []
    with ExitStack() as stack:
        files = _Files(ops, directory, stack)
        for record, offset, span in lines_read:
            if span is None:
                lines = [(record, Inline(records_file, offset))] if record.episode in scope else []
            else:
                lines = [(line, Inline(span.records_file, at))
                         for line, at in _read_span(files, span, scope, max_record_bytes)]
            for line, where in lines:
                resolved.append(line)
                index.lines.setdefault(line.raw, where)
        index.sizes.update(files.sizes)
    return resolved, index
