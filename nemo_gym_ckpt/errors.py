"""The one error tree of the mesh.

Every failure a server answers, and every failure the client maps back from a peer, is one of
these classes. Each carries a wire ``code`` and an HTTP ``status``; the table ``ERROR_CODES``
below is the single source of both, so a code never drifts from its status.

    GymError                          (base: code, status, detail)
    ├── InvalidRequest                400 invalid_request
    ├── RolloutIdRequired             400 rollout_id_required
    ├── Unauthorized                  401 unauthorized
    ├── NotFound                      404 not_found
    ├── MethodNotAllowed              405 method_not_allowed
    ├── CheckpointConflict            409 checkpoint_conflict
    ├── StaleCheckpoint               409 stale_checkpoint
    ├── InvalidPhase                  409 invalid_phase
    ├── DeadlineExceeded              409 deadline_exceeded
    ├── StaleAttempt                  409 stale_attempt
    ├── ActivationOutOfOrder          409 activation_out_of_order
    ├── PayloadTooLarge               413 payload_too_large
    ├── InvalidCheckpointState        422 invalid_checkpoint_state
    ├── InternalError                 500 internal_error        (a bug; never for bad input)
    ├── UpstreamError                 502 upstream_error        (a peer answered something unusable)
    ├── CoordinatorUnavailable        503 checkpoint_coordinator_unavailable
    ├── Unavailable                   503 unavailable           (a peer could not be reached)
    └── UpstreamTimeout               504 upstream_timeout      (a deadline ran out while waiting on a peer)

    ConfigError                       (not an HTTP error: a config problem, exit status 2)

Route handlers raise these; ``server.install_error_handlers`` turns them into
``{"error": {"code", "detail"}}``. The client turns such bodies back into the same classes with
``error_from_body``, so callers branch on classes, never on status codes.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "ERROR_CODES",
    "ActivationOutOfOrder",
    "CheckpointConflict",
    "ConfigError",
    "CoordinatorUnavailable",
    "DeadlineExceeded",
    "GymError",
    "InternalError",
    "InvalidCheckpointState",
    "InvalidPhase",
    "InvalidRequest",
    "MethodNotAllowed",
    "NotFound",
    "PayloadTooLarge",
    "RolloutIdRequired",
    "StaleAttempt",
    "StaleCheckpoint",
    "Unauthorized",
    "Unavailable",
    "UpstreamError",
    "UpstreamTimeout",
    "error_from_body",
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

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.detail!r})"


class InvalidRequest(GymError):
    code, status = "invalid_request", 400


class RolloutIdRequired(GymError):
    code, status = "rollout_id_required", 400


class Unauthorized(GymError):
    code, status = "unauthorized", 401


class NotFound(GymError):
    code, status = "not_found", 404


class MethodNotAllowed(GymError):
    code, status = "method_not_allowed", 405


class CheckpointConflict(GymError):
    code, status = "checkpoint_conflict", 409


class StaleCheckpoint(GymError):
    code, status = "stale_checkpoint", 409


class InvalidPhase(GymError):
    code, status = "invalid_phase", 409


class DeadlineExceeded(GymError):
    code, status = "deadline_exceeded", 409


class StaleAttempt(GymError):
    code, status = "stale_attempt", 409


class ActivationOutOfOrder(GymError):
    code, status = "activation_out_of_order", 409


class PayloadTooLarge(GymError):
    code, status = "payload_too_large", 413


class InvalidCheckpointState(GymError):
    code, status = "invalid_checkpoint_state", 422


class InternalError(GymError):
    code, status = "internal_error", 500


class UpstreamError(GymError):
    code, status = "upstream_error", 502


class CoordinatorUnavailable(GymError):
    code, status = "checkpoint_coordinator_unavailable", 503


class Unavailable(GymError):
    code, status = "unavailable", 503


class UpstreamTimeout(GymError):
    code, status = "upstream_timeout", 504


class ConfigError(Exception):
    """A config problem: names the file and the key; the CLI exits with status 2."""

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None) -> None:
        where = ", ".join(part for part in (file, f"key '{key}'" if key else None) if part)
        super().__init__(f"{where}: {message}" if where else message)
        self.file = file
        self.key = key


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
        ActivationOutOfOrder,
        PayloadTooLarge,
        InvalidCheckpointState,
        InternalError,
        UpstreamError,
        CoordinatorUnavailable,
        Unavailable,
        UpstreamTimeout,
    )
}


def error_from_body(status: int, body: Any) -> GymError:
    """Turn a peer's error reply back into the matching class (``UpstreamError`` if unknown)."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("code"), str):
        cls = ERROR_CODES.get(error["code"])
        detail = str(error.get("detail", ""))
        if cls is not None:
            return cls(detail)
        return UpstreamError(f"{error['code']} ({status}): {detail}")
    return UpstreamError(f"peer answered {status} without a structured error")
