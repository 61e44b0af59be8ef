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
less than a quarter of its size is not linked (its records are written inline again), so no
checkpoint keeps more than about four times the bytes it needs; a link that fails (another file
system, a pruned or replaced directory) also falls back to inline. A commit asked with
``incremental: false`` references nothing.

A record that changed since the base, when the base has an inline line of the same episode, may be
written as a **patch** of that line instead (``patches.py``): the bytes it keeps of its start and end,
and what it inserts between them. ``plan`` chooses one when its line is at most half the record's
bytes; the base line's file is then linked like a span's, and counts towards ``KEEP_RATIO``.

Reading (``resolve``): each span's bytes are read from its file at its offset, line by line with the
record bound, and checked: its digest, its length, its line count, inline lines only, and the first
one's ``episode_id``; each patch's base line is read and checked (one whole inline line), and the
patched bytes must hash to the patch's digest and be a record of its ``episode_id``. The byte ranges
of spans and patches into one file may not overlap, so a restore reads each byte at most once. Every
byte installed is checked against a digest.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Generator, Iterable, Mapping, Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from itertools import accumulate, chain
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple, TypeVar, cast

import orjson

from nemo_gym_ckpt.checkpoint.fileops import FileOps
from nemo_gym_ckpt.checkpoint.patches import Patch, PatchLine, apply_patch, patch_between, read_patch_line
from nemo_gym_ckpt.checkpoint.records import PATCH_KEY, REFERENCE_KEYS, SPAN_KEY, Record, Scope, is_reference
from nemo_gym_ckpt.errors import InternalError, InvalidCheckpointState
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = [
    "INDEX_STEP",
    "KEEP_RATIO",
    "REFERENCE_KEY",
    "SPAN_KEYS",
    "BaseIndex",
    "IndexBuilder",
    "Inline",
    "Plan",
    "Span",
    "SpanPlace",
    "link_files",
    "plan",
    "refuse_reserved",
    "resolve",
    "run_steps",
    "span_line",
]

REFERENCE_KEY = SPAN_KEY
SPAN_KEYS = ("episode_id", REFERENCE_KEY, "records_file", "offset", "length", "lines")
_SPAN_KEY_SET = frozenset(SPAN_KEYS)
KEEP_RATIO = 0.25
"""A base file is linked only if the records still in use fill at least this share of it: no directory
holds more than about 1 / KEEP_RATIO times the bytes its records need."""
RECORDS_FILE = re.compile(r"records-[0-9a-f]{64}\.jsonl")
SPAN_BYTES = 256
"""About the length of a span line: a run no longer than this is written inline."""
INDEX_STEP = 256
"""Records an index is made of between two pauses of ``IndexBuilder.finish_in_steps``."""
T = TypeVar("T")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class SpanPlace(NamedTuple):
    """The bytes a span stands for: a records file, an offset and a length (a file never changes once
    written, so one place is one run of bytes, one digest and one span line)."""

    records_file: str
    offset: int
    length: int


class Inline(NamedTuple):
    """Where a record's bytes are written inline: a records file and the offset of the line (a
    tuple: a commit makes, hashes and compares one per record)."""

    records_file: str
    offset: int


@dataclass
class BaseIndex:
    """A committed (or restored-from) checkpoint of this participant, as the next commit sees it:
    where each record's bytes are inline (``lines``), for each episode the inline line a changed
    record of it may be patched from (``episodes``: its bytes and place), the files' sizes, and the
    patch of each record written as one (``patch_lines``, each with its line: the same bytes from the
    same base line are that line again, with no search and no hash), and the line of each span by its
    bytes' place (``span_lines``: a run of the same records at the same place is that line again)."""

    directory: Path
    lines: dict[bytes, Inline] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    episodes: dict[RolloutIdentity, tuple[bytes, Inline]] = field(default_factory=dict)
    patch_lines: dict[bytes, Patch] = field(default_factory=dict)
    span_lines: dict[SpanPlace, bytes] = field(default_factory=dict)


class Span(NamedTuple):
    """Records ``start:stop`` of a commit, whose lines are ``length`` bytes of a base file at ``where``
    (a tuple: a commit makes one per run of records, changed or not)."""

    start: int
    stop: int
    where: Inline
    length: int

    @property
    def place(self) -> SpanPlace:
        return SpanPlace(self.where.records_file, self.where.offset, self.length)


