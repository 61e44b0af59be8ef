"""The app factory every mesh server is built with.

``create_app`` gives a FastAPI app with ``GET /health``, the ``/ng-rollout/<capture_key>/`` prefix
handled by ``RolloutPrefixMiddleware``, orjson responses, and one set of error handlers that turn
every failure into ``{"error": {"code", "detail"}}``: domain errors by class, validation failures as
400 ``invalid_request``, unknown routes as 404 and wrong methods as 405. Nothing a client sends can
produce a 500; a 500 means a bug and is logged with its traceback.

``close_on_shutdown(app, aclose)`` chains one more step onto an app's lifespan: ``aclose`` runs once
the lifespan the app had so far has ended (or failed to start). Each server's ``create_app`` closes
its context's client this way, so an app closes its client wherever it runs (uvicorn, or a test
entering its lifespan over ``httpx.ASGITransport``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from nemo_gym_ckpt.errors import (
    GymError,
    InternalError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
)
from nemo_gym_ckpt.identity import CURRENT_IDENTITY, split_rollout_path

__all__ = [
    "OrjsonResponse",
    "RolloutPrefixMiddleware",
    "close_on_shutdown",
    "create_app",
    "error_response",
    "install_error_handlers",
    "sse_event",
]

logger = logging.getLogger(__name__)

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


class OrjsonResponse(JSONResponse):
    """JSON rendered by orjson (non-str dict keys and numpy scalars allowed)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)


def error_response(error: GymError) -> OrjsonResponse:
    return OrjsonResponse(error.to_body(), status_code=error.status, headers=error.headers() or None)


def sse_event(payload: Any) -> bytes:
    """One server-sent event carrying a JSON payload (``"[DONE]"`` passes as the bare marker)."""
    data = payload.encode() if isinstance(payload, str) else orjson.dumps(payload)
    return b"data: " + data + b"\n\n"


class RolloutPrefixMiddleware:
    """Strips ``/ng-rollout/<capture_key>`` and sets the request's rollout identity."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            identity, path = split_rollout_path(scope["path"])
        except GymError as error:
            await error_response(error)(scope, receive, send)
            return
        if identity is None:
            await self.app(scope, receive, send)
            return
        scope = dict(scope, path=path, raw_path=path.encode(), ng_identity=identity)
        token = CURRENT_IDENTITY.set(identity)
        try:
            await self.app(scope, receive, send)
        finally:
            CURRENT_IDENTITY.reset(token)


def _validation_detail(error: RequestValidationError) -> str:
    parts = []
    for item in error.errors()[:5]:
        loc = ".".join(str(part) for part in item.get("loc", ()) if part != "body")
        parts.append(f"{loc or 'body'}: {item.get('msg', 'invalid')}")
    return "; ".join(parts) or "request body failed validation"


async def _on_gym_error(_: Request, error: Exception) -> Response:
    assert isinstance(error, GymError)
    return error_response(error)


async def _on_validation_error(_: Request, error: Exception) -> Response:
    assert isinstance(error, RequestValidationError)
    return error_response(InvalidRequest(_validation_detail(error)))


async def _on_http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, StarletteHTTPException)
    mapped: GymError
    if error.status_code == 404:
        mapped = NotFound(f"no route {request.method} {request.url.path}")
    elif error.status_code == 405:
        mapped = MethodNotAllowed(f"{request.method} not allowed on {request.url.path}")
    elif error.status_code == 413:
        mapped = PayloadTooLarge(str(error.detail))
    else:
        mapped = InvalidRequest(str(error.detail))
    return error_response(mapped)


async def _on_unexpected(request: Request, error: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=error)
    return error_response(InternalError(f"{type(error).__name__} on {request.url.path}"))


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception class to a structured reply, in one place."""
    app.add_exception_handler(GymError, _on_gym_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)


def create_app(name: str, *, lifespan: Lifespan | None = None, version: str = "0.1.0") -> FastAPI:
    """A FastAPI app for one mesh server instance called ``name``."""
    app = FastAPI(title=name, version=version, lifespan=lifespan, default_response_class=OrjsonResponse)
    install_error_handlers(app)
    app.add_middleware(RolloutPrefixMiddleware)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "name": name}

    return app



def close_on_shutdown(app: FastAPI, aclose: Callable[[], Awaitable[object]]) -> FastAPI:
    """Run ``aclose`` when ``app`` shuts down, after the lifespan it had so far; answers ``app``.

    Chained calls close in order of registration: what the app's own shutdown (and each earlier
    step) may still use, a client registered last, stays open until they ended. ``aclose`` runs also
    when the app's startup fails.
    """
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(instance: FastAPI) -> AsyncIterator[Any]:
        try:
            async with inner(instance) as state:
                yield state
        finally:
            await aclose()

    app.router.lifespan_context = lifespan
    return app
