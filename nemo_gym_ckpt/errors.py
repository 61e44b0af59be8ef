"""The one error tree of the mesh.

Two trees. ``GymError`` is every failure a server answers over HTTP, and every failure the client
maps back from a peer's reply: each class carries a wire ``code`` and an HTTP ``status``; the table
``ERROR_CODES`` is the single source of both, so a code never drifts from its status. Classes are
grouped in families a caller can catch as a whole. ``CommandError`` is what a command reports in
one line (never sent over HTTP); ``nemo_gym_ckpt.cli.exit_codes`` maps both trees to exit codes.

    GymError                          (base: code, status, detail)
    ├── BadInput                      the request itself is wrong: fix it, do not retry it
    │   ├── InvalidRequest            400 invalid_request
    │   ├── RolloutIdRequired         400 rollout_id_required
    │   ├── Unauthorized              401 unauthorized
    │   ├── NotFound                  404 not_found
    │   ├── MethodNotAllowed          405 method_not_allowed
    │   └── PayloadTooLarge           413 payload_too_large
    ├── StateConflict                 the participant's checkpoint state does not allow it now
    │   ├── CheckpointConflict        409 checkpoint_conflict
    │   ├── StaleCheckpoint           409 stale_checkpoint
    │   ├── InvalidPhase              409 invalid_phase
    │   ├── DeadlineExceeded          409 deadline_exceeded
    │   ├── StaleAttempt              409 stale_attempt
    │   ├── RestartInScope            409 restart_in_scope
    │   ├── ActivationOutOfOrder      409 activation_out_of_order
    │   └── RequestConflict           409 request_conflict      (a server's own state refuses it now)
    ├── StorageError                  checkpoint files: what was read is unusable
    │   └── InvalidCheckpointState    422 invalid_checkpoint_state
    ├── PeerError                     a peer or the transport failed: the call may succeed later
    │   ├── UpstreamError             502 upstream_error        (a peer answered something unusable)
    │   ├── CoordinatorUnavailable    503 checkpoint_coordinator_unavailable
    │   ├── Unavailable               503 unavailable           (a peer, or the disk, could not be reached)
    │   ├── Overloaded                429 capacity_exceeded     (refused up front, nothing started: retry later)
    │   └── UpstreamTimeout           504 upstream_timeout      (a deadline ran out while waiting on a peer)
    └── InternalError                 500 internal_error        (a bug; never for bad input)

    CommandError                      (a command's one-line failure; not an HTTP error)
    ├── ConfigError                   a config problem, naming the file and the key   -> exit 2
    ├── UsageError                    flags or inputs that cannot work                -> exit 2
    │   └── CheckpointRefused         the directory's checkpoint is not this run's     -> exit 2
    ├── LaunchError                   the mesh could not be started or kept running   -> exit 1
    │   ├── StopRequested             a signal arrived while the servers were starting
    │   └── MeshCrashed               every server was killed on purpose (the demo's crash)
    └── CollectFailed                 the collection cannot go on                     -> exit 1
        └── CollectionStartFailed     restoring and fencing before the first dispatch failed

Route handlers raise ``GymError`` classes; ``server.install_error_handlers`` turns them into
``{"error": {"code", "detail"}}``. The client turns such bodies back into the same classes with
``error_from_body`` (and transport failures into ``PeerError`` classes, in one place), so callers
branch on classes, never on status codes.
"""

from __future__ import annotations

import datetime
import email.utils
import reprlib
import time
from typing import Any, ClassVar

__all__ = [
    "ERROR_CODES",
    "MAX_DETAIL_CHARS",
    "MAX_RETRY_AFTER_S",
    "ActivationOutOfOrder",
    "BadInput",
    "CheckpointConflict",
    "CheckpointRefused",
    "CollectFailed",
    "CollectionStartFailed",
    "CommandError",
    "ConfigError",
    "CoordinatorUnavailable",
    "DeadlineExceeded",
    "GymError",
    "InternalError",
    "InvalidCheckpointState",
    "InvalidPhase",
    "InvalidRequest",
    "LaunchError",
    "MeshCrashed",
    "MethodNotAllowed",
    "NotFound",
    "Overloaded",
    "PayloadTooLarge",
    "PeerError",
    "RequestConflict",
    "RestartInScope",
    "RolloutIdRequired",
    "StaleAttempt",
    "StaleCheckpoint",
    "StateConflict",
    "StopRequested",
    "StorageError",
    "Unauthorized",
    "Unavailable",
    "UpstreamError",
    "UpstreamTimeout",
    "UsageError",
    "error_from_body",
    "retry_after_seconds",
]


