"""The checkpoint directory of a rollout collection: what the collector publishes and a rerun reads.

Layout of ``nemo-gym-ckpt collect --checkpoint-dir DIR`` (the ``gym/`` part is docs/protocol.md
section 6, written by the participants)::

    DIR/
      dispatched.jsonl                       every /run the collector sent: {rollout_id, attempt}
      LATEST                                 the id of the newest published checkpoint, one line
      ckpt-<utc timestamp>-<8 hex>/          one checkpoint
        gym/<kind>/<instance>/manifest.json  (and records-<sha256>.jsonl): each participant's
        collection.json                      the collector's aggregate, written last

Publishing (``publish``), after every participant's commit answered its manifest: write
``collection.json`` into the checkpoint's directory, then replace ``LATEST``; both atomically (a
temporary file, fsync, rename, fsync of the directory). Then ``prune`` keeps the 2 newest published
checkpoints and deletes older checkpoint directories (published or abandoned): the new one is
always published before anything is deleted, and neither it nor the one ``LATEST`` names is ever
deleted (ids come from the wall clock, which may step back).

Reading (``find_latest``): the checkpoint ``LATEST`` names if it is published; otherwise the newest
published one. A ``LATEST`` that is not one line naming a checkpoint id, or is not a regular file,
is ``CheckpointRefused`` (a damaged pointer is not guessed around). A directory is published when
its ``collection.json`` exists and every participant manifest it lists exists; others (an
interrupted commit, a crash before ``collection.json``) are ignored. The collector's own files are
read as the participants read theirs: regular files only, opened without blocking and without
following a symlink, with a size bound (a FIFO or a device there is refused, never waited on).
Nothing here ever writes into a published checkpoint's directory.

``RunIdentity`` ties a checkpoint to its collection: a digest of the resolved config (ports, tokens
and the ``checkpoint`` block left out) and one of the task rows; ``check_same_run`` refuses a
checkpoint taken with another config or input, saying which differs.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import secrets
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from nemo_gym_ckpt.canonical import canonical_json
from nemo_gym_ckpt.checkpoint.fileops import FileOps, file_size
from nemo_gym_ckpt.collect.rows import read_jsonl
from nemo_gym_ckpt.errors import CheckpointRefused

__all__ = [
    "COLLECTION_FILE",
    "DISPATCH_LOG",
    "KEEP",
    "LATEST_FILE",
    "SCHEMA_VERSION",
    "CheckpointRefused",
    "CollectionManifest",
    "RunIdentity",
    "check_same_run",
    "config_digest",
    "find_latest",
    "input_digest",
    "is_checkpoint_id",
    "load_published",
    "new_checkpoint_id",
    "older_published",
    "prune",
    "publish",
    "read_dispatched",
    "write_atomic",
]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
COLLECTION_FILE = "collection.json"
LATEST_FILE = "LATEST"
DISPATCH_LOG = "dispatched.jsonl"
KEEP = 2
MAX_LATEST_BYTES = 4096
MAX_COLLECTION_BYTES = 64 * 1024 * 1024
"""``collection.json`` lists a capture key per rollout in flight: 64 MiB holds millions."""
_ID = re.compile(r"ckpt-\d{8}T\d{12}Z-[0-9a-f]{8}")
_UNPORTABLE_KEYS = frozenset({"port", "control_auth_token", "api_key"})
_RUN_KEYS = ("head_server", "checkpoint", "config_paths", "port_range_low", "port_range_high", "disallowed_ports")
"""Top-level keys that do not make two runs different (where the files were and which ports served)."""


# ---- ids -----------------------------------------------------------------------------------------


def new_checkpoint_id(now: datetime | None = None) -> str:
    """``ckpt-<UTC, to the microsecond>-<8 hex>``: ids sort in the order they were made."""
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%S%fZ")
    return f"ckpt-{stamp}-{secrets.token_hex(4)}"


def is_checkpoint_id(name: str) -> bool:
    return _ID.fullmatch(name) is not None


# ---- the identity of a collection ----------------------------------------------------------------


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _portable(node: Any) -> Any:
    """``node`` without ports and tokens (they change from one launch to the next)."""
    if isinstance(node, Mapping):
        return {str(k): _portable(v) for k, v in node.items() if str(k) not in _UNPORTABLE_KEYS}
    if isinstance(node, list):
        return [_portable(item) for item in node]
    return node


def config_digest(raw: Mapping[str, Any]) -> str:
    """SHA-256 of the resolved config, without the head server, the checkpoint block, ports and tokens."""
    servers = {key: value for key, value in raw.items() if key not in _RUN_KEYS}
    return _sha256(canonical_json(_portable(servers)))


def input_digest(tasks: Sequence[Mapping[str, Any]]) -> str:
    """SHA-256 over the canonical JSON of every task row, in order."""
    digest = hashlib.sha256()
    for task in tasks:
        digest.update(canonical_json(task) + b"\n")
    return digest.hexdigest()


@dataclass(frozen=True)
class RunIdentity:
    """What makes two runs the same collection: config, task rows and repeats."""

    config_digest: str
    input_digest: str
    num_repeats: int

    @property
    def run_id(self) -> str:
        joined = f"{self.config_digest}:{self.input_digest}:{self.num_repeats}".encode()
        return f"run-{_sha256(joined)[:16]}"


# ---- collection.json -----------------------------------------------------------------------------


class CollectionManifest(BaseModel):
    """``collection.json``: the collector's record of one published checkpoint.

    ``continued`` and ``restarted`` are capture keys of the rollouts in flight at the checkpoint:
    the ones the participants exported (a restore continues them as the next attempt) and the ones
    that start over. ``manifests`` maps each participant (server name) to its manifest, relative to
    the checkpoint's directory; ``stats`` holds measurements (``pause_ms``, ``bytes``, ...).

    Read through this typed model, strictly: a missing or unknown field, a value of the wrong type
    anywhere (a string for a number, a number for a list), a negative count or a manifest path
    leading out of the checkpoint is ``CheckpointRefused``, one line naming the file and the field.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    checkpoint_id: str
    run_id: str
    created_at: str
    continued: list[str]
    restarted: list[str]
    rows_done: int = Field(ge=0)
    config_digest: str
    input_digest: str
    num_repeats: int = Field(ge=1)
    manifests: dict[str, str]
    staging_keys: dict[str, list[str]] = Field(default_factory=dict)
    stats: dict[str, Any] = Field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    @field_validator("manifests")
    @classmethod
    def _inside_the_checkpoint(cls, manifests: dict[str, str]) -> dict[str, str]:
        for name, path in manifests.items():
            parts = Path(path).parts
            if not parts or Path(path).is_absolute() or ".." in parts:
                raise ValueError(f"the manifest path of {name} must stay inside the checkpoint, got {path!r}")
        return manifests

    def to_json(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json"), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"

    @classmethod
    def from_json(cls, data: bytes, where: Path) -> CollectionManifest:
        try:
            fields = orjson.loads(data)
        except orjson.JSONDecodeError as error:
            raise CheckpointRefused(f"{where} is not a collection manifest: not JSON ({error})") from None
        if not isinstance(fields, dict):
            raise CheckpointRefused(f"{where} is not a collection manifest: not a JSON object")
        if fields.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
            raise CheckpointRefused(f"{where}: schema_version {fields['schema_version']!r}, expected {SCHEMA_VERSION}")
        try:
            return cls.model_validate(fields)
        except ValidationError as error:
            first = error.errors()[0]
            field_name = ".".join(str(part) for part in first["loc"]) or "the document"
            more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
            detail = f"{field_name}: {first['msg']}{more}"
            raise CheckpointRefused(f"{where} is not a collection manifest: {detail}") from None

    @property
    def identity(self) -> RunIdentity:
        return RunIdentity(self.config_digest, self.input_digest, self.num_repeats)


def created_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# ---- atomic files --------------------------------------------------------------------------------


_OPS = FileOps()


def write_atomic(path: Path, data: bytes, ops: FileOps = _OPS) -> None:
    """Replace ``path`` with ``data`` so that a reader sees the old file or the new one, whole."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    ops.write_durable(path, data, temporary)


# ---- publish, read, prune ------------------------------------------------------------------------


def publish(directory: Path, manifest: CollectionManifest, *, keep: int = KEEP) -> None:
    """Write ``collection.json``, then ``LATEST``; then delete checkpoints older than the ``keep`` newest."""
    checkpoint = directory / manifest.checkpoint_id
    missing = [name for name, path in manifest.manifests.items() if not (checkpoint / path).is_file()]
    if missing:
        names = ", ".join(missing)
        raise CheckpointRefused(f"not publishing {manifest.checkpoint_id}: no manifest for {names}")
    write_atomic(checkpoint / COLLECTION_FILE, manifest.to_json())
    write_atomic(directory / LATEST_FILE, manifest.checkpoint_id.encode() + b"\n")
    prune(directory, keep=keep, published_now=manifest.checkpoint_id)


def load_published(checkpoint: Path) -> CollectionManifest | None:
    """The manifest of a published checkpoint directory; ``None`` if it is not one (ignored)."""
    if not is_checkpoint_id(checkpoint.name):
        return None
    try:
        data = _read_bounded(checkpoint / COLLECTION_FILE, MAX_COLLECTION_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as error:
        raise CheckpointRefused(f"cannot read {checkpoint / COLLECTION_FILE}: {error}") from None
    manifest = CollectionManifest.from_json(data, checkpoint / COLLECTION_FILE)
    if manifest.checkpoint_id != checkpoint.name:
        raise CheckpointRefused(f"{checkpoint / COLLECTION_FILE} names checkpoint {manifest.checkpoint_id}")
    paths = manifest.manifests.values()
    if not paths or not all((checkpoint / path).is_file() for path in paths):
        return None
    return manifest


def _published(checkpoint: Path) -> bool:
    """Whether ``checkpoint`` is published; a damaged one is not (and is logged), never an error."""
    try:
        return load_published(checkpoint) is not None
    except CheckpointRefused as error:
        logger.warning("not a published checkpoint: %s", error)
        return False


def _checkpoint_dirs(directory: Path) -> list[Path]:
    """The checkpoint directories under ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if p.is_dir() and is_checkpoint_id(p.name)),
                  key=lambda p: p.name)


