"""The token sidecar: the token arrays of delivered calls, kept durable beside the ledger records.

docs/protocol.md section 6 keeps token arrays out of records and manifests, and section 8 has the capture
ledger store coordinates and digests while the ids travel to the caller in the reply. A caller that
crashed loses those ids with its memory, and its checkpointed state has them stripped; the policy
model is the one place that still knows them (upstream calls this the token store). So at commit
the policy model writes them out of band, in one file under its own participant directory:

    <checkpoint_dir>/gym/model/<instance>/token-lines-<sha256 of its lines' digests>.jsonl

one line per delivered call whose reply carried token ids (``CallTokens``), compact JSON::

    {"call_id":"mc_...","prompt_token_ids":[...],"generation_token_ids":[...],"generation_log_probs":[...]}

The records refer to a line only by digest: each ledger row has ``token_digest``, the SHA-256 of its
line (``null`` for a call that delivered no token ids). Records and manifests stay token-free. The
file is named by the SHA-256 of its lines' digests (32 bytes each, in order: ``lines_digest_of``),
which the policy model knows without hashing a byte again (a line's digest is computed once, when
it is delivered or read back). A file of the earlier form, ``tokens-<sha256 of the file>.jsonl``, is
still read.

Write (``SidecarStore.open_writer`` gives a ``SidecarWriter``): when the records are sealed, the
sidecar is written first, to ``.tokens-<random>.tmp`` (about 1 MiB of lines at a time, as the
records are, each chunk assembled in one buffer the store keeps between commits, ``ChunkBuffer``:
lines read back from an earlier sidecar are read straight into it, checked against their CRC-32s,
one CRC over each run of lines whose CRCs chain, or against their digests where a CRC is not known
yet). Its fsync waits for the records writer's
(``RecordWriter.sync_with_records``): the sidecar, the records and the manifest's temporary file are
all written, then all fsync'd at once, and once every fsync returned each renamed to its name (the
sidecar first), the directory fsync'd
(which makes the renames durable), and only then the manifest linked (the commit point): a manifest
never names rows whose tokens are not durable. The sidecar costs two files (it and its index) and
their fsyncs per commit. A commit whose ledgers hold no token ids writes no sidecar. Lines of a
restored ledger are written back byte for byte (``CallTokens.line`` is the line as read), as is its
record.

Each sidecar has its index beside it (``line_index``: each line's digest and size), written, made
durable and linked with it.

Read (``SidecarStore.read``): after the records are checked against the manifest, if any record in
scope has a row with a ``token_digest``, each sidecar of the directory is found through its index
when the index checks out against the sidecar's name and size (no line is read then); one without
a usable index is read whole, each line hashed once, and the file checked against its name. Each
needed line is found by its digest and kept in that file (read back from it through a descriptor of
its own, and checked against its digest, when needed: a restore holds no token line in memory,
whatever their number). A sidecar that does not match its name, a missing sidecar or a missing
line is ``invalid_checkpoint_state``, before anything is installed. The records come back as
``TokenedRecord`` (the same bytes, plus the tokens of their rows) for the ledger's install, which
reads each line (checked against its digest) and parses it once and checks it against its row
(``CallTokens.check``: its keys, its call, arrays of non-negative ids and of numbers, the ids'
digests), before anything is installed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from operator import add, attrgetter
from pathlib import Path
from typing import Any, cast

import orjson

from model_servers.policy_model.capture_memory import CaptureMemory, LineFile, line_crc
from model_servers.policy_model.generation import TokenCapture
from model_servers.policy_model.line_index import (
    decode_index,
    index_bytes,
    index_chunks,
    index_name,
    max_index_bytes,
)
from nemo_gym_ckpt.canonical import canonical_json
from nemo_gym_ckpt.capture import TOKEN_ARRAYS
from nemo_gym_ckpt.checkpoint.fileops import FileOps, file_size
from nemo_gym_ckpt.checkpoint.incremental import KEEP_RATIO, link_files
from nemo_gym_ckpt.checkpoint.records import Record, Scope
from nemo_gym_ckpt.checkpoint.store import (
    CHUNK_BYTES,
    CheckpointStore,
    Manifest,
    ReadResult,
    RecordWriter,
    StopSignal,
    read_bounded_lines,
    write_errors,
)
from nemo_gym_ckpt.errors import InvalidCheckpointState

__all__ = [
    "LINES_PREFIX",
    "SIDECAR_NAME",
    "TOKEN_DIGEST",
    "CallTokens",
    "ChunkBuffer",
    "HandOver",
    "SidecarIndex",
    "SidecarStore",
    "SidecarWrite",
    "SidecarWriter",
    "TokenedRecord",
    "lines_digest_of",
    "needed_digests",
    "sidecar_name",
    "write_sidecar",
    "write_sidecars",
]

logger = logging.getLogger(__name__)

SIDECAR_NAME = re.compile(r"(token-lines|tokens)-([0-9a-f]{64})\.jsonl")
"""A sidecar's name: ``token-lines-<sha256 of its lines' digests>.jsonl`` (written now), or
``tokens-<sha256 of the file>.jsonl`` (written before, still read)."""
LINES_PREFIX = "token-lines"
TOKEN_DIGEST = "token_digest"
_LINE_KEYS = ("call_id", *TOKEN_ARRAYS)
_NEWLINE = ord("\n")
_ID_BYTES = b"0123456789,"  # JSON of non-negative integers: no sign, point, exponent, letter or quote
_NUMBER_BYTES = b"0123456789,.-+eE"  # JSON of numbers: no letter (true, false, null) or quote
SidecarLines = Callable[[], Sequence["CallTokens"]]
_SIZE, _DIGEST, _CRC, _CRC_IN = (attrgetter(name) for name in ("size", "digest", "crc", "crc_in"))
"""A line's fields, read for a list of lines by one ``map`` in C (a commit writes thousands)."""