class GymError(Exception):
    """Base of every mesh error: a wire code, an HTTP status and a human detail."""

    code: ClassVar[str] = "internal_error"
    status: ClassVar[int] = 500

    def __init__(self, detail: str = "", **fields: Any) -> None:
        super().__init__(detail or self.code)
        self.detail = detail or self.code
        self.fields = fields

    def to_body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "detail": self.detail}}

    def headers(self) -> dict[str, str]:
        """Headers of the error reply (``Overloaded`` adds ``Retry-After``)."""
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.detail!r})"


class BadInput(GymError):
    """The request is wrong (body, identity, auth, route, size): retrying it unchanged fails again."""

    code, status = "invalid_request", 400


class StateConflict(GymError):
    """The participant's checkpoint state (phase, id, fences, marks) does not allow this call now."""

    code, status = "checkpoint_conflict", 409


class StorageError(GymError):
    """Checkpoint files that cannot be used as they are."""

    code, status = "invalid_checkpoint_state", 422


class PeerError(GymError):
    """A peer, the transport or the disk failed; the same call may succeed later."""

    code, status = "unavailable", 503


class InvalidRequest(BadInput):
    code, status = "invalid_request", 400


class RolloutIdRequired(BadInput):
    code, status = "rollout_id_required", 400


class Unauthorized(BadInput):
    code, status = "unauthorized", 401


class NotFound(BadInput):
    code, status = "not_found", 404


class MethodNotAllowed(BadInput):
    code, status = "method_not_allowed", 405


class CheckpointConflict(StateConflict):
    code, status = "checkpoint_conflict", 409


class StaleCheckpoint(StateConflict):
    code, status = "stale_checkpoint", 409


class InvalidPhase(StateConflict):
    code, status = "invalid_phase", 409


class DeadlineExceeded(StateConflict):
    code, status = "deadline_exceeded", 409


class StaleAttempt(StateConflict):
    code, status = "stale_attempt", 409


class RestartInScope(StateConflict):
    """A commit scope names an episode this participant reports as a restart (it cannot be exported)."""

    code, status = "restart_in_scope", 409


class ActivationOutOfOrder(StateConflict):
    code, status = "activation_out_of_order", 409


class RequestConflict(StateConflict):
    """The server's own state refuses the request now (a wrapped server's 409, e.g. a cohort that is
    already evaluating); unrelated to checkpoints."""

    code, status = "request_conflict", 409


class PayloadTooLarge(BadInput):
    code, status = "payload_too_large", 413


class RequestTimeout(BadInput):
    code, status = "request_timeout", 408


class InvalidCheckpointState(StorageError):
    code, status = "invalid_checkpoint_state", 422


class InternalError(GymError):
    code, status = "internal_error", 500


class UpstreamError(PeerError):
    code, status = "upstream_error", 502


class CoordinatorUnavailable(PeerError):
    code, status = "checkpoint_coordinator_unavailable", 503


class Unavailable(PeerError):
    code, status = "unavailable", 503


class Overloaded(PeerError):
    """Refused before anything started (no state exists): send the same request again after
    ``retry_after_s`` seconds (the reply's ``Retry-After``)."""

    code, status = "capacity_exceeded", 429

    @property
    def retry_after_s(self) -> float:
        value = self.fields.get("retry_after_s")
        return float(value) if isinstance(value, int | float) else 1.0

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(max(1, round(self.retry_after_s)))}


MAX_RETRY_AFTER_S = 60.0
_MAX_RETRY_AFTER_CHARS = 64  # the longest HTTP date is 29 characters


