"""A participant shell around any resources server's ASGI app: ``ResourcesShell`` (docs/verifiers.md).

Our own resources servers are participants through their base class. A server that is not ours
(NeMo Gym's verifiers, run in their own process and Python) becomes one by being served inside this
shell, which knows nothing of the server but its ``Declaration`` (``checkpoint_mode``: ``stateless``
or ``restart_only``; ``checkpoint_verify``: ``wait`` or ``replay``) and the routes every NeMo Gym
style resources server has. The shell:

- answers ``GET /health`` (with the instance name, as the launcher wants it) and, with checkpointing
  on, the control routes; everything else goes to the server;
- reads the rollout identity from ``/ng-rollout/<key>/`` and hands the server the path as it came
  (``inner_strips_prefix``: NeMo Gym's servers strip the prefix themselves, and then pass it on to
  the judge models they call) or without the prefix;
- admits the rollout-scoped requests exactly as for our own servers (``ResourcesAdapter``):
  ``POST /seed_session`` (seed), ``/verify`` (verify), ``/close_session`` (close), ``/mcp`` and
  every other ``POST`` (a tool call: tools reached over MCP are covered like HTTP tools), while
  ``GET`` routes and ``POST /aggregate_metrics`` pass unadmitted;
- keeps the session membership a stateless declaration exports: a 2xx seed opens a session (its id
  is the body's ``resources_session_id`` when that is a valid session id, else a fresh one) and sets
  the cookie ``ng_session_<instance>``; a 2xx ``/verify`` or ``/close_session`` ends it; a request
  carrying the cookie of a session of another attempt is ``stale_attempt``;
- puts the declaration headers on every seed reply (``x-ng-checkpoint-verify``, and
  ``x-ng-checkpoint-restart: 1`` for restart-only servers);
- reads every ``POST`` body itself, before admission, as our own servers do (a client stalled
  mid-body is never in flight and never holds a prepare): at most ``max_body_bytes`` (413, at once
  when ``Content-Length`` says so), each part within ``BODY_PART_TIMEOUT_S`` (408), and a non-empty
  body that is not JSON the mesh reads and writes again is 400 (form bodies go to the server unread);
- turns every error reply of the server (its 404, its 422 validation errors, its 408, 409, 429 and
  503) into ``{"error": {"code", "detail"}}`` with our classes, as our own servers answer (a 429
  keeps its ``Retry-After``, within 1 to 60 s);
- runs the server's own lifespan inside its own.

With checkpointing off there is no control route and no admission; the health route, the headers
and the error shape stay. An ``exported`` declaration is refused: a server outside the repository
has no hooks through which its session state could be saved.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator, MutableMapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK, Clock
from nemo_gym_ckpt.checkpoint.headers import RESTART_HEADER, VERIFY_HEADER
from nemo_gym_ckpt.checkpoint.mount import mount_checkpointing
from nemo_gym_ckpt.checkpoint.router import CONTROL_PREFIX
from nemo_gym_ckpt.config import CheckpointConfig
from nemo_gym_ckpt.errors import (
    GymError,
    InternalError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RequestConflict,
    RequestTimeout,
    StaleAttempt,
    Unauthorized,
    Unavailable,
    UpstreamError,
    UpstreamTimeout,
    retry_after_seconds,
)
from nemo_gym_ckpt.identity import CURRENT_IDENTITY, RolloutIdentity, split_rollout_path
from nemo_gym_ckpt.resources.adapter import (
    CHECKPOINT_MODES,
    CHECKPOINT_VERIFY_MODES,
    SESSION_ID,
    CheckpointMode,
    CheckpointVerify,
    ResourcesAdapter,
    Route,
)
from nemo_gym_ckpt.resources.sessions import Session, SessionTable, session_cookie_name
from nemo_gym_ckpt.server import (
    DEFAULT_MAX_BODY_BYTES,
    create_app,
    error_response,
    next_body_part,
    refuse_declared_length,
    refuse_unreadable_json,
    replayed_body,
    too_large,
)

__all__ = ["Declaration", "ResourcesShell", "mapped_error", "route_of"]

MAX_ERROR_BODY_BYTES = 64 * 1024
"""How much of a server's error reply the shell reads to build its detail (the rest is dropped)."""
DETAIL_CHARS = 2000
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")
"""Bodies a server reads as a form, not as JSON: these go to it unread."""
UNADMITTED_POSTS = frozenset({"/aggregate_metrics"})
ROUTES: dict[str, Route] = {"/seed_session": "seed", "/verify": "verify", "/close_session": "close"}
_COOKIE_VALUE = re.compile(r"[A-Za-z0-9_-]{1,128}")