def _read_bounded(path: Path, limit: int) -> bytes:
    """A regular file's bytes, opened without blocking or following a symlink, at most ``limit``
    bytes; ``OSError`` (``NotRegularFile`` for a FIFO, a device, a directory) else."""
    with _OPS.open_read(path) as file:
        if file_size(file) > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
        return file.read(limit + 1)[:limit]


def _latest_pointer(directory: Path) -> str | None:
    """The id ``LATEST`` names; ``None`` without one; ``CheckpointRefused`` if it is not one line
    naming a checkpoint id (or cannot be read)."""
    path = directory / LATEST_FILE
    try:
        data = _read_bounded(path, MAX_LATEST_BYTES)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise CheckpointRefused(f"the checkpoint directory {directory} is not a directory") from None
    except OSError as error:
        raise CheckpointRefused(f"cannot read {path}: {error.strerror or error}; remove it to restore the "
                                f"newest published checkpoint") from None
    name = data.decode("utf-8", errors="replace").strip()
    if not is_checkpoint_id(name):
        raise CheckpointRefused(f"{path} does not name a checkpoint (it holds {data[:64]!r}); remove it to "
                                f"restore the newest published checkpoint")
    return name


def find_latest(directory: Path) -> CollectionManifest | None:
    """The checkpoint to restore: the one ``LATEST`` names if published, else the newest published."""
    pointed = _latest_pointer(directory)
    if pointed is not None:
        manifest = load_published(directory / pointed)
        if manifest is not None:
            return manifest
        logger.warning("%s names %s, which is not a published checkpoint; looking for another",
                       directory / LATEST_FILE, pointed)
    for checkpoint in reversed(_checkpoint_dirs(directory)):
        manifest = load_published(checkpoint)
        if manifest is not None:
            return manifest
    return None