def retry_after_seconds(value: str | None, *, now: float | None = None) -> float:
    """A peer's ``Retry-After`` in seconds, within 1 to ``MAX_RETRY_AFTER_S``: a number of seconds
    or an HTTP date (seconds from ``now``, the wall clock by default); 1 when missing or unreadable."""
    text = (value or "").strip()
    if not text or len(text) > _MAX_RETRY_AFTER_CHARS:
        return 1.0
    seconds = _delay_seconds(text)
    if seconds is None:
        seconds = _seconds_until(text, time.time() if now is None else now)
    return min(max(seconds, 1.0), MAX_RETRY_AFTER_S) if seconds is not None else 1.0


def _delay_seconds(text: str) -> float | None:
    try:
        seconds = float(text)
    except ValueError:
        return None
    return seconds if seconds == seconds else 1.0  # NaN


def _seconds_until(text: str, now: float) -> float | None:
    try:
        moment = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if moment.tzinfo is None:  # asctime's form and "-0000": a time in UTC (RFC 9110 section 5.6.7)
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp() - now


class UpstreamTimeout(PeerError):
    code, status = "upstream_timeout", 504


class CommandError(Exception):
    """Base of what a command reports in one line; the message is that line."""


class ConfigError(CommandError):
    """A config problem: names the file and the key; the CLI exits with status 2."""

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None) -> None:
        where = ", ".join(part for part in (file, f"key '{key}'" if key else None) if part)
        super().__init__(f"{where}: {message}" if where else message)
        self.file = file
        self.key = key


class UsageError(CommandError):
    """A flag combination or an input that cannot work; exit status 2."""


class CheckpointRefused(UsageError):
    """A checkpoint of this directory cannot be used by this collection (the message says why)."""


class LaunchError(CommandError):
    """The mesh could not be started or kept running; the message is one line (notes hold logs)."""


class StopRequested(LaunchError):
    """``request_stop`` (a signal) arrived while ``start`` was waiting for the servers."""


class MeshCrashed(LaunchError):
    """Raised by the demo's crash hook after every server process got SIGKILL."""


class CollectFailed(CommandError):
    """The collection cannot go on (e.g. the head server does not answer); exit status 1."""


class CollectionStartFailed(CollectFailed):
    """The restore and fencing before the first dispatch failed (the message says why)."""


ERROR_CODES: dict[str, type[GymError]] = {
    cls.code: cls
    for cls in (
        InvalidRequest,
        RolloutIdRequired,
        Unauthorized,
        NotFound,
        MethodNotAllowed,
        CheckpointConflict,
        StaleCheckpoint,
        InvalidPhase,
        DeadlineExceeded,
        StaleAttempt,
        RestartInScope,
        ActivationOutOfOrder,
        RequestConflict,
        PayloadTooLarge,
        InvalidCheckpointState,
        InternalError,
        UpstreamError,
        CoordinatorUnavailable,
        Unavailable,
        Overloaded,
        UpstreamTimeout,
    )
}


MAX_DETAIL_CHARS = 4096
"""The most characters of a peer's ``detail`` (and ``code``) kept in the error it maps to."""
_DETAIL_REPR = reprlib.Repr()
_DETAIL_REPR.maxlevel = 4  # any nesting deeper is shown as "[...]": str() of a 990-deep list raised RecursionError
_DETAIL_REPR.maxlist = _DETAIL_REPR.maxtuple = _DETAIL_REPR.maxdict = 64
_DETAIL_REPR.maxstring = _DETAIL_REPR.maxother = MAX_DETAIL_CHARS


def _bounded_text(value: Any) -> str:
    """A peer's ``detail`` (any JSON value) as text: a string as is, anything else as its bounded
    ``repr`` (depth and items bounded), cut to ``MAX_DETAIL_CHARS``."""
    text = value if isinstance(value, str) else _DETAIL_REPR.repr(value)
    if len(text) <= MAX_DETAIL_CHARS:
        return text
    return f"{text[:MAX_DETAIL_CHARS]}... ({len(text)} characters)"


def error_from_body(status: int, body: Any) -> GymError:
    """Turn a peer's error reply back into the matching class (``UpstreamError`` if unknown); its
    detail is kept as bounded text, whatever JSON value the peer sent."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("code"), str):
        cls = ERROR_CODES.get(error["code"])
        detail = _bounded_text(error.get("detail", ""))
        if cls is not None:
            return cls(detail)
        return UpstreamError(f"{_bounded_text(error['code'])} ({status}): {detail}")
    return UpstreamError(f"peer answered {status} without a structured error")
