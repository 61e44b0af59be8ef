"""Checkpoint files: records, then the manifest (docs/protocol.md section 6). The only code that
touches them, through one ``FileOps`` seam.

Write, per participant, under ``<checkpoint_dir>/gym/<kind>/<instance>/``:

0. when the writer opens (``start``, beside the commit's capture), create ``.records-<random>.tmp`` and
   ``.manifest-<random>.tmp``: the write itself creates no file (but those a subclass adds);
1. stream the record lines to the records' temporary file, hashing (SHA-256) and counting, the
   writeback of each chunk started once it is written (``FileOps.start_writeback``);
2. write the manifest into its temporary file (its writeback started too);
3. fsync the records, the manifest's temporary file and any file a subclass handed over (the policy
   model's token sidecar and its index), all at once (``FileOps.fsync_all``); once every one of
   them returned, rename each but the manifest's to its name (the sidecar first, then the records
   to ``records-<sha256>.jsonl``); fsync the directory;
4. hard-link the manifest to ``manifest.json`` (never replaced: an identical manifest already there
   is the same commit, a different one an error); fsync the directory.

Every file is written before the first fsync, so on ext4 that fsync's journal commit carries the
blocks of all of them; the others, run beside it, wait for little more (measured in ``FileOps``).

The link is the commit point. It runs under a ``StopSignal``: a checkpoint resumed before that
point never gets a manifest. Read streams the records file once, checking the manifest's digest
and count and keeping only the records in scope; any inconsistency is ``InvalidCheckpointState``.
Reads are bounded before they happen: files are opened only when they are regular files
(``FileOps.open_read``), a records file larger than its manifest's ``record_count`` lines of at most
``max_record_bytes`` each is refused before its first byte is read, every line is read with that
bound, and nothing past the manifest's count is read. With a root, ``checkpoint_dir`` must resolve
inside it (no ``..``, no symlink escape); without one (``root=None``) any absolute path is accepted.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import operator
import re
import secrets
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from itertools import accumulate, repeat
from pathlib import Path, PurePath
from typing import Any, BinaryIO, TypeVar, cast

import orjson

from nemo_gym_ckpt.checkpoint.fileops import FileOps, file_size
from nemo_gym_ckpt.checkpoint.incremental import (
    BaseIndex,
    IndexBuilder,
    Inline,
    Plan,
    Span,
    link_files,
    plan,
    resolve,
    run_steps,
    span_line,
)
from nemo_gym_ckpt.checkpoint.patches import Patch, patch_line
from nemo_gym_ckpt.checkpoint.records import Record, Scope, is_reference
from nemo_gym_ckpt.errors import (
    CheckpointConflict,
    InvalidCheckpointState,
    InvalidRequest,
    PayloadTooLarge,
    StaleCheckpoint,
    Unavailable,
)

__all__ = [
    "DEFAULT_MAX_RECORD_BYTES",
    "MANIFEST_NAME",
    "SCHEMA_VERSION",
    "CheckpointStore",
    "Manifest",
    "ReadResult",
    "RecordWriter",
    "StopSignal",
    "WriteStopped",
    "read_bounded_lines",
    "write_errors",
]

T = TypeVar("T")
MakeIndex = Callable[[], Generator[None, None, BaseIndex]]
"""Makes a committed checkpoint's index in steps (``IndexBuilder.finish_in_steps``)."""
CHUNK_BYTES = 1 << 20
"""Records are joined, written and hashed this many bytes at a time: a chunk stays in the CPU's
cache between the join, the write and the hash (2,048 lines of 1.1 KB: 2.3 ms against 9-10 ms in
chunks of 4 MiB), and is one system call (``WRITE_SLICE``). Each chunk's write and hash let go of
the interpreter's lock twice, to take it back beside a busy loop (``switching``): a 2 MB write beside
a busy thread took 20 ms in chunks of 256 KiB, 13-15 in chunks of 1 MiB (4 ms alone, either way)."""
SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 64 * 1024
DEFAULT_MAX_RECORD_BYTES = 64 * 1024 * 1024
_SHA256 = re.compile(r"[0-9a-f]{64}")
_RAW = operator.attrgetter("raw")