@dataclass
class Plan:
    """One commit's choice: the base files to link, the runs of records written as spans, and the
    records written as patches (by their number in the commit); ``found``: each record's inline line
    in the base (``None`` where it has none), which a span's records keep as their place."""

    links: list[str]
    spans: list[Span]
    patches: dict[int, Patch] = field(default_factory=dict)
    found: list[Inline | None] = field(default_factory=list)


def plan(records: Sequence[Record], base: BaseIndex | None) -> Plan:
    """The runs worth a span (longer than a span line) and the changed records worth a patch, into
    base files kept at least ``KEEP_RATIO`` full."""
    if base is None:
        return Plan([], [])
    used: set[Inline] = set()
    found = _located(records, base, used)
    runs = [run for run in _runs(records, found) if run.length > SPAN_BYTES]
    patches = _patches(records, found, base, used)
    live: dict[str, int] = {}
    for name, length in [(run.where.records_file, run.length) for run in runs] + \
            [(patch.records_file, patch.length) for patch in patches.values()]:
        live[name] = live.get(name, 0) + length
    kept = {name for name, size in live.items() if size >= KEEP_RATIO * base.sizes.get(name, 0)}
    return Plan(sorted(kept), [run for run in runs if run.where.records_file in kept],
                {number: patch for number, patch in patches.items() if patch.records_file in kept}, found)


def _located(records: Sequence[Record], base: BaseIndex, used: set[Inline]) -> list[Inline | None]:
    """Each record's inline line in the base; a line is used once (the same bytes again are inline)."""
    found: list[Inline | None] = []
    for record in records:
        where = base.lines.get(record.raw)
        if where is not None and where in used:
            where = None
        elif where is not None:
            used.add(where)
        found.append(where)
    return found


def _patches(records: Sequence[Record], found: Sequence[Inline | None], base: BaseIndex,
             used: set[Inline]) -> dict[int, Patch]:
    """The records not in the base that are worth a patch of their episode's base line (a line used
    once, and never one a span stands for)."""
    patches = {}
    episodes, patch_lines = base.episodes, base.patch_lines
    for number in [number for number, where in enumerate(found) if where is None]:
        record = records[number]
        candidate = episodes.get(record.episode)
        if candidate is None or candidate[1] in used:
            continue
        old, at = candidate
        patch = patch_lines.get(record.raw)  # the patch it was in the base: its line again if of this line
        if patch is None or patch.records_file != at.records_file or patch.offset != at.offset:
            patch = patch_between(record.raw, old, at.records_file, at.offset)
        if patch is not None:
            used.add(at)
            patches[number] = patch
    return patches


def _runs(records: Sequence[Record], found: Sequence[Inline | None]) -> list[Span]:
    """Maximal runs of records whose base lines follow each other in one file."""
    runs: list[Span] = []
    start, first, length = 0, None, 0
    file, follows_at = "", -1  # where the next line of the current run would be (none: -1)
    for number, (record, where) in enumerate(zip(records, found, strict=True)):
        if where is None or where[1] != follows_at or where[0] != file:
            if first is not None:
                runs.append(Span(start, number, first, length))
            start, first, length = number, where, 0
            file, follows_at = where if where is not None else ("", -1)
        size = len(record.raw) + 1
        length += size
        follows_at += size
    if first is not None:
        runs.append(Span(start, len(records), first, length))
    return runs


def span_line(records: Sequence[Record], span: Span) -> bytes:
    """The line that stands for ``records[span.start:span.stop]`` (their bytes hashed here)."""
    run = records[span.start:span.stop]
    digest = hashlib.sha256(b"\n".join([*(record.raw for record in run), b""]))  # one pass: a newline after each
    return orjson.dumps({"episode_id": run[0].episode.to_json(), REFERENCE_KEY: digest.hexdigest(),
                         "records_file": span.where.records_file, "offset": span.where.offset,
                         "length": span.length, "lines": len(run)})