def older_published(directory: Path, than: str) -> list[CollectionManifest]:
    """The published checkpoints other than ``than``, newest first (by name); damaged ones are
    logged and left out. What a collector falls back to when ``than`` cannot be restored."""
    found = []
    for checkpoint in reversed(_checkpoint_dirs(directory)):
        if checkpoint.name == than:
            continue
        try:
            manifest = load_published(checkpoint)
        except CheckpointRefused as error:
            logger.warning("not a published checkpoint: %s", error)
            continue
        if manifest is not None:
            found.append(manifest)
    return found


def prune(directory: Path, *, keep: int = KEEP, published_now: str | None = None) -> list[str]:
    """Delete every checkpoint directory older than the ``keep`` newest published ones; their names.

    Never the one ``LATEST`` names, nor ``published_now``: ids come from the wall clock, so after a
    clock step back the checkpoint just published can sort before older ones. The publication order
    is not recorded anywhere else, so the other kept ones are the newest by name."""
    checkpoints = _checkpoint_dirs(directory)
    published = [p.name for p in checkpoints if _published(p)]
    if len(published) < keep:
        return []
    pinned = {name for name in (_pointer_if_readable(directory), published_now) if name is not None}
    ranked = [name for name in reversed(published) if name not in pinned]
    by_name = ranked[:max(keep - len(pinned & set(published)), 0)]
    kept = pinned | set(by_name)
    oldest = by_name or sorted(pinned & set(published))
    if not oldest:
        return []
    boundary = min(oldest)
    doomed = [p for p in checkpoints if p.name not in kept and p.name < boundary]
    deleted = []
    for checkpoint in doomed:
        try:
            shutil.rmtree(checkpoint)
        except OSError as error:
            logger.warning("cannot delete old checkpoint %s: %s", checkpoint, error)
            continue
        deleted.append(checkpoint.name)
    return deleted