@dataclass(frozen=True)
class Declaration:
    """What a checkpoint may do with a server's work: its mode and its verify step (in code, never
    in config; docs/protocol.md section 7)."""

    checkpoint_mode: CheckpointMode
    checkpoint_verify: CheckpointVerify

    def __post_init__(self) -> None:
        if self.checkpoint_mode not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint_mode must be one of {CHECKPOINT_MODES}, got {self.checkpoint_mode!r}")
        if self.checkpoint_verify not in CHECKPOINT_VERIFY_MODES:
            raise ValueError(f"checkpoint_verify must be one of {CHECKPOINT_VERIFY_MODES}, "
                             f"got {self.checkpoint_verify!r}")
        if self.checkpoint_mode == "exported":
            raise ValueError("a wrapped server cannot be exported (it has no hooks to save its sessions): "
                             "declare stateless or restart_only")


def route_of(method: str, path: str) -> Route | None:
    """The admission route of a request to a wrapped server (``None``: not rollout-scoped)."""
    if method != "POST" or path in UNADMITTED_POSTS:
        return None
    return ROUTES.get(path, "tool")


# ---- errors ---------------------------------------------------------------------------------------

_BY_STATUS: dict[int, type[GymError]] = {
    400: InvalidRequest, 401: Unauthorized, 403: Unauthorized, 404: NotFound, 405: MethodNotAllowed,
    408: RequestTimeout, 409: RequestConflict, 413: PayloadTooLarge, 422: InvalidRequest, 429: Overloaded,
    502: UpstreamError, 503: Unavailable, 504: UpstreamTimeout,
}


def mapped_error(status: int, body: bytes, retry_after: str | None = None) -> GymError:
    """Our error for a wrapped server's error reply (its status, body and ``Retry-After`` header)."""
    cls = _BY_STATUS.get(status) or (InvalidRequest if status < 500 else InternalError)
    detail = f"{_detail_of(body)} (the server answered {status})"
    if cls is Overloaded:
        return Overloaded(detail, retry_after_s=retry_after_seconds(retry_after))
    return cls(detail)


def _detail_of(body: bytes) -> str:
    try:
        parsed = json.loads(body)
    except ValueError:
        return body.decode(errors="replace").strip()[:DETAIL_CHARS] or "no detail"
    detail = parsed.get("detail", parsed) if isinstance(parsed, dict) else parsed
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):  # already ours
        detail = parsed["error"].get("detail", parsed["error"])
    if isinstance(detail, list):  # a validation error list
        detail = "; ".join(_validation_item(item) for item in detail[:5])
    text = detail if isinstance(detail, str) else json.dumps(detail)
    return text[:DETAIL_CHARS] or "no detail"


def _validation_item(item: Any) -> str:
    if not isinstance(item, dict):
        return str(item)
    loc = ".".join(str(part) for part in item.get("loc", ()) if part != "body")
    return f"{loc or 'body'}: {item.get('msg', 'invalid')}"


# ---- the shell ----------------------------------------------------------------------------------


