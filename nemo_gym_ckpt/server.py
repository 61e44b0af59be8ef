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

JSON bodies that FastAPI parses for a route (``BoundedJsonRoute``, every route of an app made here
and of the routers that use it) refuse integers outside the 64-bit range, which no part of the mesh
can encode again (400, never a 500 later).

Every request body is capped (``BodyLimitMiddleware``: 413 ``payload_too_large`` once more than the
limit has arrived, or at once when ``Content-Length`` says so; ``DEFAULT_MAX_BODY_BYTES``, set per
server with ``set_max_body_bytes`` from its ``max_body_bytes`` setting), and must keep arriving (408
``request_timeout`` after ``BODY_PART_TIMEOUT_S`` without a part); a client that disconnects before its
body is read is no error of the server's (logged at debug level). A reader of bodies outside the
middleware (the resources shell, around a server that is not ours) keeps the same rules with
``refuse_declared_length`` and ``next_body_part``. A body handed on to a reader that parses it with
the standard library (the shell's server, the ``mcp`` package) is first refused when that reader
would take what the mesh cannot handle (``refuse_unreadable_json``), then replayed to it
(``replayed_body``). A 405 names the allowed methods in ``Allow``. The OpenAPI document declares, on
every operation, the structured error replies (``ErrorBody``) instead of FastAPI's default 422, and
the body of each route that reads it itself (``declare_body``).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nemo_gym_ckpt.canonical import MAX_JSON_LEVELS, nested
from nemo_gym_ckpt.errors import (
    GymError,
    InternalError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
)
from nemo_gym_ckpt.identity import CURRENT_IDENTITY, split_rollout_path

__all__ = [
    "BODY_PART_TIMEOUT_S",
    "DEFAULT_MAX_BODY_BYTES",
    "ERROR_STATUSES",
    "BodyLimitMiddleware",
    "BoundedJsonRoute",
    "OrjsonResponse",
    "RolloutPrefixMiddleware",
    "close_on_shutdown",
    "create_app",
    "declare_body",
    "error_response",
    "install_error_handlers",
    "next_body_part",
    "refuse_declared_length",
    "refuse_unencodable",
    "refuse_unreadable_json",
    "replayed_body",
    "set_max_body_bytes",
    "sse_event",
    "too_large",
]

logger = logging.getLogger(__name__)

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
BODY_PART_TIMEOUT_S = 30.0
"""The longest wait for the next part of an unfinished request body (then 408 ``request_timeout``)."""
ERROR_STATUSES = (400, 401, 404, 405, 408, 409, 413, 422, 500, 502, 503, 504)
ERROR_SCHEMA = "ErrorBody"
_ERROR_BODY_SCHEMA: dict[str, Any] = {
    "title": ERROR_SCHEMA, "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["code", "detail"], "additionalProperties": False,
        "properties": {"code": {"type": "string"}, "detail": {"type": "string"}}}},
}


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


def _int64(text: str) -> int:
    value = int(text)
    if not -(2**63) <= value < 2**64:  # a 400 that names the cause (FastAPI passes HTTPException on)
        raise StarletteHTTPException(400, f"an integer of {len(text)} digits is outside the 64-bit range")
    return value


def refuse_unencodable(
    value: Any, what: str = "the request body", *, levels: int = 0, refusal: type[GymError] = InvalidRequest
) -> Any:
    """``value``, read from JSON, if the mesh can write it again, nested ``levels`` levels deeper
    (what will wrap it); else ``refusal`` (400 by default): JSON nested deeper than orjson writes
    (``MAX_JSON_LEVELS``; its reader takes 1,024) or text with a lone surrogate (the standard library's
    reader takes it) would fail later, when a digest, a call or a record encodes it."""
    try:
        orjson.dumps(nested(value, levels))
    except orjson.JSONEncodeError as error:
        raise refusal(f"{what} cannot be written again as JSON ({error}): at most "
                      f"{MAX_JSON_LEVELS - levels} levels of nesting, and text of valid Unicode") from None
    return value


