"""Incremental checkpoints: a record that did not change since this participant's previous committed
checkpoint is referenced, not written again (docs/protocol.md section 6.1).

Every record line a commit writes is either the record itself (**inline**) or a **reference**::

    {"episode_id": {...}, "same_as": "<sha256 of the record's exact bytes>"}

standing for a line with those bytes in another records file of the same directory: an earlier
checkpoint's records file, hard-linked into the new checkpoint's directory under its own name before
any line refers to it, so every directory holds all it needs: the directory it came from is never
modified, and deleting (pruning) an earlier checkpoint never breaks a later one. A reference always
stands for an inline line (never another reference): one hop. A record no longer than its
reference would be is always written inline.

``BaseIndex`` is what a participant remembers of its previous committed checkpoint (or of the one it
restored from): the directory, the size of each records file, and for each record's bytes the file
holding them inline and their digest. ``plan`` decides, per commit, which of those files are worth
linking: a file whose records still in use add up to less than half of its size is not linked, and
its records are written inline again, so no checkpoint keeps more than about twice the bytes it
needs. A link that fails (another file system, a pruned or replaced directory) also falls back to
writing inline. A commit asked with ``incremental: false`` references nothing.

Reading (``resolve``): when the records read hold references, the other ``records-<sha256>.jsonl``
files of the directory (opened without following a symlink) are read line by line; the line whose
bytes hash to a reference's digest is its record, which must be inline and carry the same
``episode_id``. Every byte installed is thus checked against a digest.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from nemo_gym_ckpt.checkpoint.fileops import FileOps
from nemo_gym_ckpt.checkpoint.records import Record
from nemo_gym_ckpt.errors import InternalError, InvalidCheckpointState

__all__ = [
    "KEEP_RATIO",
    "REFERENCE_KEY",
    "BaseIndex",
    "IndexBuilder",
    "Inline",
    "Plan",
    "index_inline",
    "is_reference",
    "link_files",
    "plan",
    "reference_line",
    "refuse_reserved",
    "resolve",
]

REFERENCE_KEY = "same_as"
KEEP_RATIO = 0.5
"""A base file is linked only if the records still in use fill at least this share of it."""
RECORDS_FILE = re.compile(r"records-[0-9a-f]{64}\.jsonl")
REFERENCE_BYTES = 160
"""About the length of a reference line: a record no longer than this is always written inline."""
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class Inline:
    """Where the bytes of a record are written inline: a records file and the bytes' digest."""

    records_file: str
    sha256: str


@dataclass
class BaseIndex:
    """A committed (or restored-from) checkpoint of this participant, as the next commit sees it."""

    directory: Path
    lines: dict[bytes, Inline] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)


@dataclass
class Plan:
    """One commit's choice: the base files to link, and for each record a reference or ``None``."""

    links: list[str]
    references: list[Inline | None]


def plan(records: Sequence[Record], base: BaseIndex | None) -> Plan:
    """Which records are referenced (their file kept at least ``KEEP_RATIO`` full) and which files link."""
    if base is None:
        return Plan([], [None] * len(records))
    found = [base.lines.get(record.raw) if len(record.raw) > REFERENCE_BYTES else None for record in records]
    live: dict[str, int] = {}
    for record, where in zip(records, found, strict=True):
        if where is not None:
            live[where.records_file] = live.get(where.records_file, 0) + len(record.raw) + 1
    kept = {name for name, size in live.items() if size >= KEEP_RATIO * base.sizes.get(name, 0)}
    return Plan(sorted(kept), [where if where is not None and where.records_file in kept else None
                               for where in found])


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


def reference_line(record: Record, where: Inline) -> bytes:
    """The line that stands for ``record`` when its bytes are inline in ``where``."""
    return orjson.dumps({"episode_id": record.episode.to_json(), REFERENCE_KEY: where.sha256})