class ResourcesShell:
    """A resources participant around ``inner``, the ASGI app of a server that is not ours.

    It is the adapter's ``SessionHost``: the declaration and the membership table. A stateless or
    restart-only server has no session state, so the export, restore and park hooks are never used.
    """

    def __init__(self, inner: ASGIApp, name: str, declaration: Declaration, *,
                 inner_strips_prefix: bool = False) -> None:
        self.inner, self.name, self.declaration = inner, name, declaration
        self.inner_strips_prefix = inner_strips_prefix
        self.sessions = SessionTable()
        self.cookie_name = session_cookie_name(name)
        self.checkpoint: ResourcesAdapter | None = None
        self.max_body_bytes = DEFAULT_MAX_BODY_BYTES

    @property
    def checkpoint_mode(self) -> CheckpointMode:
        return self.declaration.checkpoint_mode

    @property
    def checkpoint_verify(self) -> CheckpointVerify:
        return self.declaration.checkpoint_verify

    async def export_session(self, session: Session) -> dict[str, Any]:
        return {}

    async def restore_session(self, state: Any) -> dict[str, Any]:
        return {}

    async def park_session(self, session: Session) -> None:
        """Nothing to settle: the server keeps no state a checkpoint holds."""

    async def release_session(self, session: Session) -> None:
        """After a stop commit: nothing to free, the shell holds nothing of the server's outside its records."""

    async def drop_session(self, session_id: str | None) -> bool:
        return self.sessions.pop(session_id) is not None

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The declaration headers of every seed reply."""
        headers = [(VERIFY_HEADER.encode(), self.checkpoint_verify.encode())]
        if self.checkpoint_mode == "restart_only":
            headers.append((RESTART_HEADER.encode(), b"1"))
        return headers

    def build_app(self, checkpoint: CheckpointConfig | None, *, clock: Clock = SYSTEM_CLOCK,
                  max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> ASGIApp:
        """The shell's ASGI app: our health and control routes, the server behind them; a request
        body over ``max_body_bytes`` is 413, to the server as to our routes."""
        outer = create_app(self.name, lifespan=self._lifespan, max_body_bytes=max_body_bytes)
        self.max_body_bytes = max_body_bytes
        adapter = ResourcesAdapter(self)
        if checkpoint is not None:
            participant = mount_checkpointing(outer, checkpoint, adapter, kind="resources", instance=self.name,
                                              clock=clock)
            if participant is not None:
                adapter.participant, self.checkpoint = participant, adapter
        return _Dispatch(self, outer)

    @asynccontextmanager
    async def _lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        async with asgi_lifespan(self.inner):
            yield

    # -- one request to the server

    async def forward(self, scope: Scope, receive: Receive, send: Send, identity: RolloutIdentity | None,
                      path: str) -> None:
        route = route_of(scope["method"], path)
        inner_scope = scope if self.inner_strips_prefix else dict(scope, path=path, raw_path=path.encode())
        reply = _Reply(self, send, route, identity)
        try:
            # the body is read (bounded, with a deadline per part) before admission: a client that
            # stalls mid-body is never counted in flight, and never holds a checkpoint's prepare
            body = await self._read_post_body(scope, receive) if scope["method"] == "POST" else None
            async with self._entered(route, identity):
                cookie = _cookie(scope, self.cookie_name)
                if route is not None:
                    self._check_session(cookie, identity)
                if body is not None:
                    receive = replayed_body(body, receive)
                    if route == "seed":
                        reply.session_id = _session_id_in(body)
                if route in ("verify", "close"):
                    reply.session_id = cookie
                try:
                    await self.inner(inner_scope, receive, reply.send)
                finally:  # also when the server raised after its (held back) error reply
                    await reply.finish(scope, receive)
        except GymError as error:
            if reply.started:
                raise
            await error_response(error)(scope, receive, send)

    async def _read_post_body(self, scope: Scope, receive: Receive) -> bytes:
        """A POST's whole body, within the body limit and the per-part deadline, refused unless
        the server could read it and the mesh write it again (``refuse_unreadable_json``)."""
        refuse_declared_length(scope, self.max_body_bytes)
        body = await _read_body(receive, self.max_body_bytes)
        if not _is_form(scope):
            refuse_unreadable_json(body)
        return body

    def _entered(self, route: Route | None, identity: RolloutIdentity | None) -> AbstractAsyncContextManager[Any]:
        if route is None or self.checkpoint is None:
            return nullcontext()
        return self.checkpoint.admitted(route, identity)

    def _check_session(self, session_id: str | None, identity: RolloutIdentity | None) -> None:
        if session_id is None or session_id not in self.sessions:
            return
        session = self.sessions.get(session_id)
        if identity is not None and session.identity is not None and identity != session.identity:
            raise StaleAttempt(f"session {session_id} belongs to rollout {session.identity.capture_key}, "
                               f"not {identity.capture_key}")
        session.restored = None  # touched: exported afresh, under its current attempt

    def opened(self, session_id: str | None, identity: RolloutIdentity | None) -> str:
        """A 2xx seed: the session's id (kept in the table while the declaration needs it; a seed
        again under the same id replaces it)."""
        session_id = session_id or uuid.uuid4().hex
        if self.checkpoint is not None:
            self.sessions.add(self.checkpoint.seeded(Session(session_id, identity)))
        elif self.checkpoint_mode != "stateless":
            self.sessions.add(Session(session_id, identity))
        return session_id


class _Dispatch:
    """The shell's ASGI entry: our routes to ``outer``, everything else through ``shell.forward``."""

    def __init__(self, shell: ResourcesShell, outer: FastAPI) -> None:
        self.shell, self.outer = shell, outer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.outer(scope, receive, send)
            return
        try:
            identity, path = split_rollout_path(scope["path"])
        except GymError as error:
            await error_response(error)(scope, receive, send)
            return
        if path == "/health" or path.startswith(CONTROL_PREFIX + "/") or path == CONTROL_PREFIX:
            await self.outer(scope, receive, send)
            return
        token = CURRENT_IDENTITY.set(identity)
        try:
            await self.shell.forward(scope, receive, send, identity, path)
        finally:
            CURRENT_IDENTITY.reset(token)