def refuse_unreadable_json(body: bytes) -> None:
    """400 for a non-empty body that is not JSON the mesh can read and write again, for a reader of
    bodies that parses them with the standard library (NeMo Gym's servers, the ``mcp`` package).

    The standard library takes what no other part of the mesh can handle (JSON nested 1,000 levels
    deep, a lone surrogate, ``NaN`` or ``1e999``), and its readers then fail with a 500 (a
    ``RecursionError``, or an error reply they cannot encode). Refused: what orjson cannot read
    (invalid JSON, ``NaN``/``Infinity``, a number no double holds, nesting past 1,024 levels, text
    that is not Unicode) and what ``refuse_unencodable`` refuses (nesting past 254 levels). The
    encodings the standard library detects (a UTF-8 byte order mark, UTF-16, UTF-32) are read as it
    reads them; an empty body goes on as it came, for the reader to judge.
    """
    if not body:
        return
    try:
        value = orjson.loads(_as_utf8(body))
    except (orjson.JSONDecodeError, UnicodeDecodeError) as error:
        raise InvalidRequest(f"the request body is not JSON the mesh can read ({error})") from None
    refuse_unencodable(value)


def _as_utf8(body: bytes) -> bytes | str:
    """``body`` as orjson reads it: UTF-8 without a byte order mark (else text, decoded as
    ``json.loads`` decodes bytes; a lone surrogate stays one, for orjson to refuse)."""
    encoding = json.detect_encoding(body)
    if encoding == "utf-8":
        return body
    return body.decode(encoding, "surrogatepass")


