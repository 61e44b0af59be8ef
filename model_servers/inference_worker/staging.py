"""The worker's staging store: one durable file per generation-cut request (docs/protocol.md section 8).

A cut of one generation is a ``StagedPrefix``: the token ids and logprobs produced up to a token
boundary, with everything a continuation is checked against (source call, rollout, lineage, prompt
digest, sampling settings, policy version). The prefixes of one cut request (one checkpoint of one
policy model) are written together, as one file, once; never a write per token nor per prefix:

    <staging_dir>/cut-<32 hex>.jsonl     line 1: {"format": "generation-cut-batch/1", "keys": [key, ...]}
                                         line 1 + i: the i-th prefix, as compact JSON (one line)
    key = "<source_call_id>.<sha256 of the prefix's line>"   (the line's bytes, without its newline)

so a key names its content: a line whose bytes changed no longer matches its key (``load`` says
so), whatever the header claims. ``stage`` writes a batch to ``.stg-<random>.tmp`` (exclusive
create), one write, fsync, close, renames it to ``cut-<random>.jsonl`` and fsyncs the directory:
one fsync, one rename and one directory fsync per cut request, however many generations it cuts;
only then may the receipts go out. All file operations go through ``FileOps`` (the seam the
failure tests use). A failure anywhere refuses the whole batch (every prefix ``None``).

Bounds (``max_files`` batch files, ``max_bytes`` of them): a batch first makes room by deleting the
oldest files none of whose keys a commit kept, then the oldest kept ones; a batch never evicts
itself, and its prefixes that cannot fit even then (in order, the rest still tried) are refused.
``keep(server, checkpoint, keys)`` settles one checkpoint's cut: its prefixes not in ``keys`` stop
being served (``load`` says not found), a file of it none of whose keys is kept is deleted, and the
files holding ``keys`` are marked kept (files of earlier checkpoints included). The bytes of an
unkept prefix in a file that also holds a kept one stay until that file goes.

Kept marks survive a process restart: each is an empty ``cut-<hex>.kept`` file next to its batch
(created once, deleted with the batch). They are not fsynced: a mark only orders eviction, so the
settle pays no directory fsync for it; a machine crash may lose the newest marks, which costs
those files their place in the order, nothing else. A fresh process scans the directory: leftover
temporary files and marks without a batch are removed, the batches are indexed by age (their
headers read), marked ones as kept. A batch without a mark may still be needed (a commit that wrote
its records but crashed before it settled its cut), so nothing is deleted at startup: unmarked
files are simply the first to go when room is needed. Which checkpoint a file belongs to is not
kept (a settle after a restart cannot come: the policy model that would send it restarted too),
so after a restart every prefix of a file is served again. A file whose header cannot be read is
indexed (it counts against the bounds and goes first) but serves nothing. A key that is not in the
index makes ``load`` scan the directory for batches written since (then it is not found).

Every method is synchronous and thread-safe (the worker calls them in a thread).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nemo_gym_ckpt.checkpoint.fileops import FileOps
from nemo_gym_ckpt.errors import InvalidCheckpointState

__all__ = [
    "CALL_ID_PATTERN",
    "FORMAT",
    "SCHEMA_VERSION",
    "CutKind",
    "Finish",
    "KeepResult",
    "StagedPrefix",
    "StagedPrefixMissing",
    "StagedSampling",
    "StagingStore",
    "batch_content",
    "token_digest",
]

SCHEMA_VERSION = 1
FORMAT = "generation-cut-batch/1"
CALL_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"
MAX_FILE_BYTES = 256 * 1024 * 1024
MAX_HEADER_BYTES = 32 * 1024 * 1024
_KEY = re.compile(r"^(?P<call>[A-Za-z0-9_-]{1,128})\.(?P<digest>[0-9a-f]{64})$")
_BATCH = re.compile(r"^cut-[0-9a-f]{32}$")
_SUFFIX = ".jsonl"
_KEPT_SUFFIX = ".kept"
_TEMP_PREFIX = ".stg-"
_EMPTY_HEADER_BYTES = len(orjson.dumps({"format": FORMAT, "keys": []})) + 1
CutKind = Literal["active_prefix", "terminal_completion"]
Finish = Literal["stop", "length"]
Owner = tuple[str, str]  # (server_name, checkpoint_id)


def token_digest(ids: Sequence[int]) -> str:
    """SHA-256 of token ids as compact JSON (``[1,2,3]``): the policy model's ``sha256_of`` of ids."""
    return hashlib.sha256(orjson.dumps(list(ids))).hexdigest()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StagedSampling(_Strict):
    """The settings of the original request: a continuation must ask for exactly these."""

    max_tokens: int = Field(ge=1)
    seed: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    skip_special_tokens: bool