def link_files(
    ops: FileOps, source: Path, sizes: Mapping[str, int], names: Iterable[str], directory: Path
) -> set[str]:
    """Hard-link each named file of ``source`` into ``directory``: the names now there as regular
    files of the size ``sizes`` says. A file that cannot be linked, is not the size it was or is not
    a regular file (``link`` links a symlink itself, not what it points to) is left out, and the link
    made for it removed: a token sidecar's restore reads every file of its name in the directory."""
    linked = set()
    for name in names:
        target = directory / name
        try:
            ops.link(source / name, target)
            made = True
        except FileExistsError:
            made = False
        except OSError:
            continue
        if _regular_of_size(target, sizes.get(name)):
            linked.add(name)
        elif made:
            with suppress(OSError):
                ops.unlink(target)
    return linked


def _regular_of_size(path: Path, size: int | None) -> bool:
    try:
        status = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(status.st_mode) and status.st_size == size


class _KeptRun(NamedTuple):
    """Records a span stands for, each at its place in the base, and the span's place and line."""

    run: Sequence[Record]
    places: Sequence[Inline]
    place: SpanPlace
    line: bytes


class _KeptPatch(NamedTuple):
    """A patched record (its bytes, its episode) with the patch written, its line included."""

    record: Record
    patch: Patch


class IndexBuilder:
    """Collects where each record of one commit lives; ``finish`` names the new records file and
    makes the index. What a commit notes here is cheap (a full commit notes one run); the index's
    per-record work is ``finish``'s, which the participant runs after the pause, a step at a time
    (``CheckpointStore.settle_steps``)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._inline: list[tuple[Record, int]] = []
        self._inline_runs: list[tuple[Sequence[Record], int]] = []
        self._kept: list[_KeptRun | _KeptPatch] = []  # in order: what stays where the base has it
        self.sizes: dict[str, int] = {}

    def inline(self, record: Record, offset: int) -> None:
        self._inline.append((record, offset))

    def inline_all(self, records: Sequence[Record], offset: int) -> None:
        """``records`` written inline one after another from ``offset``."""
        if records:
            self._inline_runs.append((records, offset))

    def referenced(self, run: Sequence[Record], places: Sequence[Inline], span: SpanPlace, line: bytes,
                   size: int) -> None:
        """``run`` written as the span ``line``: each record stays where the base has it (``places``, from
        the plan: consecutive lines of the file at ``span``, ``size`` bytes)."""
        self._kept.append(_KeptRun(run, places, span, line))
        self.sizes[span.records_file] = size

    def patched(self, record: Record, patch: Patch, size: int) -> None:
        """``record`` was written as ``patch`` (its ``line`` made): its episode's base line stays the one
        it patched."""
        self._kept.append(_KeptPatch(record, patch))
        self.sizes[patch.records_file] = size

    def finish(self, records_file: str, size: int) -> BaseIndex:
        return run_steps(self.finish_in_steps(records_file, size))

    def finish_in_steps(self, records_file: str, size: int) -> Generator[None, None, BaseIndex]:
        """``finish``, pausing (a bare ``yield``) after every ``INDEX_STEP`` records: the index made
        on an event loop that serves requests between the steps."""
        lines: dict[bytes, Inline] = {}
        episodes: dict[RolloutIdentity, tuple[bytes, Inline]] = {}
        patch_lines: dict[bytes, Patch] = {}
        span_lines: dict[SpanPlace, bytes] = {}
        done = 0
        for kept in self._kept:
            if isinstance(kept, _KeptPatch):  # its episode's line in the base stays the one it patched
                patch = kept.patch
                episodes[kept.record.episode] = (patch.base, Inline(patch.records_file, patch.offset))
                patch_lines[kept.record.raw] = patch
                continue
            span_lines[kept.place] = kept.line
            for record, at in zip(kept.run, kept.places, strict=True):
                lines[record.raw] = at
                episodes[record.episode] = (record.raw, at)
                done += 1
                if done >= INDEX_STEP:
                    done = 0
                    yield
        runs = (zip(run, accumulate((len(record.raw) + 1 for record in run[:-1]), initial=start), strict=True)
                for run, start in self._inline_runs)
        for record, offset in chain(self._inline, *runs):
            at = Inline(records_file, offset)
            lines[record.raw] = at
            episodes[record.episode] = (record.raw, at)
            done += 1
            if done >= INDEX_STEP:
                done = 0
                yield
        return BaseIndex(self.directory, lines, {**self.sizes, records_file: size}, episodes, patch_lines,
                         span_lines)


def run_steps(steps: Generator[None, None, T]) -> T:
    """What a stepped generator returns, its steps run one after another without pause."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return cast("T", done.value)