def sidecar_name(lines_digest: str) -> str:
    """The name of a sidecar whose lines' digests hash to ``lines_digest`` (``lines_digest_of``)."""
    return f"{LINES_PREFIX}-{lines_digest}.jsonl"


def lines_digest_of(line_digests: Iterable[str]) -> str:
    """Hex SHA-256 of the lines' SHA-256 digests (32 bytes each), in file order: a sidecar's name.
    Each line's digest is known once it is delivered, read or checked, so naming a sidecar hashes
    none of its bytes again; any change to a line, the order or the number of lines changes it."""
    return hashlib.sha256(bytes.fromhex("".join(line_digests))).hexdigest()


class CallTokens:
    """The token arrays of one delivered call, as the exact sidecar line that holds them.

    The line is in memory, or at an offset of a file (a spill file, or the sidecar of a committed
    checkpoint: ``capture_memory``); ``line`` reads it back (checked against ``digest``) wherever
    it is. The arrays are parsed from the line when asked for.
    """

    __slots__ = ("_at", "_line", "_memory", "call_id", "crc", "crc_in", "digest", "size")

    def __init__(self, call_id: str, line: bytes, digest: str, memory: CaptureMemory | None = None) -> None:
        self.call_id = call_id
        self.digest = digest  # hex SHA-256 of the line (the row's ``token_digest``), computed once
        self.size = len(line)
        self.crc: int | None = None
        """CRC-32 of the line and its newline going on from ``crc_in`` (``capture_memory.line_crc``),
        taken when it left memory or was read back and checked against its digest: what a commit
        copying it from its file checks it against (``ChunkBuffer``). Lines that left memory together
        into one file chain: each one's ``crc_in`` is the ``crc`` of the line before it, and a run of
        them is checked with one CRC over all its bytes."""
        self.crc_in = 0
        self._line: bytes | None = line  # compact JSON, no newline
        self._memory = memory  # set while the line counts against the memory bound, or among the spilled
        self._at: tuple[LineFile, int] | None = None  # the file and offset it is read from once out of memory
        # (one attribute: a reader never sees one file with another's offset while a commit moves it)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CallTokens) and (self.call_id, self.digest) == (other.call_id, other.digest)

    def __hash__(self) -> int:
        return hash(self.digest)

    @property
    def line(self) -> bytes:
        line = self._line
        if line is not None:
            return line
        at = self._at
        assert at is not None
        line = at[0].read(at[1], self.size, self.digest)
        if self.crc is None:  # checked against its digest just now
            self.crc_in, self.crc = 0, line_crc(line)
        return line

    @property
    def in_memory(self) -> bool:
        return self._line is not None

    @property
    def durable(self) -> bool:
        """Read from a durable file (a committed or restored-from sidecar): not in memory, not spilled."""
        at = self._at
        return self._line is None and at is not None and at[0].durable

    @classmethod
    def kept_in(cls, call_id: str, digest: str, size: int, file: LineFile, offset: int) -> CallTokens:
        """A line known by its digest and size only, at ``offset`` in ``file``: read (and checked
        against ``digest``) when asked for, never before."""
        tokens = cls(call_id, b"", digest)
        tokens.size, tokens._line, tokens._at = size, None, (file, offset)  # its CRC unknown yet
        return tokens

    def kept_at(self, file: LineFile, offset: int, crc_in: int = 0) -> None:
        """The line is at ``offset`` in ``file`` (durable, or spilled) and is read from there from now
        on. A line in memory leaves it, its CRC taken from the bytes it had, going on from ``crc_in``
        (the ``crc`` of the line right before it in ``file``, to chain with it); a line already read
        from a file (a spill file, or an earlier sidecar it was copied from) keeps its CRCs, which are
        of its bytes wherever they are, and lets go of that file."""
        if self._line is not None:  # the CRC before the line goes: whoever sees it gone sees the CRC
            self.crc_in, self.crc = crc_in, line_crc(self._line, crc_in)
        self._at = (file, offset)
        if self._memory is not None:
            self.forget()
        self._line = None

    def forget(self) -> None:
        """Stop counting this line against the memory bound, or among the spilled lines (it left
        memory or its spill file, or its ledger is gone)."""
        memory, self._memory = self._memory, None
        if memory is not None:
            if self._line is not None:
                memory.release(self.size)
            else:
                memory.unspilled()

    def _arrays(self) -> dict[str, Any]:
        data: dict[str, Any] = orjson.loads(self.line)
        return data

    @property
    def prompt_token_ids(self) -> list[int]:
        ids: list[int] = self._arrays()["prompt_token_ids"]
        return ids

    @property
    def generation_token_ids(self) -> list[int]:
        ids: list[int] = self._arrays()["generation_token_ids"]
        return ids

    @property
    def prefix(self) -> list[int]:
        """The ids of the conversation up to the end of this call: prompt then generation."""
        data = self._arrays()
        return [*data["prompt_token_ids"], *data["generation_token_ids"]]

    @classmethod
    def of(cls, call_id: str, capture: TokenCapture, memory: CaptureMemory | None = None) -> CallTokens:
        """The line of a call being delivered; past ``memory``'s bound it goes to a spill file."""
        line = orjson.dumps({"call_id": call_id, "prompt_token_ids": list(capture.prompt_token_ids),
                             "generation_token_ids": list(capture.generation_token_ids),
                             "generation_log_probs": list(capture.generation_log_probs)})
        tokens = cls(call_id, line, hashlib.sha256(line).hexdigest())
        if memory is not None:
            if memory.take(tokens.size):
                tokens._memory = memory
            else:
                tokens.kept_at(*memory.spill(line))
                tokens._memory = memory  # counted among the spilled lines until a commit or a forget
        return tokens

    def check(self, call_id: str, prompt_digest: str, output_digest: str, where: str) -> None:
        """The line is a well-formed sidecar line of the row's call whose ids hash to the row's digests;
        anything else is ``InvalidCheckpointState``. One parse: the ids' canonical bytes, which the
        digests are of, are also what is checked to hold only non-negative integers (and the
        log-probs' bytes only numbers), in C rather than one Python step per id."""
        data = self._checked_data(where)
        if data["call_id"] != call_id:
            raise InvalidCheckpointState(f"{where}: the sidecar line is for {data['call_id']}, expected {call_id}")
        try:
            prompt, generation, log_probs = (canonical_json(data[key]) for key in _LINE_KEYS[1:])
        except orjson.JSONEncodeError:  # an integer past 64 bits
            raise InvalidCheckpointState(f"{where}: the token arrays of {call_id} are malformed") from None
        if not (_only(prompt, _ID_BYTES) and _only(generation, _ID_BYTES) and _only(log_probs, _NUMBER_BYTES)
                and len(data["generation_log_probs"]) == len(data["generation_token_ids"])):
            raise InvalidCheckpointState(f"{where}: the token arrays of {call_id} are malformed")
        sha256 = hashlib.sha256
        if sha256(prompt).hexdigest() != prompt_digest or sha256(generation).hexdigest() != output_digest:
            raise InvalidCheckpointState(f"{where}: the sidecar's token ids of {call_id} do not match the "
                                         "ledger row's prompt or output digest")

    def _checked_data(self, where: str) -> dict[str, Any]:
        try:
            data = orjson.loads(self.line)
        except orjson.JSONDecodeError:
            raise InvalidCheckpointState(f"{where}: a sidecar line is not valid JSON") from None
        if not isinstance(data, dict) or tuple(data) != _LINE_KEYS or not isinstance(data["call_id"], str):
            raise InvalidCheckpointState(f"{where}: a sidecar line must be {{{', '.join(_LINE_KEYS)}}}")
        return data

    def to_fields(self) -> dict[str, Any]:
        """The token fields of an output item (``policy_version`` is the row's)."""
        data = self._arrays()
        return {key: data[key] for key in TOKEN_ARRAYS}