class _Reply:
    """The server's reply on its way out: seed headers and cookie added, error replies rewritten."""

    def __init__(self, shell: ResourcesShell, send: Send, route: Route | None,
                 identity: RolloutIdentity | None) -> None:
        self.shell, self._send, self.route, self.identity = shell, send, route, identity
        self.session_id: str | None = None
        self.started = False
        self.error_status: int | None = None
        self.error_retry_after: str | None = None
        self.error_body = bytearray()
        self.error_done = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            await self._start(message)
        elif message["type"] == "http.response.body" and self.error_status is not None:
            room = MAX_ERROR_BODY_BYTES - len(self.error_body)
            self.error_body += message.get("body", b"")[: max(room, 0)]
            self.error_done = not message.get("more_body", False)
        else:
            await self._send(message)

    async def _start(self, message: Message) -> None:
        status = int(message["status"])
        if status >= 400:
            self.error_status = status  # held back: finish() answers it in our shape
            self.error_retry_after = _header(message, b"retry-after")
            return
        self.started = True
        if 200 <= status < 300 and self.route == "seed":
            session_id = self.shell.opened(self.session_id, self.identity)
            cookie = f"{self.shell.cookie_name}={session_id}; HttpOnly; Path=/; SameSite=lax"
            message = dict(message, headers=[*message.get("headers", []), *self.shell.headers(),
                                             (b"set-cookie", cookie.encode())])
        elif 200 <= status < 300 and self.route in ("verify", "close"):
            await self.shell.drop_session(self.session_id)
        await self._send(message)

    async def finish(self, scope: Scope, receive: Receive) -> None:
        """After the server returned: answer a held-back error reply in our shape."""
        if self.error_status is None or self.started:
            return
        self.started = True
        error = mapped_error(self.error_status, bytes(self.error_body), self.error_retry_after)
        await error_response(error)(scope, receive, self._send)


def _header(message: Message, name: bytes) -> str | None:
    for key, value in message.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def _cookie(scope: Scope, name: str) -> str | None:
    for key, value in scope.get("headers", []):
        if key != b"cookie":
            continue
        for part in value.decode("latin-1").split(";"):
            cookie_name, _, cookie_value = part.strip().partition("=")
            if cookie_name == name and _COOKIE_VALUE.fullmatch(cookie_value):
                return cookie_value
    return None


def _session_id_in(body: bytes) -> str | None:
    """The ``resources_session_id`` of a NeMo Gym seed body, when it is a valid session id."""
    try:
        parsed = json.loads(body) if body.strip() else None
    except ValueError:
        return None
    value = parsed.get("resources_session_id") if isinstance(parsed, dict) else None
    return value if isinstance(value, str) and SESSION_ID.fullmatch(value) else None


async def _read_body(receive: Receive, limit: int) -> bytes:
    """The request body: 413 past ``limit`` bytes, 408 when a part is ``BODY_PART_TIMEOUT_S`` late, 400
    when the client leaves before its end (a cut body never reaches the server)."""
    body = bytearray()
    while True:
        message = await next_body_part(receive)
        if message["type"] != "http.request":
            raise InvalidRequest("the client disconnected before its request body was read")
        body += message.get("body", b"")
        if len(body) > limit:
            raise PayloadTooLarge(too_large(limit))
        if not message.get("more_body", False):
            return bytes(body)


def _is_form(scope: Scope) -> bool:
    for key, value in scope.get("headers", ()):
        if key == b"content-type":
            return value.decode("latin-1").split(";")[0].strip().lower() in FORM_TYPES
    return False


# ---- the server's lifespan ------------------------------------------------------------------------


@asynccontextmanager
async def asgi_lifespan(app: ASGIApp) -> AsyncIterator[None]:
    """Run ``app``'s ASGI lifespan (startup on entry, shutdown on exit) as a context manager.

    An app that does not speak the lifespan protocol (it raises at once, or answers nothing else)
    is served without one, as uvicorn does.
    """
    to_app_send, to_app = anyio.create_memory_object_stream[Message](2)
    from_app_send, from_app = anyio.create_memory_object_stream[Message](2)
    state: MutableMapping[str, Any] = {}
    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": state}

    async def run() -> None:
        try:
            await app(scope, to_app.receive, from_app_send.send)
        finally:
            from_app_send.close()

    async with anyio.create_task_group() as group, to_app_send, to_app, from_app:
        group.start_soon(run)
        await to_app_send.send({"type": "lifespan.startup"})
        await _expect(from_app, "startup")
        try:
            yield
        finally:
            await to_app_send.send({"type": "lifespan.shutdown"})
            await _expect(from_app, "shutdown")


async def _expect(messages: Any, step: str) -> None:
    try:
        message = await messages.receive()
    except anyio.EndOfStream:  # the app has no lifespan
        return
    if message["type"] == f"lifespan.{step}.failed":
        raise RuntimeError(f"the server's {step} failed: {message.get('message', '')}")

