"""The worker's staging store: one durable file per generation cut (PROTOCOL.md section 8).

A cut of one generation is a ``StagedPrefix``: the token ids and logprobs produced up to a token
boundary, with everything a continuation is checked against (source call, rollout, lineage, prompt
digest, sampling settings, policy version). It is written once, as one JSON file, never a write per
token:

    <staging_dir>/<key>.json        key = "<source_call_id>.<sha256 of the file's bytes>"

so a key names its content: a file whose bytes changed no longer matches its key (``load`` says
so). ``stage`` writes a batch (one cut request): each prefix to ``.stg-<random>.tmp`` (exclusive
create), fsync, close (the files of a batch in parallel threads, so their fsyncs share journal
commits); then each is renamed to ``<key>.json``; then one fsync of the directory, after which
every rename of the batch is durable; only then may the receipt go out. All file operations go through
``FileOps`` (the seam the failure tests use).

Bounds (``max_files``, ``max_bytes``): a batch first makes room by deleting the oldest files that
no commit kept, then the oldest kept ones; the files of the batch itself are never evicted, and a
prefix that cannot fit even then is refused. ``keep(server, checkpoint, keys)`` settles one
checkpoint's cut: its files not in ``keys`` are deleted, the keys listed are marked kept (files of
earlier checkpoints included).

Kept marks survive a process restart: each is an empty ``<key>.kept`` file next to its prefix
(created once, deleted with the prefix). They are not fsynced: a mark only orders eviction, so the
settle (which runs inside the commit) pays no directory fsync for it; a machine crash may lose the
newest marks, which costs those prefixes their place in the order, nothing else. A fresh process
scans the directory: leftover temporary files and marks without a prefix are removed, the prefixes
are indexed by age, marked ones as kept. A file without a mark may still be needed (a commit that wrote
its records but crashed before it settled its cut), so nothing is deleted at startup: unmarked
files are simply the first to go when room is needed. Which checkpoint a file belongs to is not
kept (a settle after a restart cannot come: the policy model that would send it restarted too). A
mark that could not be written (an I/O error) only costs its prefix its place in that order.

Every method is synchronous and thread-safe (the worker calls them in a thread).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nemo_gym_ckpt.checkpoint.fileops import FileOps
from nemo_gym_ckpt.errors import InvalidCheckpointState

__all__ = [
    "CALL_ID_PATTERN",
    "SCHEMA_VERSION",
    "CutKind",
    "Finish",
    "KeepResult",
    "StagedPrefix",
    "StagedSampling",
    "StagingStore",
    "token_digest",
]

SCHEMA_VERSION = 1
CALL_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"
MAX_FILE_BYTES = 64 * 1024 * 1024
WRITERS = 16  # threads that write and fsync the files of one batch
_KEY = re.compile(r"^(?P<call>[A-Za-z0-9_-]{1,128})\.(?P<digest>[0-9a-f]{64})$")
_SUFFIX = ".json"
_KEPT_SUFFIX = ".kept"
_TEMP_PREFIX = ".stg-"
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


class StagedPrefix(_Strict):
    """One cut: a generation's tokens up to a token boundary and what they must be continued with.

    ``logprobs`` holds ``None`` where the engine gave no finite logprob (JSON has no NaN).
    ``last_step_finish`` is the engine's finish reason of the last token (terminal cuts only), so a
    continuation rebuilds the very same completion (stop strings are found again in the text).
    """

    schema_version: int = SCHEMA_VERSION
    checkpoint_id: str = Field(min_length=1, max_length=128)
    server_name: str = Field(min_length=1, max_length=200)
    ticket_id: str = Field(min_length=1, max_length=200)
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
        """Tokens a continuation may still generate (none after a terminal completion)."""
        if self.cut_kind == "terminal_completion":
            return 0
        return self.sampling.max_tokens - self.prefix_token_count


@dataclass
class _Entry:
    size: int
    owner: Owner | None
    kept: bool = False


@dataclass(frozen=True)
class KeepResult:
    kept: list[str]
    deleted: list[str]
    missing: list[str]


@dataclass
class _Room:
    """A batch's plan: the files to evict first and, per prefix, whether it fits."""

    evict: list[str] = field(default_factory=list)
    fits: list[bool] = field(default_factory=list)