def _only(array: bytes, allowed: bytes) -> bool:
    """``array`` (canonical JSON) is a flat array whose elements are made of ``allowed`` bytes only."""
    return array.translate(None, allowed) == b"[]"


@dataclass(frozen=True, slots=True)
class TokenedRecord(Record):
    """A ledger record read back, with the tokens of its rows by call id (memory only: ``raw`` and
    ``data`` are the record's own, token-free bytes, exported again unchanged)."""

    tokens: Mapping[str, CallTokens]


def needed_digests(record: Record) -> dict[str, str]:
    """``token_digest`` -> call id of the rows of a ledger record that delivered token ids."""
    rows = record.data.get("ledger")
    found: dict[str, str] = {}
    for row in rows if isinstance(rows, list) else ():
        digest = row.get(TOKEN_DIGEST) if isinstance(row, dict) else None
        if isinstance(digest, str):
            found[digest] = str(row.get("call_id"))
    return found


@dataclass
class SidecarIndex:
    """The token lines of this participant's previous committed (or restored-from) checkpoint: for
    each line digest, the sidecar file and offset holding it; each file's size; and the size of each
    file's index (``line_index``) where it has one."""

    directory: Path
    where: dict[str, tuple[str, int]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    indexes: dict[str, int] = field(default_factory=dict)


class ChunkBuffer:
    """The buffer a sidecar's lines are assembled in, about ``chunk_bytes`` at a time, kept from one
    commit to the next. Each line is copied into it once: a line in memory as it is, a run of lines
    kept next to each other in one file read straight into it (``LineFile.read_run_into``: one read,
    each line checked against its CRC-32 when all of the run's are known, else against its digest);
    the chunk is written from it. No list of views per chunk
    and no join: each byte is copied once, into pages that stay mapped from one commit to the next.
    It grows to the largest chunk (``chunk_bytes`` and one line at most); a second write while one
    holds it gets a buffer of its own."""

    def __init__(self) -> None:
        self._data = bytearray()
        self._lock = threading.Lock()

    def chunks(self, tokens: Sequence[CallTokens], chunk_bytes: int = CHUNK_BYTES) -> Iterator[memoryview]:
        """The lines of ``tokens`` in order, a newline after each, in views of this buffer of about
        ``chunk_bytes`` each; a view holds its chunk until the next one is asked for."""
        if not self._lock.acquire(blocking=False):
            yield from ChunkBuffer().chunks(tokens, chunk_bytes)
            return
        try:
            for group, size in _groups(tokens, chunk_bytes):
                if len(self._data) < size:
                    self._data = bytearray(size)
                yield self._fill(group)
        finally:
            self._lock.release()

    def _fill(self, group: Sequence[CallTokens]) -> memoryview:
        view, at = memoryview(self._data), 0
        for segment in _segments(group):
            if isinstance(segment, bytes):
                end = at + len(segment)
                view[at:end] = segment
            else:
                where = segment[0]._at
                assert where is not None
                sizes, crcs = list(map(_SIZE, segment)), list(map(_CRC, segment))
                chains = None if None in crcs else (list(map(_CRC_IN, segment)), cast("list[int]", crcs))
                end = at + sum(sizes) + len(sizes) - 1
                taken = where[0].read_run_into(view[at:end], where[1], sizes, list(map(_DIGEST, segment)), chains)
                if taken is not None:  # checked line by line: they chain from now on
                    for tokens, crc_in, crc in zip(segment, [0, *taken[:-1]], taken, strict=True):
                        tokens.crc_in, tokens.crc = crc_in, crc
            view[end] = _NEWLINE
            at = end + 1
        return view[:at]


def _groups(tokens: Sequence[CallTokens], chunk_bytes: int) -> Iterator[tuple[Sequence[CallTokens], int]]:
    """The lines in order, in groups of at least ``chunk_bytes`` (newlines counted; the last smaller),
    each group ending at the first line that brings it there; one group held at a time (a list of
    every line's end, built in C, cost more memory than it saved time)."""
    group: list[CallTokens] = []
    size = 0
    for line in tokens:
        group.append(line)
        size += line.size + 1
        if size >= chunk_bytes:
            yield group, size
            group, size = [], 0
    if group:
        yield group, size


def _segments(group: Sequence[CallTokens]) -> Iterator[bytes | list[CallTokens]]:
    """Each line in memory, and each run of lines kept next to each other in one file, in order."""
    run: list[CallTokens] = []
    run_file, run_end = None, -1  # the run's file, and the offset right after its last line and newline
    for tokens in group:
        line = tokens._line
        if line is not None:
            if run:
                yield run
                run, run_file = [], None
            yield line
            continue
        file, offset = cast("tuple[LineFile, int]", tokens._at)  # out of memory: in a file
        if file is run_file and offset == run_end:
            run.append(tokens)
            run_end += tokens.size + 1
        else:
            if run:
                yield run
            run, run_file, run_end = [tokens], file, offset + tokens.size + 1
    if run:
        yield run


HandOver = Callable[[int, Path, Path], None]
"""Takes a written, unsynced file (its open descriptor, temporary path, name) to fsync and rename
with the records (``RecordWriter.sync_with_records``)."""


def write_sidecar(
    ops: FileOps, directory: Path, tokens: Sequence[CallTokens], stop: StopSignal, chunk_bytes: int = CHUNK_BYTES,
    buffer: ChunkBuffer | None = None, hand_over: HandOver | None = None,
) -> str:
    """Write the lines of ``tokens`` durably as ``token-lines-<sha256 of their digests>.jsonl``: a
    temporary file written a chunk at a time (assembled in ``buffer``, or a buffer of its own: a line
    read back from a file is checked on the way, as ``ChunkBuffer`` says), fsynced and renamed to its name,
    with its index beside it (``line_index``); that name. With ``hand_over`` (a records writer's
    ``sync_with_records``), the written file's open descriptor, temporary path and name go there
    instead (the index's too), and its owner fsyncs and renames them with the records. No byte is
    hashed for the name: each line's digest is already known. The temporary files never outlive a
    failure."""
    temp = directory / f".tokens-{secrets.token_hex(8)}.tmp"
    name = sidecar_name(lines_digest_of(map(_DIGEST, tokens)))
    index_temp = directory / f".tokens-index-{secrets.token_hex(8)}.tmp"
    with write_errors(directory, "token sidecar write"):
        stop.check()
        chunks = _stoppable((buffer or ChunkBuffer()).chunks(tokens, chunk_bytes), stop)
        if hand_over is not None:
            hand_over(ops.write_new_unsynced(temp, chunks), temp, directory / name)
            hand_over(ops.write_new_unsynced(index_temp, index_chunks(tokens)), index_temp,
                      directory / index_name(name))
            return name
        ops.write_new_chunks(temp, chunks)
        try:  # the index placed before the sidecar is renamed: the sidecar's name comes last
            ops.write_new_chunks(index_temp, index_chunks(tokens))
            ops.rename(index_temp, directory / index_name(name))
            ops.rename(temp, directory / name)
        except BaseException:
            for left in (temp, index_temp):
                with suppress(OSError):
                    ops.unlink(left)
            raise
    # No directory fsync of its own: the records' seal fsyncs this directory after their rename and
    # before the manifest is linked, which makes this rename durable first (one fsync less per commit).
    return name


def _stoppable(chunks: Iterable[memoryview], stop: StopSignal) -> Iterator[memoryview]:
    """The chunks, the stop signal checked before each."""
    for chunk in chunks:
        stop.check()
        yield chunk


@dataclass
class SidecarWrite:
    """What one commit did with its token lines: files linked from the base, the new file, bytes."""

    linked: list[str]
    written: str | None
    bytes_written: int  # the new sidecar and its index
    index: SidecarIndex
    placed: list[tuple[CallTokens, str, int]]
    """Each line to be read from this directory once the commit is durable, its file and offset: every
    line written to the new file (from memory, a spill file, or an earlier sidecar it was copied
    from), and the lines of a linked file that were not yet durable (a line already read from a
    linked file reads the same inode, and stays)."""


def write_sidecars(
    ops: FileOps, directory: Path, tokens: Sequence[CallTokens], base: SidecarIndex | None, stop: StopSignal,
    buffer: ChunkBuffer | None = None, hand_over: HandOver | None = None,
) -> SidecarWrite:
    """Make every line of ``tokens`` durable in ``directory``: base files still at least a quarter in use
    are hard-linked (docs/protocol.md section 6.1), the other lines go to one new sidecar file
    (assembled in ``buffer``; fsynced by ``hand_over``'s owner when given, as ``write_sidecar``)."""
    linked: set[str] = set()
    if base is not None:
        live: dict[str, int] = {}
        for line in tokens:
            found = base.where.get(line.digest)
            if found is not None:
                live[found[0]] = live.get(found[0], 0) + line.size + 1
        keep = [name for name, size in live.items() if size >= KEEP_RATIO * base.sizes.get(name, 0)]
        with write_errors(directory, "token sidecar link"):
            stop.check()
            linked = link_files(ops, base.directory, base.sizes, keep, directory)
            indexes = {index_name(name): base.indexes[name] for name in linked if name in base.indexes}
            linked_indexes = link_files(ops, base.directory, indexes, indexes, directory)
    index = SidecarIndex(directory)
    if base is not None:
        index.sizes = {name: base.sizes[name] for name in linked}
        index.indexes = {name: base.indexes[name] for name in linked if index_name(name) in linked_indexes}
    placed: list[tuple[CallTokens, str, int]] = []
    fresh: Sequence[CallTokens] = tokens
    if linked:
        assert base is not None
        fresh = []
        for line in tokens:
            found = base.where.get(line.digest)
            if found is not None and found[0] in linked:
                index.where[line.digest] = found
                if not line.durable:
                    placed.append((line, *found))
            else:
                fresh.append(line)
    written, size, index_size = None, 0, 0
    if fresh:
        written = write_sidecar(ops, directory, fresh, stop, buffer=buffer, hand_over=hand_over)
        offsets = list(accumulate(map(add, map(_SIZE, fresh), repeat(1)), initial=0))
        size = offsets.pop()
        index.where.update(zip(map(_DIGEST, fresh), zip(repeat(written), offsets), strict=True))
        placed.extend(zip(fresh, repeat(written), offsets))
        index.sizes[written] = size
        index.indexes[written] = index_size = index_bytes(len(fresh))
    return SidecarWrite(sorted(linked), written, size + index_size, index, placed)


class SidecarWriter(RecordWriter):
    """A records writer that makes the token sidecar durable before it seals the records; once the
    manifest is linked, the lines it holds leave memory (``capture_memory``)."""

    def __init__(self, ops: FileOps, directory: Path, stop: StopSignal, lines: SidecarLines,
                 store: SidecarStore) -> None:
        super().__init__(ops, directory, stop)
        self._sidecar_ops, self._sidecar_stop, self._lines = ops, stop, lines
        self._store = store
        self.sidecar: str | None = None
        self.sidecar_bytes = 0
        self.sidecar_linked: list[str] = []

    @property
    def bytes_written(self) -> int:
        """The records, the new sidecar file and its index (a linked file is not written again)."""
        return self.bytes + self.sidecar_bytes

    def finish(self, kind: str, instance: str, checkpoint_id: str) -> Manifest:
        tokens = self._lines()
        done = None
        if tokens:
            base = self._store.sidecar_base if self.base is not None else None
            done = write_sidecars(self._sidecar_ops, self.directory, tokens, base, self._sidecar_stop,
                                  self._store.chunk_buffer, hand_over=self.sync_with_records)
            self.sidecar, self.sidecar_bytes, self.sidecar_linked = done.written, done.bytes_written, done.linked
        manifest = super().finish(kind, instance, checkpoint_id)
        if done is not None:
            self._store.sidecar_committed(done)
        return manifest


class SidecarStore(CheckpointStore):
    """The policy model's checkpoint store: the protocol's records and manifest, plus the sidecar.

    ``lines`` answers the sidecar lines of the commit being written (the adapter's export sets them).
    """

    def __init__(self, base: CheckpointStore, lines: SidecarLines) -> None:
        super().__init__(base.root, base.ops, max_record_bytes=base.max_record_bytes)
        self._lines = lines
        self.sidecar_base: SidecarIndex | None = None
        self.chunk_buffer = ChunkBuffer()

    def new_writer(self, directory: Path, stop: StopSignal) -> RecordWriter:
        """The base store's writer, with the sidecar made durable before the records are sealed."""
        return SidecarWriter(self.ops, directory, stop, self._lines, self)

    def sidecar_committed(self, done: SidecarWrite) -> None:
        """The lines are durable: the next commit links them, and they are read from this directory
        from now on (``SidecarWrite.placed``): they leave memory, and a spill file or an earlier
        sidecar no line reads from any more is closed (its last user gone)."""
        self.sidecar_base = done.index
        files: dict[str, LineFile] = {}
        before_name, before_end, before_crc = "", -1, 0  # the line placed before: file, offset after it, CRC
        for line, name, offset in done.placed:
            file = files.get(name)
            if file is None:
                try:
                    file = files[name] = LineFile.open(done.index.directory / name)
                except OSError:
                    continue  # stays where it is (memory, a spill or earlier file); a later commit tries again
            line.kept_at(file, offset, before_crc if offset == before_end and name == before_name else 0)  # chained
            before_name, before_end, before_crc = name, offset + line.size + 1, line.crc or 0  # a copy's: its bytes

    def read(self, checkpoint_dir: Path, kind: str, instance: str, scope: Scope) -> ReadResult:
        result = super().read(checkpoint_dir, kind, instance, scope)
        wanted: dict[str, str] = {}
        for record in result.records:
            wanted.update(needed_digests(record))
        if not wanted:
            return result
        directory = self.instance_dir(checkpoint_dir, kind, instance)
        found, size = self._read_sidecars(directory, wanted)
        missing = sorted(call for digest, call in wanted.items() if digest not in found)
        if missing:
            raise InvalidCheckpointState(f"the token sidecar in {directory} lacks the token arrays of "
                                         f"{len(missing)} delivered calls ({', '.join(missing[:5])})")
        records: list[Record] = []
        for record in result.records:
            tokens = {found[digest].call_id: found[digest] for digest in needed_digests(record)}
            records.append(TokenedRecord(record.raw, record.data, record.episode, tokens) if tokens else record)
        return ReadResult(result.manifest, records, result.bytes_read + size)

    def _read_sidecars(self, directory: Path, wanted: Mapping[str, str]) -> tuple[dict[str, CallTokens], int]:
        try:
            names = sorted(path.name for path in directory.iterdir() if SIDECAR_NAME.fullmatch(path.name))
        except OSError as error:
            raise InvalidCheckpointState(f"cannot list {directory}: {error.strerror}") from None
        if not names:
            raise InvalidCheckpointState(f"the ledger records name token arrays but {directory} has no token "
                                         "sidecar (tokens-<sha256>.jsonl)")
        found: dict[str, CallTokens] = {}
        index = SidecarIndex(directory)
        size = 0
        for name in names:
            index.sizes[name] = self._read_sidecar(directory / name, wanted, found, index)
            size += index.sizes[name]
        self.sidecar_base = index
        return found, size

    def _read_sidecar(
        self, path: Path, wanted: Mapping[str, str], found: dict[str, CallTokens], index: SidecarIndex
    ) -> int:
        """Each wanted line of one sidecar, checked and kept in that file (read back from it when
        needed, through a descriptor of its own: the lines of a restore stay out of memory, as those
        of a commit do once durable); the file's size. The file must match its name: the digest of its
        lines' digests (every line newline-terminated), or of the whole file (the earlier form)."""
        match = SIDECAR_NAME.fullmatch(path.name)
        assert match is not None  # listed by this pattern
        by_lines = match.group(1) == LINES_PREFIX
        if by_lines:
            indexed = self._read_indexed(path, match.group(2), wanted, found, index)
            if indexed is not None:
                return indexed
        named, whole, kept, size = hashlib.sha256(), hashlib.sha256(), [], 0
        crc: int | None = None
        try:
            with self.ops.open_read(path) as file:
                lines_file = LineFile(os.dup(file.fileno()), path.name)
                for line in read_bounded_lines(file, None, self.max_record_bytes, path.name):
                    body = line[:-1] if line.endswith(b"\n") else line
                    raw = hashlib.sha256(body).digest()
                    if by_lines:
                        if body is line:
                            raise InvalidCheckpointState(f"the token sidecar {path.name} ends without a newline")
                        named.update(raw)
                    else:
                        whole.update(line)
                    digest = raw.hex()
                    crc_in = crc if crc is not None else 0  # the line before was kept: chain on from it
                    crc = None
                    if digest in wanted:  # checked against its row (and parsed) at the install
                        tokens = CallTokens(wanted[digest], body, digest)
                        tokens.kept_at(lines_file, size, crc_in)
                        kept.append(tokens)
                        index.where[digest] = (path.name, size)
                        crc = tokens.crc
                    size += len(line)
        except OSError as error:
            raise InvalidCheckpointState(f"cannot read the token sidecar {path.name}: {error.strerror}") from None
        if (named if by_lines else whole).hexdigest() != match.group(2):
            raise InvalidCheckpointState(f"the token sidecar {path.name} does not match its digest (corrupt)")
        found.update((tokens.digest, tokens) for tokens in kept)
        return size

    def _read_indexed(
        self, path: Path, lines_digest: str, wanted: Mapping[str, str], found: dict[str, CallTokens],
        index: SidecarIndex,
    ) -> int | None:
        """The wanted lines of one sidecar found through its index (``line_index``), none of them read
        here: each is read, and checked against its digest, when needed (the install reads and checks
        every line it installs); the sidecar's size. ``None`` when the sidecar has no index this
        reader can use: it is then read and hashed whole."""
        try:  # the index first: a sidecar without one is opened once, by the whole read
            with self.ops.open_read(path.with_name(index_name(path.name))) as handle, \
                    self.ops.open_read(path) as file:
                size, length = file_size(file), file_size(handle)
                data = handle.read(length) if length <= max_index_bytes(size) else b""  # never past the bound
                lines_file = LineFile(os.dup(file.fileno()), path.name)
        except OSError:
            return None  # no index (an earlier commit's sidecar), or unreadable: the whole read says why
        lines = decode_index(data, lines_digest, size, wanted)
        if lines is None or any(line.size > self.max_record_bytes for line in lines):
            logger.warning("the index of the token sidecar %s is damaged; the sidecar is read whole", path.name)
            return None
        for line in lines:
            call_id = wanted[line.digest]
            found[line.digest] = CallTokens.kept_in(call_id, line.digest, line.size, lines_file, line.offset)
            index.where[line.digest] = (path.name, line.offset)
        index.indexes[path.name] = len(data)
        return size