def replayed_body(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the body read already, then what the client sends next (disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


class _BoundedJsonRequest(Request):
    """A request whose ``json()`` refuses what no encoder of the mesh can write back: integers
    outside 64 bits, and what ``refuse_unencodable`` refuses."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            value = json.loads(await self.body(), parse_int=_int64)
            try:
                self._json = refuse_unencodable(value)
            except InvalidRequest as error:  # FastAPI passes an HTTPException on, with its detail
                raise StarletteHTTPException(400, error.detail) from None
        return self._json


class BoundedJsonRoute(APIRoute):
    """A route whose JSON body is parsed by ``_BoundedJsonRequest`` (a 400 for a 65-bit integer)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def bounded(request: Request) -> Response:
            return await handler(_BoundedJsonRequest(request.scope, request.receive))

        return bounded


class _BodyLimit:
    """The body limit of one app (changed with ``set_max_body_bytes``)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes


class BodyLimitMiddleware:
    """413 once a request body exceeds the app's limit: at once when ``Content-Length`` says so, else
    when the bytes received pass it (the handler's read of the body fails there, nothing more is held).
    408 when no part of an unfinished body arrives for ``BODY_PART_TIMEOUT_S``: a client that stalls
    mid-body holds nothing (an environment's ``/run`` slot among others) for longer."""

    def __init__(self, app: ASGIApp, limit: _BodyLimit) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit.max_bytes
        try:
            refuse_declared_length(scope, limit)
        except PayloadTooLarge as error:
            await error_response(error)(scope, receive, send)
            return
        received, complete = 0, False

        async def counted() -> Message:
            nonlocal received, complete
            if complete:  # what a handler receives after the body (a disconnect) has no deadline here
                return await receive()
            message = await _body_part(receive)
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise StarletteHTTPException(413, too_large(limit))
            return message

        await self.app(scope, counted, send)


async def next_body_part(receive: Receive) -> Message:
    """The next ASGI message of a request, or 408 ``RequestTimeout`` when none arrives for
    ``BODY_PART_TIMEOUT_S`` (for a reader of a body outside FastAPI's routes: the resources shell)."""
    try:
        async with asyncio.timeout(BODY_PART_TIMEOUT_S):
            return await receive()
    except TimeoutError:
        raise RequestTimeout(f"no part of the request body arrived for {BODY_PART_TIMEOUT_S:g} s") from None


async def _body_part(receive: Receive) -> Message:
    try:
        return await next_body_part(receive)
    except RequestTimeout as error:  # raised as Starlette's: FastAPI turns any other error reading a body into a 400
        raise StarletteHTTPException(408, error.detail) from None


def refuse_declared_length(scope: Scope, limit: int) -> None:
    """413 ``PayloadTooLarge`` at once when the request's ``Content-Length`` is over ``limit`` bytes."""
    declared = _content_length(scope)
    if declared is not None and declared > limit:
        raise PayloadTooLarge(too_large(limit))


def too_large(limit: int) -> str:
    """The detail of a 413 for a body over ``limit`` bytes."""
    return f"request bodies are limited to {limit} bytes (max_body_bytes)"


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isdigit() and len(text) < 20 else None
    return None


def set_max_body_bytes(app: FastAPI, max_bytes: int) -> None:
    """Set the body limit of an app made by ``create_app``."""
    if max_bytes < 1:
        raise ValueError("max_body_bytes must be >= 1")
    app.state.body_limit.max_bytes = max_bytes


_BODY_SCHEMAS: weakref.WeakKeyDictionary[type[BaseModel], dict[str, Any]] = weakref.WeakKeyDictionary()


def declare_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` of a route that reads and validates its body itself, as ``model``.

    The JSON schema is made once per model (a few milliseconds each; an app declares a dozen bodies,
    the control routes' the same in every app) and each call gets its own copy: the OpenAPI document
    built from it moves its ``$defs`` out (``_declared``)."""
    schema = _BODY_SCHEMAS.get(model)
    if schema is None:
        schema = _BODY_SCHEMAS[model] = model.model_json_schema(ref_template="#/components/schemas/{model}")
    content = {"application/json": {"schema": copy.deepcopy(schema)}}
    return {"requestBody": {"required": True, "content": content}}


def _declared(schema: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI document with every operation's structured errors, and the ``$defs`` of declared
    bodies moved to the components (where their references point)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    components[ERROR_SCHEMA] = _ERROR_BODY_SCHEMA
    error = {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ERROR_SCHEMA}"}}}}
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            for status in ERROR_STATUSES:
                responses[str(status)] = {"description": "a structured error", **error}
            body = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
            defs = body.get("schema", {}).pop("$defs", None) if isinstance(body.get("schema"), dict) else None
            components.update(defs or {})
    return schema


def _with_declared_errors(app: FastAPI) -> None:
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _declared(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


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
        return OrjsonResponse(mapped.to_body(), status_code=405, headers=_allow_header(request, error))
    elif error.status_code == 413:
        mapped = PayloadTooLarge(str(error.detail))
    elif error.status_code == 408:
        mapped = RequestTimeout(str(error.detail))
    else:
        mapped = InvalidRequest(str(error.detail))
    return error_response(mapped)


def _allow_header(request: Request, error: StarletteHTTPException) -> dict[str, str]:
    """``Allow``: the methods of every route whose path matches the request's (a path may have
    several routes, one per method)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        allowed = getattr(route, "methods", None)
        if match is not Match.NONE and allowed:
            methods.update(allowed)
    given = (error.headers or {}).get("Allow")
    if not methods and given:
        methods.update(method.strip() for method in given.split(","))
    return {"Allow": ", ".join(sorted(methods))} if methods else {}


async def _on_disconnect(request: Request, _: Exception) -> Response:
    """The client went away before its body was read: nobody reads the reply, nothing to log loudly."""
    logger.debug("client disconnected during %s %s", request.method, request.url.path)
    return error_response(InvalidRequest("the client disconnected before its request body was read"))


async def _on_unexpected(request: Request, error: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=error)
    return error_response(InternalError(f"{type(error).__name__} on {request.url.path}"))


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception class to a structured reply, in one place."""
    app.add_exception_handler(GymError, _on_gym_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(ClientDisconnect, _on_disconnect)
    app.add_exception_handler(Exception, _on_unexpected)


def create_app(
    name: str, *, lifespan: Lifespan | None = None, version: str = "0.1.0",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, health_check: Callable[[], None] | None = None,
) -> FastAPI:
    """A FastAPI app for one mesh server instance called ``name``; ``health_check`` (when given) runs
    on each ``GET /health`` and raises a ``GymError`` when the server can serve no more."""
    app = FastAPI(title=name, version=version, lifespan=lifespan, default_response_class=OrjsonResponse)
    app.router.route_class = BoundedJsonRoute
    install_error_handlers(app)
    app.state.body_limit = limit = _BodyLimit(max_body_bytes)
    app.add_middleware(RolloutPrefixMiddleware)
    app.add_middleware(BodyLimitMiddleware, limit=limit)
    _with_declared_errors(app)

    @app.get("/health")
    async def health() -> dict[str, str]:
        if health_check is not None:
            health_check()
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