class StagingStore:
    """Staged prefixes under ``directory``, bounded by ``max_files`` and ``max_bytes``."""

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
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # oldest first

    # ---- read-only view ------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        with self._lock:
            entries = list(self._index.values())
        return {"files": len(entries), "bytes": sum(e.size for e in entries),
                "kept": sum(1 for e in entries if e.kept)}

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index)

    # ---- startup -------------------------------------------------------------------------------

    def open(self) -> None:
        """Create the directory if needed (durably), remove leftover temporary files, index the rest
        by age (modification time, then name)."""
        self._makedirs()
        found, marks = [], set()
        for path in self.directory.iterdir():
            if path.name.startswith(_TEMP_PREFIX):
                with suppress(OSError):
                    self.ops.unlink(path)
            elif path.name.endswith(_SUFFIX) and _KEY.match(path.name[: -len(_SUFFIX)]):
                info = path.lstat()
                found.append((info.st_mtime_ns, path.name[: -len(_SUFFIX)], info.st_size))
            elif path.name.endswith(_KEPT_SUFFIX) and _KEY.match(path.name[: -len(_KEPT_SUFFIX)]):
                marks.add(path.name[: -len(_KEPT_SUFFIX)])
        keys = {key for _, key, _ in found}
        for orphan in marks - keys:
            with suppress(OSError):
                self.ops.unlink(self._mark(orphan))
        with self._lock:
            self._index.clear()
            for _, key, size in sorted(found):
                self._index[key] = _Entry(size, None, kept=key in marks)

    def _makedirs(self) -> None:
        missing = [path for path in (self.directory, *self.directory.parents) if not path.is_dir()]
        for path in reversed(missing):
            with suppress(FileExistsError):
                self.ops.mkdir(path)
            self.ops.fsync_dir(path.parent)

    # ---- write ---------------------------------------------------------------------------------

    def stage(self, prefixes: Sequence[StagedPrefix]) -> list[str | None]:
        """Write a batch durably; per prefix its key, or ``None`` if it was refused (no room, I/O)."""
        contents = [prefix.encode() for prefix in prefixes]
        with self._lock:
            room = self._make_room([len(content) for content in contents])
            for victim in room.evict:
                del self._index[victim]
        self._unlink_all(room.evict)
        jobs = [(prefix, content) for prefix, content, fits in zip(prefixes, contents, room.fits, strict=True)
                if fits]
        done = iter(self._write_all(jobs))
        written = [next(done) if fits else None for fits in room.fits]
        if not self._sync_directory([key for key in written if key is not None]):
            written = [None] * len(written)
        with self._lock:
            for prefix, content, key in zip(prefixes, contents, written, strict=True):
                if key is not None:
                    self._index[key] = _Entry(len(content), (prefix.server_name, prefix.checkpoint_id))
        return written

    def _write_all(self, jobs: list[tuple[StagedPrefix, bytes]]) -> list[str | None]:
        """Each file written and fsynced (in parallel: the fsyncs share journal commits), then renamed."""
        if not jobs:
            return []
        with ThreadPoolExecutor(min(len(jobs), WRITERS), thread_name_prefix="staging") as pool:
            temps = list(pool.map(lambda job: self._write_temp(job[1]), jobs))
        return [self._rename(prefix, content, temp)
                for (prefix, content), temp in zip(jobs, temps, strict=True)]

    def _make_room(self, sizes: list[int]) -> _Room:
        """Under the lock: which old files go (unkept first) and which new prefixes fit."""
        room = _Room()
        files = len(self._index)
        total = sum(entry.size for entry in self._index.values())
        entries = self._index.items()
        order = [k for k, e in entries if not e.kept] + [k for k, e in entries if e.kept]
        victims = iter(order)
        for size in sizes:
            while files + 1 > self.max_files or total + size > self.max_bytes:
                victim = next(victims, None)
                if victim is None:
                    break
                room.evict.append(victim)
                files, total = files - 1, total - self._index[victim].size
            fits = files + 1 <= self.max_files and total + size <= self.max_bytes
            room.fits.append(fits)
            if fits:
                files, total = files + 1, total + size
        return room

    def _write_temp(self, content: bytes) -> Path | None:
        """``content`` in a new temporary file, fsynced and closed (``None`` on any I/O error)."""
        temp = self.directory / f"{_TEMP_PREFIX}{secrets.token_hex(8)}.tmp"
        try:
            fd = self.ops.open_new(temp)
            try:
                self.ops.write(fd, content)
                self.ops.fsync(fd)
            finally:
                self.ops.close(fd)
        except OSError:
            with suppress(OSError):
                self.ops.unlink(temp)
            return None
        return temp

    def _rename(self, prefix: StagedPrefix, content: bytes, temp: Path | None) -> str | None:
        if temp is None:
            return None
        key = f"{prefix.source_call_id}.{hashlib.sha256(content).hexdigest()}"
        try:
            self.ops.rename(temp, self._path(key))
        except OSError:
            with suppress(OSError):
                self.ops.unlink(temp)
            return None
        return key

    def _sync_directory(self, keys: list[str]) -> bool:
        """One fsync of the directory makes every rename of the batch durable."""
        if not keys:
            return True
        try:
            self.ops.fsync_dir(self.directory)
        except OSError:
            for key in keys:
                with suppress(OSError):
                    self.ops.unlink(self._path(key))
            return False
        return True

    # ---- read ----------------------------------------------------------------------------------

    def load(self, key: str) -> StagedPrefix:
        """The prefix staged under ``key``, checked against the key's digest."""
        match = _KEY.match(key)
        if match is None:
            raise InvalidCheckpointState(f"staging key {key[:200]!r} is not a staging key")
        try:
            with self.ops.open_read(self._path(key)) as file:
                content = file.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            detail = f"staging key {key} not found (deleted, or never staged here)"
            raise InvalidCheckpointState(detail) from None
        except OSError as error:
            raise InvalidCheckpointState(f"staged prefix {key} cannot be read: {error.strerror}") from None
        if hashlib.sha256(content).hexdigest() != match["digest"]:
            raise InvalidCheckpointState(f"staged prefix {key} does not match its key's digest (changed "
                                         "or truncated on disk)")
        prefix = StagedPrefix.decode(content, key)
        if prefix.source_call_id != match["call"]:
            raise InvalidCheckpointState(f"staged prefix {key} holds call {prefix.source_call_id}")
        return prefix

    # ---- settle and delete ---------------------------------------------------------------------

    def keep(self, owner: Owner, keys: Iterable[str]) -> KeepResult:
        """Settle ``owner``'s cut: its files not in ``keys`` are deleted, ``keys`` are marked kept."""
        wanted = list(dict.fromkeys(keys))
        with self._lock:
            doomed = [k for k, e in self._index.items() if e.owner == owner and k not in wanted]
            for key in doomed:
                del self._index[key]
            newly = [key for key in wanted if key in self._index and not self._index[key].kept]
            for key in newly:
                self._index[key].kept = True
            missing = [key for key in wanted if key not in self._index]
        self._unlink_all(doomed)
        self._mark_all(newly)
        return KeepResult([k for k in wanted if k not in missing], doomed, missing)

    def _mark_all(self, keys: list[str]) -> None:
        """The kept marks of ``keys``: one empty file each (not fsynced; see the module docstring)."""
        for key in keys:
            with suppress(OSError):  # FileExistsError included: marked already
                self.ops.close(self.ops.open_new(self._mark(key)))

    def discard(self, keys: Iterable[str]) -> list[str]:
        """Delete these staged files (a cut that finished after its checkpoint was settled)."""
        with self._lock:
            gone = [key for key in keys if self._index.pop(key, None) is not None]
        self._unlink_all(gone)
        return gone

    def _unlink_all(self, keys: Iterable[str]) -> None:
        """Delete the prefixes and their kept marks (the prefix first: a mark alone is ignored)."""
        for key in keys:
            with suppress(OSError):
                self.ops.unlink(self._path(key))
            with suppress(OSError):
                self.ops.unlink(self._mark(key))

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}{_SUFFIX}"

    def _mark(self, key: str) -> Path:
        return self.directory / f"{key}{_KEPT_SUFFIX}"