class WriteStopped(StaleCheckpoint):
    """The checkpoint was resumed before its write reached the commit point."""


@dataclass(frozen=True)
class Manifest:
    kind: str
    instance: str
    checkpoint_id: str
    records_file: str
    records_sha256: str
    record_count: int
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        """The fields, ``schema_version`` first, then in their order (``vars``: no deep copy, unlike
        ``asdict``; every field is a string or an integer)."""
        return {"schema_version": self.schema_version, **{k: v for k, v in vars(self).items()
                                                          if k != "schema_version"}}

    def encode(self) -> bytes:
        return orjson.dumps(self.to_json(), option=orjson.OPT_INDENT_2) + b"\n"

    @classmethod
    def parse(cls, content: bytes) -> Manifest:
        try:
            data = orjson.loads(content)
        except orjson.JSONDecodeError:
            raise InvalidCheckpointState("manifest.json is not valid JSON") from None
        expected = set(cls.__dataclass_fields__)
        if not isinstance(data, dict) or set(data) != expected:
            raise InvalidCheckpointState(f"manifest.json must have exactly the fields {sorted(expected)}")
        _check_manifest_types(data)
        return cls(**data)


def _check_manifest_types(data: dict[str, Any]) -> None:
    if data["schema_version"] != SCHEMA_VERSION or type(data["schema_version"]) is not int:
        raise InvalidCheckpointState(f"manifest schema_version: expected {SCHEMA_VERSION}, "
                                     f"got {data['schema_version']!r}")
    for key in ("kind", "instance", "checkpoint_id", "records_file", "records_sha256"):
        if not isinstance(data[key], str):
            raise InvalidCheckpointState(f"manifest {key} must be a string")
    if type(data["record_count"]) is not int or data["record_count"] < 0:
        raise InvalidCheckpointState("manifest record_count must be a non-negative integer")
    if not _SHA256.fullmatch(data["records_sha256"]):
        raise InvalidCheckpointState("manifest records_sha256 is not a SHA-256 hex digest")
    if data["records_file"] != f"records-{data['records_sha256']}.jsonl":
        raise InvalidCheckpointState(f"manifest names records file {data['records_file']!r}, "
                                     f"expected records-{data['records_sha256']}.jsonl")