def refuse_reserved(record: Record) -> None:
    """An adapter's record may not look like a span or a patch (a bug, like a token array)."""
    if is_reference(record):
        raise InternalError(f"records never carry the keys {REFERENCE_KEYS} (they mark a reference)")


# ---- reading --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _SpanLine:
    record: Record
    digest: str
    records_file: str
    offset: int
    length: int
    lines: int


def _reference_fields(record: Record, records_file: str, key: str, numbers: tuple[str, ...]) -> dict[str, Any]:
    """What spans and patches share, checked: a digest under ``key``, another records file of the
    directory, and ``numbers`` that are non-negative integers."""
    data: dict[str, Any] = record.data
    where = f"record of {record.episode.capture_key}"
    digest, name = data.get(key), data.get("records_file")
    if not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
        raise InvalidCheckpointState(f"{where}: a reference's {key} is a SHA-256 hex digest")
    if not isinstance(name, str) or not RECORDS_FILE.fullmatch(name) or name == records_file:
        raise InvalidCheckpointState(f"{where}: a reference names another records-<sha256>.jsonl of its directory")
    values = {number: data.get(number) for number in numbers}
    if any(type(value) is not int or value < 0 for value in values.values()):
        raise InvalidCheckpointState(f"{where}: a reference's {', '.join(numbers)} are non-negative integers")
    return {"digest": digest, "records_file": name, **values}


def _span_of(record: Record, records_file: str, max_record_bytes: int) -> _SpanLine:
    where = f"record of {record.episode.capture_key}"
    if record.data.keys() != _SPAN_KEY_SET:
        raise InvalidCheckpointState(f"{where}: a span is {{{', '.join(SPAN_KEYS)}}}")
    fields = _reference_fields(record, records_file, REFERENCE_KEY, ("offset", "length", "lines"))
    offset, length, lines = fields["offset"], fields["length"], fields["lines"]
    if not 0 < lines <= length <= lines * (max_record_bytes + 1):
        raise InvalidCheckpointState(f"{where}: a span of {lines} lines cannot be {length} bytes "
                                     f"(records of at most {max_record_bytes} bytes)")
    return _SpanLine(record, fields["digest"], fields["records_file"], offset, length, lines)


def _patch_of(record: Record, records_file: str, max_record_bytes: int) -> PatchLine:
    fields = _reference_fields(record, records_file, PATCH_KEY, ("offset", "length", "keep_head", "keep_tail"))
    return read_patch_line(record, fields, max_record_bytes)


def _check_disjoint(ranges: Iterable[tuple[str, int, int]]) -> None:
    """Spans and patch bases into one file may not overlap: each byte of a restore is read once."""
    ends: dict[str, int] = {}
    for name, offset, length in sorted(ranges):
        if offset < ends.get(name, 0):
            raise InvalidCheckpointState(f"spans or patches into {name} overlap at offset {offset}")
        ends[name] = offset + length


class _Files:
    """The base files a restore reads, each opened once (never through a symlink) and sized. Two
    names of one file (hard links; ``main``, the records file read, among them) are refused: names
    are digests of contents, so only a forged directory has them, to read the same bytes twice."""

    def __init__(self, ops: FileOps, directory: Path, stack: ExitStack, main: str) -> None:
        self.ops, self.directory, self.stack, self.main = ops, directory, stack, main
        self.open: dict[str, BinaryIO] = {}
        self.sizes: dict[str, int] = {}
        self._names: dict[tuple[int, int], str] = {}

    def at(self, name: str, offset: int, length: int) -> BinaryIO:
        file = self.open.get(name)
        try:
            if file is None:
                file = self.open[name] = self.stack.enter_context(self.ops.open_read(self.directory / name))
                self.sizes[name] = self._first_name(name, os.fstat(file.fileno()))
            if offset + length > self.sizes[name]:
                raise InvalidCheckpointState(f"a span reaches past the end of {name} "
                                             f"({offset + length} > {self.sizes[name]} bytes)")
            file.seek(offset)
        except OSError as error:
            raise InvalidCheckpointState(f"cannot read the records file {name}: {error.strerror}") from None
        return file

    def _first_name(self, name: str, status: os.stat_result) -> int:
        """``status``'s size, once its file is known under ``name`` only."""
        if not self._names:
            main = (self.directory / self.main).lstat()
            self._names[(main.st_dev, main.st_ino)] = self.main
        other = self._names.setdefault((status.st_dev, status.st_ino), name)
        if other != name:
            raise InvalidCheckpointState(f"{name} and {other} are one file (hard links): a checkpoint names "
                                         "each records file once")
        return status.st_size