class StagedPrefixMissing(InvalidCheckpointState):
    """The key names no prefix staged here (evicted, deleted, or staged on another host): not a mismatch."""


class StagedPrefix(_Strict):
    """One cut: a generation's tokens up to a token boundary and what they must be continued with.

    ``logprobs`` holds ``None`` where the engine gave no finite logprob (JSON has no NaN).
    ``last_step_finish`` is the engine's finish reason of the last token (terminal cuts only), so a
    continuation rebuilds the very same completion (stop strings are found again in the text).
    """

    schema_version: int = SCHEMA_VERSION
    checkpoint_id: str = Field(min_length=1, max_length=128)
    server_name: str = Field(min_length=1, max_length=256)
    ticket_id: str = Field(min_length=1, max_length=256)
    source_call_id: str = Field(pattern=CALL_ID_PATTERN)
    rollout_id: str = Field(min_length=1, max_length=200)
    attempt: int = Field(ge=0)
    parent_call_id: str | None
    previous_length: int = Field(ge=0)
    cut_kind: CutKind
    finish_reason: Finish | None
    last_step_finish: Finish | None
    prompt_digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    prompt_length: int = Field(ge=1)
    sampling: StagedSampling
    policy_version: int = Field(ge=0)
    prefix_token_count: int = Field(ge=1)
    prefix_digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    created_at: float

    def encode(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json"))

    @classmethod
    def decode(cls, content: bytes, key: str) -> StagedPrefix:
        try:
            prefix = cls.model_validate_json(content)
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "file"
            detail = f"staged prefix {key} is malformed ({where}: {first['msg']})"
            raise InvalidCheckpointState(detail) from None
        if prefix.schema_version != SCHEMA_VERSION:
            raise InvalidCheckpointState(f"staged prefix {key}: schema_version {prefix.schema_version}, "
                                         f"expected {SCHEMA_VERSION}")
        return prefix

    @property
    def effective_output_limit(self) -> int:
        """The call's whole output budget (its ``max_tokens``), as upstream's receipts carry it; a
        continuation generates at most this minus the prefix."""
        return self.sampling.max_tokens


def batch_content(keys: Sequence[str], lines: Sequence[bytes]) -> bytes:
    """The bytes of a batch file holding ``lines`` under ``keys`` (header line, then one line each)."""
    header = orjson.dumps({"format": FORMAT, "keys": list(keys)})
    return b"".join([header, b"\n", *(line + b"\n" for line in lines)])


def _key_of(prefix: StagedPrefix, line: bytes) -> str:
    return f"{prefix.source_call_id}.{hashlib.sha256(line).hexdigest()}"


def _header_keys(header: bytes) -> dict[str, int] | None:
    """Key -> line number of a batch header (``None`` if it is not one)."""
    try:
        data: Any = orjson.loads(header)
    except orjson.JSONDecodeError:
        return None
    keys = data.get("keys") if isinstance(data, dict) and data.get("format") == FORMAT else None
    if not isinstance(keys, list) or not all(isinstance(key, str) and _KEY.match(key) for key in keys):
        return None
    return {key: line for line, key in enumerate(keys, start=1)}


@dataclass
class _Batch:
    size: int
    owner: Owner | None
    lines: dict[str, int]  # key -> line number, of the prefixes still served
    kept: bool = False


@dataclass(frozen=True)
class KeepResult:
    kept: list[str]
    deleted: list[str]
    missing: list[str]


@dataclass
class _Plan:
    """A batch's plan: which prefixes go in, its bytes, and the files to evict first."""

    fits: list[bool]
    content: bytes = b""
    evict: list[str] = field(default_factory=list)


class StagingStore:
    """Staged prefixes under ``directory``, bounded by ``max_files`` batch files and ``max_bytes``."""

    def __init__(
        self, directory: Path, *, max_files: int, max_bytes: int, ops: FileOps | None = None
    ) -> None:
        if max_files < 1 or max_bytes < 1:
            raise ValueError("staging bounds must be >= 1")
        self.directory = Path(directory)
        self.max_files = max_files
        self.max_bytes = max_bytes
        self.ops = ops or FileOps()
        self._lock = threading.Lock()
        self._batches: OrderedDict[str, _Batch] = OrderedDict()  # oldest first
        self._where: dict[str, str] = {}  # key -> the batch that serves it
        self._unlinking: set[str] = set()  # batches dropped from the index whose files are not gone yet

    # ---- read-only view ------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        with self._lock:
            batches = list(self._batches.values())
        return {"files": len(batches), "bytes": sum(b.size for b in batches),
                "prefixes": sum(len(b.lines) for b in batches), "kept": sum(1 for b in batches if b.kept)}

    def keys(self) -> list[str]:
        """The keys served, oldest batch first, in their order in the batch."""
        with self._lock:
            return [key for name, batch in self._batches.items() for key in batch.lines
                    if self._where.get(key) == name]

    # ---- startup -------------------------------------------------------------------------------

    def open(self) -> None:
        """Create the directory if needed (durably), remove leftover temporary files and orphan marks,
        index the batches by age (modification time, then name)."""
        self._makedirs()
        marks = set()
        for path in self.directory.iterdir():
            if path.name.startswith(_TEMP_PREFIX):
                with suppress(OSError):
                    self.ops.unlink(path)
            elif path.name.endswith(_KEPT_SUFFIX) and _BATCH.match(path.name[: -len(_KEPT_SUFFIX)]):
                marks.add(path.name[: -len(_KEPT_SUFFIX)])
        with self._lock:
            self._batches.clear()
            self._where.clear()
            self._unlinking.clear()
        names = self._scan_new()
        for orphan in marks - set(names):
            with suppress(OSError):
                self.ops.unlink(self._mark(orphan))
        with self._lock:
            for name in marks & set(names):
                self._batches[name].kept = True

    def _scan_new(self) -> list[str]:
        """Index the batch files not indexed yet (their headers), oldest first; their names."""
        with self._lock:
            known = set(self._batches) | self._unlinking
        found = []
        for path in self.directory.iterdir():
            name = path.name[: -len(_SUFFIX)]
            if path.name.endswith(_SUFFIX) and _BATCH.match(name) and name not in known:
                with suppress(OSError):
                    info = path.lstat()
                    found.append((info.st_mtime_ns, name, info.st_size, self._read_header(path)))
        found.sort(key=lambda item: item[:2])
        with self._lock:
            for _, name, size, lines in found:
                if name in self._batches or name in self._unlinking:
                    continue
                self._batches[name] = _Batch(size, None, lines)
                for key in lines:
                    self._where[key] = name
        return [name for _, name, _, _ in found]

    def _read_header(self, path: Path) -> dict[str, int]:
        try:
            with self.ops.open_read(path) as file:
                header = file.readline(MAX_HEADER_BYTES)
        except OSError:
            return {}
        return _header_keys(header) or {}

    def _makedirs(self) -> None:
        missing = [path for path in (self.directory, *self.directory.parents) if not path.is_dir()]
        for path in reversed(missing):
            with suppress(FileExistsError):
                self.ops.mkdir(path)
            self.ops.fsync_dir(path.parent)

    # ---- write ---------------------------------------------------------------------------------

    def stage(self, prefixes: Sequence[StagedPrefix]) -> list[str | None]:
        """Write one cut request's prefixes durably, as one file; per prefix its key, or ``None`` if it
        was refused (no room, an I/O error)."""
        if not prefixes:
            return []
        owners = {(prefix.server_name, prefix.checkpoint_id) for prefix in prefixes}
        if len(owners) != 1:
            raise ValueError("a batch holds the prefixes of one cut request (one server and checkpoint)")
        lines = [prefix.encode() for prefix in prefixes]
        keys = [_key_of(prefix, line) for prefix, line in zip(prefixes, lines, strict=True)]
        with self._lock:
            plan = self._plan(keys, lines)
            for victim in plan.evict:
                self._drop(victim)
        self._unlink_all(plan.evict)
        if not any(plan.fits):
            return [None] * len(prefixes)
        name = f"cut-{secrets.token_hex(16)}"
        if not self._write(name, plan.content):
            return [None] * len(prefixes)
        staged = {key: line for line, key in enumerate((k for k, fits in zip(keys, plan.fits, strict=True)
                                                         if fits), start=1)}
        with self._lock:
            self._batches[name] = _Batch(len(plan.content), owners.pop(), staged)
            for key in staged:
                self._where[key] = name
        return [key if fits else None for key, fits in zip(keys, plan.fits, strict=True)]

    def _plan(self, keys: list[str], lines: list[bytes]) -> _Plan:
        """Under the lock: the prefixes that fit the bounds (in order), then the files to evict."""
        cap, cost, fits = min(self.max_bytes, MAX_FILE_BYTES), _EMPTY_HEADER_BYTES, []
        for key, line in zip(keys, lines, strict=True):
            extra = len(line) + 1 + len(key) + 3  # the line, its newline, the key quoted in the header
            fits.append(cost + extra <= cap)
            cost += extra if fits[-1] else 0
        if not any(fits):
            return _Plan(fits)
        chosen = [(key, line) for key, line, ok in zip(keys, lines, fits, strict=True) if ok]
        content = batch_content([key for key, _ in chosen], [line for _, line in chosen])
        plan = _Plan(fits, content)
        files, total = len(self._batches), sum(batch.size for batch in self._batches.values())
        order = [n for n, b in self._batches.items() if not b.kept] + [n for n, b in self._batches.items() if b.kept]
        victims = iter(order)
        while files + 1 > self.max_files or total + len(content) > self.max_bytes:
            victim = next(victims, None)
            if victim is None:  # cannot happen: the batch fits max_bytes alone and max_files >= 1
                return _Plan([False] * len(keys), b"", plan.evict)
            plan.evict.append(victim)
            files, total = files - 1, total - self._batches[victim].size
        return plan

    def _write(self, name: str, content: bytes) -> bool:
        """``content`` durably as ``<name>.jsonl``: temporary file, fsync, rename, directory fsync."""
        temp = self.directory / f"{_TEMP_PREFIX}{secrets.token_hex(8)}.tmp"
        final = self._path(name)
        try:
            self.ops.write_durable(final, content, temp, sync_dir=False)
        except OSError:
            return False
        try:
            self.ops.fsync_dir(self.directory)
        except OSError:
            with suppress(OSError):
                self.ops.unlink(final)
            return False
        return True

    # ---- read ----------------------------------------------------------------------------------

    def load(self, key: str) -> StagedPrefix:
        """The prefix staged under ``key``, its line checked against the key's digest."""
        match = _KEY.match(key)
        if match is None:
            raise InvalidCheckpointState(f"staging key {key[:200]!r} is not a staging key")
        where = self._locate(key)
        if where is None and self._scan_new():
            where = self._locate(key)
        if where is None:
            raise StagedPrefixMissing(f"staging key {key} not found (deleted, or never staged here)")
        name, number = where
        try:
            with self.ops.open_read(self._path(name)) as file:
                content = file.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            raise StagedPrefixMissing(f"staging key {key} not found (its file {name} is gone)") from None
        except OSError as error:
            raise InvalidCheckpointState(f"staged prefix {key} cannot be read: {error.strerror}") from None
        lines = content.split(b"\n")
        line = lines[number] if number < len(lines) - 1 else b""  # a line must end with its newline
        if hashlib.sha256(line).hexdigest() != match["digest"]:
            raise InvalidCheckpointState(f"staged prefix {key} does not match its key's digest (changed "
                                         "or truncated on disk)")
        prefix = StagedPrefix.decode(line, key)
        if prefix.source_call_id != match["call"]:
            raise InvalidCheckpointState(f"staged prefix {key} holds call {prefix.source_call_id}")
        return prefix

    def _locate(self, key: str) -> tuple[str, int] | None:
        with self._lock:
            name = self._where.get(key)
            return None if name is None else (name, self._batches[name].lines[key])

    # ---- settle and delete ---------------------------------------------------------------------

    def keep(self, owner: Owner, keys: Iterable[str]) -> KeepResult:
        """Settle ``owner``'s cut: its prefixes not in ``keys`` go (a file of it left with none is
        deleted); the files holding ``keys`` are marked kept."""
        wanted = list(dict.fromkeys(keys))
        chosen = set(wanted)
        with self._lock:
            deleted: list[str] = []
            for name, batch in self._batches.items():
                if batch.owner == owner:
                    deleted.extend(self._unserve(name, [key for key in batch.lines if key not in chosen]))
            doomed = [name for name, batch in self._batches.items() if batch.owner == owner and not batch.lines]
            for name in doomed:
                self._drop(name)
            missing = [key for key in wanted if key not in self._where]
            marking = {self._where[key] for key in wanted if key in self._where}
            marking = {name for name in marking if not self._batches[name].kept}
            for name in marking:
                self._batches[name].kept = True
        self._unlink_all(doomed)
        self._mark_all(sorted(marking))
        return KeepResult([key for key in wanted if key not in missing], deleted, missing)

    def _mark_all(self, names: list[str]) -> None:
        """The kept marks of these batches: one empty file each (not fsynced; see the module docstring)."""
        for name in names:
            with suppress(OSError):  # FileExistsError included: marked already
                self.ops.close(self.ops.open_new(self._mark(name)))

    def discard(self, keys: Iterable[str]) -> list[str]:
        """Stop serving these prefixes (a cut that finished after its checkpoint was settled); a file
        left serving none is deleted."""
        with self._lock:
            gone, emptied = [], set()
            for key in dict.fromkeys(keys):
                name = self._where.get(key)
                if name is not None:
                    gone.extend(self._unserve(name, [key]))
                    emptied.add(name)
            doomed = [name for name in emptied if not self._batches[name].lines]
            for name in doomed:
                self._drop(name)
        self._unlink_all(doomed)
        return gone

    def _unserve(self, name: str, keys: list[str]) -> list[str]:
        """Under the lock: ``keys`` of batch ``name`` are no longer served."""
        batch = self._batches[name]
        for key in keys:
            del batch.lines[key]
            if self._where.get(key) == name:
                del self._where[key]
        return keys

    def _drop(self, name: str) -> None:
        """Under the lock: batch ``name`` leaves the index (its file is unlinked after)."""
        self._unserve(name, list(self._batches[name].lines))
        del self._batches[name]
        self._unlinking.add(name)  # a scan meanwhile must not index it again

    def _unlink_all(self, names: Iterable[str]) -> None:
        """Delete the batches and their kept marks (the batch first: a mark alone is ignored)."""
        for name in names:
            with suppress(OSError):
                self.ops.unlink(self._path(name))
            with suppress(OSError):
                self.ops.unlink(self._mark(name))
            with self._lock:
                self._unlinking.discard(name)

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}{_SUFFIX}"

    def _mark(self, name: str) -> Path:
        return self.directory / f"{name}{_KEPT_SUFFIX}"