class StopSignal:
    """Orders a resume against the commit point of a write: exactly one of them goes first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopped = False
        self._passed = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def stop(self) -> bool:
        """Stop the write; ``False`` when it had already passed its commit point."""
        with self._lock:
            if not self._passed:
                self._stopped = True
            return not self._passed

    def check(self) -> None:
        if self._stopped:
            raise WriteStopped("the checkpoint was resumed before its write finished")

    def commit_point(self, action: Callable[[], T]) -> T:
        """Run ``action`` unless stopped; once it returns, a later ``stop`` is too late."""
        with self._lock:
            self.check()
            result = action()
            self._passed = True
            return result


@dataclass(frozen=True)
class ReadResult:
    manifest: Manifest
    records: list[Record]
    bytes_read: int


@dataclass
class _Unsynced:
    """A file of a commit, written and still open, not yet fsynced; renamed to ``final`` once it is
    (``None``: the manifest's temporary file, which is linked instead)."""

    fd: int
    temp: Path
    final: Path | None


class RecordWriter:
    """One participant's write of one checkpoint; its methods run in a worker thread, in order.

    ``base`` (set by the store) is the previous committed checkpoint: ``write_records`` references
    what did not change since (``incremental``). Once the manifest is linked, ``on_commit`` gets
    what makes the index of this checkpoint, the base of the next one (made later, off the pause).
    """

    def __init__(self, ops: FileOps, directory: Path, stop: StopSignal) -> None:
        self._ops = ops
        self.directory = directory
        self._stop = stop
        self._lock = threading.Lock()
        self._hash = hashlib.sha256()
        self.count = 0
        self.bytes = 0
        self.referenced = 0
        self.patched = 0
        self.linked: list[str] = []
        self._fd: int | None = None
        self._temps: list[Path] = []
        self._unsynced: list[_Unsynced] = []  # written, to be fsynced at ``finish``
        self._manifest: _Unsynced | None = None  # the manifest's temporary file, empty until ``finish``
        self.sync_s = 0.0
        """Seconds spent in the fsyncs of ``finish`` (files and directory): what of the write waited
        for the disk (and for a core once the disk was done)."""
        self.base: BaseIndex | None = None
        self.on_commit: Callable[[MakeIndex], None] | None = None
        self.max_record_bytes = DEFAULT_MAX_RECORD_BYTES  # the store's bound, set by ``open_writer``
        self._index = IndexBuilder(directory)

    def write_records(self, records: Sequence[Record]) -> None:
        """Write every record of this commit: inline, in runs as a span of a linked base file, or as
        a patch of a line of one (docs/protocol.md section 6.1), in chunks of about ``CHUNK_BYTES``.
        A record longer than ``max_record_bytes`` is refused before anything is written: a restore
        with the same bound would refuse the checkpoint."""
        raws = list(map(_RAW, records))
        sizes = list(map(len, raws))
        self._check_record_sizes(records, sizes)
        base = self.base
        decided = plan(records, base)
        if base is not None and decided.links:
            with self._lock, write_errors(self.directory):
                self._stop.check()
                self.linked = sorted(link_files(self._ops, base.directory, base.sizes, decided.links, self.directory))
        spans = {span.start: span for span in decided.spans if span.where.records_file in self.linked}
        patches = {number: patch for number, patch in decided.patches.items() if patch.records_file in self.linked}
        if not spans and not patches:  # nothing referenced (a full commit): every record inline, at once
            self._index.inline_all(records, self.bytes)
            self._write_all(raws, sizes)
        else:
            self._write_chunked(self._planned_lines(records, decided, spans, patches))

    def _check_record_sizes(self, records: Sequence[Record], sizes: list[int]) -> None:
        if not sizes or max(sizes) <= self.max_record_bytes:
            return
        record = next(record for record in records if len(record.raw) > self.max_record_bytes)
        raise PayloadTooLarge(f"the record of {record.episode.capture_key} is {len(record.raw)} bytes, over the "
                              f"store's max_record_bytes of {self.max_record_bytes}: a restore would refuse it; "
                              "this commit did not succeed and must not be published")

    def _planned_lines(
        self, records: Sequence[Record], decided: Plan, spans: dict[int, Span], patches: dict[int, Patch]
    ) -> Iterator[bytes]:
        """Each line of this commit in order (a span, a patch or a record), noted in the index."""
        sizes = self.base.sizes if self.base is not None else {}
        known = self.base.span_lines if self.base is not None else {}  # a span of the same place: its line
        offset, number = self.bytes, 0
        while number < len(records):
            span, patch = spans.get(number), patches.get(number)
            if span is not None:
                place = span.place
                line = known.get(place) or span_line(records, span)
                places = cast("list[Inline]", decided.found[span.start:span.stop])  # a span's lines all are
                self._index.referenced(records[span.start:span.stop], places, place, line,
                                       sizes[span.where.records_file])
                self.referenced += span.stop - span.start
                number = span.stop
            elif patch is not None:
                line = patch_line(records[number], patch)
                self._index.patched(records[number], patch if patch.line is not None else replace(patch, line=line),
                                    sizes[patch.records_file])
                self.patched += 1
                number += 1
            else:
                line = records[number].raw
                self._index.inline(records[number], offset)
                number += 1
            yield line
            offset += len(line) + 1

    def _write_chunked(self, lines: Iterable[bytes]) -> None:
        """Write ``lines`` in chunks of about ``CHUNK_BYTES``."""
        chunk: list[bytes] = []
        size = 0
        for line in lines:
            chunk.append(line)
            size += len(line) + 1
            if size >= CHUNK_BYTES:
                self.write_lines(chunk)
                chunk, size = [], 0
        self.write_lines(chunk)

    def _write_all(self, lines: list[bytes], sizes: list[int]) -> None:
        """Write ``lines`` (of ``sizes`` bytes) in the chunks ``_write_chunked`` would make, found by a
        few passes in C (each chunk ends at the first line that brings it to ``CHUNK_BYTES``) instead
        of a step in Python per line."""
        ends = list(accumulate(map(operator.add, sizes, repeat(1))))  # newlines counted
        start, before = 0, 0
        while start < len(lines):
            stop = bisect_left(ends, before + CHUNK_BYTES, lo=start) + 1
            self.write_lines(lines[start:stop])
            before, start = ends[min(stop, len(lines)) - 1], stop

    def start(self) -> None:
        """Create the records' and the manifest's temporary files (the writer is opened beside the
        capture: no file is created in the write itself, but those a subclass adds)."""
        try:
            with self._lock, write_errors(self.directory):
                self._records_temp = self._temp_path(".records")
                self._fd = self._ops.open_new(self._records_temp)
                temp = self._temp_path(".manifest")
                self._manifest = _Unsynced(self._ops.open_new(temp), temp, None)
        except BaseException:
            self.abort()
            raise

    def write_lines(self, lines: Sequence[bytes]) -> None:
        """Append records (each without its newline) to the temporary records file."""
        if not lines:
            return
        with self._lock:
            self._stop.check()
            if self._fd is None:
                raise WriteStopped("the write was aborted")
            chunk = b"\n".join([*lines, b""])  # a newline after each, one copy
            with write_errors(self.directory):
                self._ops.write(self._fd, chunk)
                self._ops.start_writeback(self._fd, self.bytes, len(chunk))  # the disk works while we hash
            self._hash.update(chunk)
            self.bytes += len(chunk)
            self.count += len(lines)

    @property
    def bytes_written(self) -> int:
        """The bytes this commit wrote into its directory: its records file (a store that writes
        more files adds theirs)."""
        return self.bytes

    def sync_with_records(self, fd: int, temp: Path, final: Path) -> None:
        """A file of this commit written to ``temp`` and not yet fsynced (``FileOps.write_new_unsynced``,
        ``fd`` still open): ``finish`` fsyncs it with the records, closes it and renames it to
        ``final`` before the directory's fsync; ``abort`` closes and removes it."""
        with self._lock:
            if self._fd is None:  # aborted (or finished) meanwhile: nobody would fsync or remove it
                _quietly(self._ops.close, fd)
                _quietly(self._ops.unlink, temp)
                raise WriteStopped("the write was aborted")
            self._temps.append(temp)
            self._unsynced.append(_Unsynced(fd, temp, final))

    def finish(self, kind: str, instance: str, checkpoint_id: str) -> Manifest:
        """Make every file of this commit durable, then hard-link the manifest into place (the commit
        point). The manifest's temporary file is written before any file of the commit is fsynced:
        on ext4 the first fsync's journal commit then carries the blocks and names of all of them,
        and the later fsyncs find little left to wait for (``_sync_files``)."""
        with self._lock, write_errors(self.directory):
            self._stop.check()
            if self._fd is None:
                raise WriteStopped("the write was aborted")
            digest = self._hash.hexdigest()
            manifest = Manifest(kind, instance, checkpoint_id, f"records-{digest}.jsonl", digest, self.count)
            fd, self._fd = self._fd, None
            self._unsynced.append(_Unsynced(fd, self._records_temp, self.directory / manifest.records_file))
            content = manifest.encode()
            temp = self._write_manifest(content)
            self._sync_files()
            self._stop.check()
            self._stop.commit_point(lambda: self._link_manifest(temp, content))
            _quietly(self._ops.unlink, temp)  # a leftover temporary file is harmless; the link counts
            self._temps.remove(temp)
            self._timed(self._ops.fsync_dir, self.directory)
        if self.on_commit is not None:
            self.on_commit(functools.partial(self._index.finish_in_steps, manifest.records_file, self.bytes))
        return manifest

    def _write_manifest(self, content: bytes) -> Path:
        """The manifest's bytes in its temporary file (made by ``start``), to be fsynced with the
        records; its path."""
        file, self._manifest = self._manifest, None
        assert file is not None  # made by ``start``; ``finish`` runs once
        self._unsynced.append(file)
        self._ops.write(file.fd, content)
        self._ops.start_writeback(file.fd, 0, len(content))
        return file.temp

    def abort(self) -> None:
        """Close and remove the temporary files (never a renamed records file or a manifest)."""
        with self._lock:
            fd, self._fd = self._fd, None
            if fd is not None:
                _quietly(self._ops.close, fd)
            manifest, self._manifest = self._manifest, None
            if manifest is not None:
                _quietly(self._ops.close, manifest.fd)
            for file in self._unsynced:
                _quietly(self._ops.close, file.fd)
            self._unsynced.clear()
            for temp in self._temps:
                _quietly(self._ops.unlink, temp)
            self._temps.clear()

    def _temp_path(self, prefix: str) -> Path:
        temp = self.directory / f"{prefix}-{secrets.token_hex(8)}.tmp"
        self._temps.append(temp)
        return temp

    def _sync_files(self) -> None:
        """Every written file fsynced, all at once (``FileOps.fsync_all``: one wait for the disk, not
        one per file), then each closed and renamed to its name (the manifest's stays a temporary
        file, linked later), then the directory fsynced: no name of this commit is on the disk before
        its file's bytes are (no rename starts before every fsync returned), and the manifest is
        linked only after all of them."""
        files = self._unsynced
        # an error names its file (``write_errors``); ``abort`` closes and removes them all
        self._timed(self._ops.fsync_all, [(file.fd, str(file.final or file.temp)) for file in files])
        while files:
            file = files.pop(0)
            self._ops.close(file.fd)
            if file.final is not None:
                self._ops.rename(file.temp, file.final)
                self._temps.remove(file.temp)
        self._timed(self._ops.fsync_dir, self.directory)

    def _timed(self, sync: Callable[[T], None], what: T) -> None:
        """``sync(what)``, its time added to ``sync_s``."""
        began = time.perf_counter()
        try:
            sync(what)
        finally:
            self.sync_s += time.perf_counter() - began

    def _link_manifest(self, temp: Path, content: bytes) -> None:
        target = self.directory / MANIFEST_NAME
        try:
            self._ops.link(temp, target)
        except FileExistsError:
            existing = _read_manifest_bytes(self._ops, target)
            if Manifest.parse(existing) != Manifest.parse(content):
                raise CheckpointConflict(f"{target} already holds a different manifest") from None


class CheckpointStore:
    """Writes and reads participant checkpoints under ``root`` (the configured checkpoint root, or
    ``None``: then any absolute ``checkpoint_dir``)."""

    def __init__(
        self, root: Path | None, ops: FileOps | None = None, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    ) -> None:
        self.root = None if root is None else Path(root)
        self.ops = ops or FileOps()
        self.max_record_bytes = max_record_bytes
        self._base: BaseIndex | None = None
        self._pending: MakeIndex | None = None
        self._settling = threading.Lock()

    @property
    def base(self) -> BaseIndex | None:
        """The previous committed (or restored-from) checkpoint's index, made now if it is not yet."""
        self.settle()
        return self._base

    def remember(self, index: BaseIndex) -> None:
        """The checkpoint just restored from is the base of the next commit."""
        with self._settling:
            self._base, self._pending = index, None

    def remember_later(self, make: MakeIndex) -> None:
        """The checkpoint just committed is the base of the next commit; ``make`` makes its index in
        steps (per record, so not inside the pause: ``settle_steps`` after resume, or the next
        commit's ``settle``)."""
        with self._settling:
            self._pending = make

    @property
    def unsettled(self) -> bool:
        """A committed checkpoint's index is still to be made (``settle``)."""
        return self._pending is not None

    def settle(self) -> None:
        """Make the pending index of the last commit now, at once (one at a time)."""
        with self._settling:
            if self._pending is not None:
                self._base, self._pending = run_steps(self._pending()), None

    def settle_steps(self) -> Iterator[None]:
        """Make the pending index a step at a time (``INDEX_STEP`` records; the caller rests between
        steps). It is kept after the last step unless a ``settle`` (the next commit's) made it first."""
        pending = self._pending
        if pending is None:
            return
        index = yield from pending()
        with self._settling:
            if self._pending is pending:
                self._base, self._pending = index, None

    def locate(self, checkpoint_dir: str) -> Path:
        """The resolved ``checkpoint_dir``, confined to the root (a relative path resolves against the
        working directory, as any path does: controllers should send absolute paths). Without a
        root, the path must be absolute."""
        return _confine(self.root, checkpoint_dir)

    def instance_dir(self, checkpoint_dir: Path, kind: str, instance: str) -> Path:
        return checkpoint_dir / "gym" / kind / instance

    def open_writer(
        self, checkpoint_dir: Path, kind: str, instance: str, stop: StopSignal, *, incremental: bool = True
    ) -> RecordWriter:
        """Create the instance directory (durably) and start a writer in it; with ``incremental``
        it references what did not change since the previous committed checkpoint."""
        directory = self.instance_dir(checkpoint_dir, kind, instance)
        _check_inside(self.root, directory)  # before creating anything: no symlink leads out
        with write_errors(directory):
            self._makedirs(directory)
        _check_inside(self.root, directory)
        writer = self.new_writer(directory, stop)
        writer.max_record_bytes = self.max_record_bytes
        base = self.base if incremental else None  # made once here if the last commit's index is pending
        writer.base = base if base is not None and base.directory != directory else None
        writer.on_commit = self.remember_later
        writer.start()
        return writer

    def new_writer(self, directory: Path, stop: StopSignal) -> RecordWriter:
        """The writer of one commit in ``directory``; a store that writes more than records overrides this."""
        return RecordWriter(self.ops, directory, stop)

    def read(self, checkpoint_dir: Path, kind: str, instance: str, scope: Scope) -> ReadResult:
        """Read and check a committed checkpoint, keeping the records of the episodes in ``scope``."""
        directory = self.instance_dir(checkpoint_dir, kind, instance)
        _check_inside(self.root, directory)
        manifest = self._read_manifest(directory)
        if (manifest.kind, manifest.instance) != (kind, instance):
            raise InvalidCheckpointState(f"manifest is for {manifest.kind}/{manifest.instance}, "
                                         f"expected {kind}/{instance}")
        lines, size = self._read_records(directory / manifest.records_file, manifest, scope)
        records, index = resolve(self.ops, directory, lines, manifest.records_file, scope, self.max_record_bytes)
        index.sizes[manifest.records_file] = size
        self.remember(index)
        return ReadResult(manifest, records, size)

    def _read_manifest(self, directory: Path) -> Manifest:
        try:
            content = _read_manifest_bytes(self.ops, directory / MANIFEST_NAME)
        except FileNotFoundError:
            raise InvalidCheckpointState(f"no committed checkpoint at {directory} (no manifest)") from None
        except OSError as error:
            raise InvalidCheckpointState(f"cannot read the manifest in {directory}: {error}") from None
        return Manifest.parse(content)

    def _read_records(self, path: Path, manifest: Manifest, scope: Scope) -> tuple[list[tuple[Record, int]], int]:
        """The lines in scope (and every span, which may hold records in scope) with their offsets."""
        digest, count, size, kept = hashlib.sha256(), 0, 0, []
        try:
            with self.ops.open_read(path) as file:
                _check_records_size(file_size(file), manifest, self.max_record_bytes, path.name)
                for line in read_bounded_lines(file, manifest.record_count, self.max_record_bytes, path.name):
                    digest.update(line)
                    record = _parse_line(line, count + 1)
                    if record.episode in scope or is_reference(record):
                        kept.append((record, size))
                    count, size = count + 1, size + len(line)
        except OSError as error:
            raise InvalidCheckpointState(f"cannot read records {path.name}: {error.strerror}") from None
        if (digest.hexdigest(), count) != (manifest.records_sha256, manifest.record_count):
            raise InvalidCheckpointState(f"records {path.name} do not match the manifest (sha256 or count: "
                                         f"{count} lines, expected {manifest.record_count})")
        return kept, size

    def _makedirs(self, directory: Path) -> None:
        missing = []
        for path in (directory, *directory.parents):
            if path.is_dir():
                break
            missing.append(path)
        for path in reversed(missing):
            try:
                self.ops.mkdir(path)
            except FileExistsError:
                continue
            self.ops.fsync_dir(path.parent)


def _check_records_size(size: int, manifest: Manifest, max_record_bytes: int, name: str) -> None:
    """Refuse, before reading it, a records file longer than its manifest allows."""
    allowed = manifest.record_count * (max_record_bytes + 1)
    if size > allowed:
        raise InvalidCheckpointState(f"records {name} hold {size} bytes, more than {manifest.record_count} "
                                     f"records of at most {max_record_bytes} bytes each (the bound)")


def read_bounded_lines(file: BinaryIO, max_lines: int | None, max_line_bytes: int, name: str) -> Iterator[bytes]:
    """The lines of ``file`` (each with its newline, the last maybe without), each read with the
    bound ``max_line_bytes`` (without its newline): a longer line is ``InvalidCheckpointState`` once
    ``max_line_bytes + 1`` of its bytes are in memory, never more. After ``max_lines`` lines (when
    given) one more byte is looked at: a file going on is refused there, unread."""
    number = 0
    while max_lines is None or number < max_lines:
        line = file.readline(max_line_bytes + 2)
        if not line:
            return
        number += 1
        body = len(line) - 1 if line.endswith(b"\n") else len(line)
        if body > max_line_bytes:
            raise InvalidCheckpointState(f"{name}: line {number} is longer than the bound of {max_line_bytes} bytes")
        yield line
    if file.read(1):
        raise InvalidCheckpointState(f"{name} goes on past the {max_lines} lines its manifest counts")


def _parse_line(line: bytes, number: int) -> Record:
    if not line.endswith(b"\n"):
        raise InvalidCheckpointState(f"record {number} is truncated (no newline)")
    return Record.from_raw(line[:-1])


def _read_manifest_bytes(ops: FileOps, path: Path) -> bytes:
    with ops.open_read(path) as file:
        content = file.read(MAX_MANIFEST_BYTES + 1)
    if len(content) > MAX_MANIFEST_BYTES:
        raise InvalidCheckpointState(f"{path.name} is larger than {MAX_MANIFEST_BYTES} bytes")
    return content


def _confine(root: Path | None, checkpoint_dir: str) -> Path:
    if not checkpoint_dir or "\x00" in checkpoint_dir:
        raise InvalidRequest("checkpoint_dir must be a non-empty path")
    if ".." in PurePath(checkpoint_dir).parts:
        raise InvalidRequest(f"checkpoint_dir {checkpoint_dir!r} must not contain '..'")
    if root is None and not PurePath(checkpoint_dir).is_absolute():
        raise InvalidRequest(f"checkpoint_dir {checkpoint_dir!r} must be an absolute path")
    return _check_inside(root, Path(checkpoint_dir))


def _check_inside(root: Path | None, path: Path) -> Path:
    if root is None:
        return _resolved(path)
    resolved_root, resolved = _resolved(root), _resolved(path)
    if resolved == resolved_root or not resolved.is_relative_to(resolved_root):
        raise InvalidRequest(f"checkpoint_dir must resolve inside the checkpoint root {resolved_root}")
    return resolved


def _resolved(path: Path) -> Path:
    """``path`` resolved; a symlink loop on the way (``RuntimeError`` before Python 3.13) is
    ``InvalidRequest``, as a symlink leading out of the root is."""
    try:
        return path.resolve()
    except (RuntimeError, OSError) as error:
        raise InvalidRequest(f"checkpoint_dir cannot be resolved at {path}: {error}") from None


@contextmanager
def write_errors(directory: Path, what: str = "checkpoint write") -> Iterator[None]:
    """Turn an ``OSError`` of a commit's write into ``Unavailable`` naming ``what``, the errno, the
    directory and the file when the error names one: that commit did not succeed and must not be
    published."""
    try:
        yield
    except OSError as error:
        name = errno.errorcode.get(error.errno or 0, "OSError")
        file = f" at {PurePath(error.filename).name}" if isinstance(error.filename, str) else ""
        raise Unavailable(f"{what} failed in {directory}: {name} ({error.strerror or error}){file}; "
                          "this commit did not succeed and must not be published") from error


def _quietly(operation: Callable[[Any], None], argument: Any) -> None:
    """Clean-up after a failed write: a second failure must not hide the first."""
    with suppress(OSError):
        operation(argument)


