"""The control routes of a participant, under ``/ng-control/v1/checkpoint`` (docs/protocol.md section 3).

``make_router(participant, auth_token)`` gives a router that every server kind mounts when
checkpointing is on (``mount_checkpointing`` does it in one call). Every route checks the bearer
token first, in constant time (``hmac.compare_digest``), before it looks at the body; bodies are
parsed strictly after that. Handlers raise ``GymError`` classes; the app's handlers turn them into
``{"error": {"code", "detail"}}``. The token is never logged or echoed.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response

from nemo_gym_ckpt.checkpoint.models import (
    CommitRequest,
    ControlRequest,
    ForgetRequest,
    RestoreRequest,
    RetireRequest,
    load_json,
    parse_body,
    parse_object,
)
from nemo_gym_ckpt.checkpoint.participant import Participant
from nemo_gym_ckpt.errors import PayloadTooLarge, Unauthorized
from nemo_gym_ckpt.server import OrjsonResponse, declare_body

__all__ = ["CONTROL_PREFIX", "MAX_BODY_BYTES", "make_router"]

CONTROL_PREFIX = "/ng-control/v1/checkpoint"
MAX_BODY_BYTES = 32 * 1024 * 1024
B = TypeVar("B", bound=ControlRequest)
Handler = Callable[[Request], Awaitable[Response]]
Forward = Callable[[str, dict[str, Any] | None], Awaitable[dict[str, Any]]]
"""Runs a control call elsewhere: (operation, its JSON body, ``None`` for status) -> the reply."""


def make_router(participant: Participant, auth_token: str, forward: Forward | None = None) -> APIRouter:
    """The control router of ``participant``, guarded by ``auth_token``.

    With ``forward`` (a worker of a multi-worker server), each call is checked here (bearer, body)
    and then run by ``forward`` on the coordinator's participant instead of ``participant``.
    """
    if not auth_token:
        raise ValueError("a control auth token is required")
    authorize = _bearer_check(auth_token.encode(), participant)
    router = APIRouter(prefix=CONTROL_PREFIX, default_response_class=OrjsonResponse)

    async def status(request: Request) -> Response:
        authorize(request)
        if forward is not None:
            return OrjsonResponse(await forward("status", None))
        return OrjsonResponse(participant.status())

    router.add_api_route("/status", status, methods=["GET"])
    routes: list[tuple[str, type[Any], Callable[[Any], Awaitable[dict[str, Any]]]]] = [
        ("prepare", ControlRequest, participant.prepare),
        ("renew", ControlRequest, participant.renew),
        ("commit", CommitRequest, participant.commit),
        ("restore", RestoreRequest, participant.restore),
        ("resume", ControlRequest, participant.resume),
        ("retire", RetireRequest, participant.retire),
        ("forget", ForgetRequest, participant.forget),
    ]
    for name, model, operation in routes:
        handler = (_post(authorize, model, operation) if forward is None
                   else _forwarded(authorize, model, name, forward))
        router.add_api_route(f"/{name}", handler, methods=["POST"], name=name, openapi_extra=declare_body(model))
    return router


def _post(
    authorize: Callable[[Request], None], model: type[B], operation: Callable[[B], Awaitable[dict[str, Any]]]
) -> Handler:
    async def handler(request: Request) -> Response:
        authorize(request)
        body = parse_body(model, await _read_body(request))
        return OrjsonResponse(await operation(body))

    return handler


def _forwarded(authorize: Callable[[Request], None], model: type[B], name: str, forward: Forward) -> Handler:
    async def handler(request: Request) -> Response:
        authorize(request)
        body = load_json(await _read_body(request))
        parse_object(model, body)  # a bad body is refused here, before it travels
        return OrjsonResponse(await forward(name, body))

    return handler


def _bearer_check(expected: bytes, participant: Participant) -> Callable[[Request], None]:
    def authorize(request: Request) -> None:
        scheme, _, presented = request.headers.get("authorization", "").partition(" ")
        # Starlette decodes header bytes as latin-1: encoding back gives the bytes that were sent.
        given = presented.strip().encode("latin-1")
        if not (scheme.lower() == "bearer" and hmac.compare_digest(given, expected)):
            participant.telemetry.event("refused", code=Unauthorized.code)
            raise Unauthorized("missing or wrong bearer token")

    return authorize


async def _read_body(request: Request) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise PayloadTooLarge(f"control bodies are limited to {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