def _read_span(files: _Files, span: _SpanLine, scope: Scope, max_record_bytes: int) -> list[tuple[Record, int]]:
    """The records of a span that are in ``scope``, with their offsets, once the whole span is checked
    (records out of scope are parsed, checked and dropped as they are read)."""
    file = files.at(span.records_file, span.offset, span.length)
    digest, read, found = hashlib.sha256(), 0, []
    where = f"span of {span.record.episode.capture_key} into {span.records_file}"
    for number in range(span.lines):
        line = _read_line(file, min(max_record_bytes + 2, span.length - read + 1), span.records_file)
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


def _read_line(file: BinaryIO, limit: int, name: str) -> bytes:
    try:
        return file.readline(limit)
    except OSError as error:
        raise InvalidCheckpointState(f"cannot read the records file {name}: {error.strerror}") from None


def resolve(
    ops: FileOps, directory: Path, read: Sequence[tuple[Record, int]], records_file: str, scope: Scope,
    max_record_bytes: int,
) -> tuple[list[Record], BaseIndex]:
    """The records in ``scope``, in order, each span replaced by the records it stands for and each
    patch by the record it makes (checked); and the index of where each lives (``read``: the lines of
    ``records_file`` kept, with offsets)."""
    lines_read = [(record, offset, _reference_of(record, records_file, max_record_bytes))
                  for record, offset in read]
    _check_disjoint((ref.records_file, ref.offset, ref.length) for _, _, ref in lines_read if ref is not None)
    index = BaseIndex(directory)
    resolved: list[Record] = []
    with ExitStack() as stack:
        files = _Files(ops, directory, stack, records_file)
        for record, offset, reference in lines_read:
            if isinstance(reference, PatchLine):
                _install_patch(files, reference, scope, index, resolved)
                continue
            if reference is None:
                lines = [(record, Inline(records_file, offset))] if record.episode in scope else []
            else:
                lines = [(line, Inline(reference.records_file, at))
                         for line, at in _read_span(files, reference, scope, max_record_bytes)]
                index.span_lines[SpanPlace(reference.records_file, reference.offset, reference.length)] = record.raw
            for line, where in lines:
                resolved.append(line)
                index.lines.setdefault(line.raw, where)
                index.episodes[line.episode] = (line.raw, where)
        index.sizes.update(files.sizes)
    return resolved, index


def _reference_of(record: Record, records_file: str, max_record_bytes: int) -> _SpanLine | PatchLine | None:
    if SPAN_KEY in record.data:
        return _span_of(record, records_file, max_record_bytes)
    if PATCH_KEY in record.data:
        return _patch_of(record, records_file, max_record_bytes)
    return None


def _install_patch(files: _Files, patch: PatchLine, scope: Scope, index: BaseIndex, resolved: list[Record]) -> None:
    """Read a patch's base line and make its record (every patch is checked, one in scope kept)."""
    try:
        base_line = files.at(patch.records_file, patch.offset, patch.length).read(patch.length)
    except OSError as error:
        raise InvalidCheckpointState(f"cannot read the records file {patch.records_file}: {error.strerror}") from None
    record = apply_patch(patch, base_line)
    if record.episode in scope:
        resolved.append(record)
        index.episodes[record.episode] = (base_line[:-1], Inline(patch.records_file, patch.offset))
        index.patch_lines[record.raw] = Patch(base_line[:-1], patch.records_file, patch.offset, patch.length,
                                              patch.keep_head, patch.keep_tail, line=patch.record.raw)