def _pointer_if_readable(directory: Path) -> str | None:
    try:
        return _latest_pointer(directory)
    except (CheckpointRefused, OSError) as error:
        logger.warning("pruning without %s: %s", directory / LATEST_FILE, error)
        return None


# ---- refusing another run's checkpoint -----------------------------------------------------------


def check_same_run(manifest: CollectionManifest, identity: RunIdentity, directory: Path) -> None:
    """``CheckpointRefused`` naming what differs, unless ``manifest`` belongs to this collection."""
    where = f"checkpoint {manifest.checkpoint_id} in {directory}"
    if manifest.config_digest != identity.config_digest:
        raise CheckpointRefused(
            f"{where} was taken with another config (digest {manifest.config_digest[:12]}, this run's is "
            f"{identity.config_digest[:12]}); run with the same config, or use another --checkpoint-dir")
    if manifest.input_digest != identity.input_digest:
        raise CheckpointRefused(
            f"{where} was taken with other task rows (digest {manifest.input_digest[:12]}, this run's is "
            f"{identity.input_digest[:12]}); run with the same --input and --limit, or use another "
            f"--checkpoint-dir")
    if manifest.num_repeats != identity.num_repeats:
        raise CheckpointRefused(f"{where} was taken with --num-repeats {manifest.num_repeats}, this run "
                                f"has {identity.num_repeats}")


# ---- the dispatch log ----------------------------------------------------------------------------


def read_dispatched(directory: Path) -> dict[str, int]:
    """The highest attempt of each rollout the dispatch log names (a torn last line is skipped);
    ``CheckpointRefused`` naming the file and line if a complete line is not a JSON object, or
    naming the file if it is not a regular file (a FIFO is never waited on)."""
    highest: dict[str, int] = {}
    try:
        for row in read_jsonl(directory / DISPATCH_LOG, complete_lines_only=True):
            rollout, attempt = row.get("rollout_id"), row.get("attempt")
            if isinstance(rollout, str) and isinstance(attempt, int):
                highest[rollout] = max(attempt, highest.get(rollout, -1))
    except ValueError as error:  # names the file and the line
        raise CheckpointRefused(f"the dispatch log is damaged: {error}") from None
    except OSError as error:  # a FIFO, a device: refused before anything is read (``read_jsonl``)
        raise CheckpointRefused(f"cannot read the dispatch log {directory / DISPATCH_LOG}: "
                                f"{error.strerror or error}") from None
    return highest