class IndexBuilder:
    """Collects where each record of one commit lives; ``finish`` names the new records file."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._inline: list[tuple[bytes, str]] = []
        self._referenced: list[tuple[bytes, Inline]] = []
        self.sizes: dict[str, int] = {}

    def inline(self, raw: bytes) -> None:
        self._inline.append((raw, hashlib.sha256(raw).hexdigest()))

    def referenced(self, raw: bytes, where: Inline, size: int) -> None:
        self._referenced.append((raw, where))
        self.sizes[where.records_file] = size

    def finish(self, records_file: str, size: int) -> BaseIndex:
        lines = {raw: where for raw, where in self._referenced}
        lines.update((raw, Inline(records_file, digest)) for raw, digest in self._inline)
        return BaseIndex(self.directory, lines, {**self.sizes, records_file: size})


def refuse_reserved(record: Record) -> None:
    """An adapter's record may not look like a reference (a bug, like a token array)."""
    if REFERENCE_KEY in record.data:
        raise InternalError(f"records never carry the key {REFERENCE_KEY!r} (it marks a reference)")


# ---- reading --------------------------------------------------------------------------------------


def is_reference(record: Record) -> bool:
    return REFERENCE_KEY in record.data


def _reference_of(record: Record) -> str:
    data = record.data
    digest = data.get(REFERENCE_KEY)
    if set(data) != {"episode_id", REFERENCE_KEY} or not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
        raise InvalidCheckpointState(f"record of {record.episode.capture_key}: a reference is "
                                     f"{{episode_id, {REFERENCE_KEY}: <sha256 hex>}}")
    return digest


def resolve(
    ops: FileOps, directory: Path, records: Sequence[Record], records_file: str
) -> tuple[list[Record], BaseIndex]:
    """Replace every reference by the record it stands for (checked), in order; and the index of
    what was read (the records of ``records_file``, the manifest's, included)."""
    wanted = {_reference_of(record) for record in records if is_reference(record)}
    found: dict[str, tuple[Record, str]] = {}
    sizes: dict[str, int] = {}
    if wanted:
        for name in _other_records_files(directory, records_file):
            sizes[name] = _scan(ops, directory / name, wanted, found)
    index = BaseIndex(directory, sizes=sizes)
    resolved = []
    for record in records:
        if not is_reference(record):
            resolved.append(record)
            continue
        digest = _reference_of(record)
        target = found.get(digest)
        if target is None:
            raise InvalidCheckpointState(f"record of {record.episode.capture_key}: no records file in {directory} "
                                         "holds a line with the referenced digest")
        line, name = target
        if line.episode != record.episode or is_reference(line):
            raise InvalidCheckpointState(f"record of {record.episode.capture_key}: the referenced line is "
                                         "another episode's or itself a reference")
        index.lines[line.raw] = Inline(name, digest)
        resolved.append(line)
    return resolved, index


def _other_records_files(directory: Path, records_file: str) -> list[str]:
    try:
        names = sorted(path.name for path in directory.iterdir() if RECORDS_FILE.fullmatch(path.name))
    except OSError as error:
        raise InvalidCheckpointState(f"cannot list {directory}: {error.strerror}") from None
    return [name for name in names if name != records_file]


def _scan(ops: FileOps, path: Path, wanted: set[str], found: dict[str, tuple[Record, str]]) -> int:
    size = 0
    try:
        with ops.open_read(path) as file:
            for line in file:
                size += len(line)
                if not line.endswith(b"\n"):
                    break
                body = line[:-1]
                digest = hashlib.sha256(body).hexdigest()
                if digest in wanted and digest not in found:
                    found[digest] = (Record.from_raw(body), path.name)
    except OSError as error:
        raise InvalidCheckpointState(f"cannot read the records file {path.name}: {error.strerror}") from None
    return size


def index_inline(index: BaseIndex, records: Iterable[Record], records_file: str, size: int) -> BaseIndex:
    """Add the inline records read from ``records_file`` (the manifest's) to ``index``."""
    for record in records:
        if record.raw not in index.lines:
            index.lines[record.raw] = Inline(records_file, hashlib.sha256(record.raw).hexdigest())
    index.sizes[records_file] = size
    return index
