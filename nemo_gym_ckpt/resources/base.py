"""The resources-server base: tools, ``/seed_session``, ``/verify`` and per-session state.

A resources server is a subclass of ``ResourcesServer`` plus a ``create_app`` of two lines::

    class Operands(ToolArgs):
        a: int
        b: int

    class Calculator(ResourcesServer[Config]):
        checkpoint_mode = "stateless"
        checkpoint_verify = "replay"

        @tool
        async def add(self, args: Operands) -> int:
            \"\"\"Return a + b.\"\"\"
            return args.a + args.b

        async def verify(self, task: CalculatorTask) -> Verdict:
            text = final_text(task.response)
            return Verdict(reward=1.0 if text == task.expected_answer else 0.0)

    def create_app(ctx: ServerContext[Config]) -> FastAPI:
        return Calculator(ctx).build_app()

Routes (all also under ``/ng-rollout/<capture_key>/``):

- ``POST /seed_session`` with the task row (an agent's ``/run`` sends its whole row: NeMo Gym's
  ``_ng_`` keys name the rollout and stay out of the task), or with NeMo Gym's environment-server
  form ``{resources_session_id, episode_id, task_id, task_data}`` (the caller names the session;
  ``task_data`` is the task row; a repeat of the same id and episode answers the same session, an id
  used by another episode or closed before is a 400): opens a session, answers NeMo Gym's
  ``{"resources_session_id", "resources_tools": null, "sandbox_access": null}``, sets the session
  cookie (agents pass it back explicitly) and the checkpoint headers of docs/protocol.md section 7:
  ``x-ng-checkpoint-verify: replay|wait`` and, for restart-only servers, ``x-ng-checkpoint-restart: 1``;
- ``POST /verify`` with the task row plus ``response`` (a Responses API object): answers the
  request fields plus ``reward`` plus the server's own fields (the ``Verdict``);
- ``POST /<tool>`` per ``@tool`` method, its body the tool's arguments, its reply the tool's result
  as JSON text (the model reads it verbatim: a number is just ``5141``);
- ``GET /tools``: the OpenAI function-tool definitions (Responses API shape; ``?shape=chat`` for
  the Chat Completions shape);
- ``POST /close_session`` with ``{}`` or NeMo Gym's ``{resources_session_id, episode_id}``: drops the
  session the cookie (else the body) names and answers ``{"resources_session_id"}`` (idempotent); a
  session of another episode than the request's is refused, as for a tool call.
- ``POST /mcp``: the tools over MCP, when the settings (a ``ResourcesConfig``) say
  ``expose_tools_over_mcp: true`` (``nemo_gym_ckpt.resources.mcp``: covered like HTTP tool calls).

Methods are typed by their annotations: a tool's first parameter is a ``ToolArgs`` model (its JSON
schema is the tool's ``parameters``), ``verify``'s and ``initial_state``'s is a ``TaskRow`` model.
A method that also takes ``session: Session`` needs a live session: a call without the session
cookie, or with an unknown one, is a 400. Only servers that keep state (``checkpoint_mode`` other
than ``stateless``) keep a session table; a stateless server still hands out a cookie so agents
treat every server alike. A session remembers the rollout identity it was opened under, and a tool
call, ``/verify`` or ``/close_session`` that uses it under another rollout or attempt (its prefix,
else what its body names) is refused (409 ``stale_attempt``).

Checkpointing (docs/protocol.md section 7; ``docs/participants.md``, "Resources servers"). With the
mesh's ``checkpoint:`` block enabled, ``build_app`` mounts a participant (``ResourcesAdapter``):
every rollout-scoped request (seed, tools, verify, close) then needs a rollout identity (its
``/ng-rollout/<key>/``, else what its body names, else its session's: NeMo Gym's callers send no
prefix), waits
while a checkpoint is open and is refused ``stale_attempt`` for a retired attempt. The class
declares ``checkpoint_mode`` (``stateless``: sessions are membership only; ``exported``: session
state is saved through the hooks ``export_session``, ``restore_session``, ``park_session``;
``restart_only``, the default: never saved, its episodes start over after a crash) and
``checkpoint_verify`` (``wait``, the default, or ``replay``). ``retire_session`` frees what a
session holds whenever it is dropped. With checkpointing off none of this runs: no control route,
no waiting, and a stateless server keeps no sessions.
"""

from __future__ import annotations

import inspect
import json
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeVar, cast, get_type_hints

import orjson
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import Response

from nemo_gym_ckpt.bounds import MAX_ITEMS
from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK, Clock
from nemo_gym_ckpt.checkpoint.headers import RESTART_HEADER, VERIFY_HEADER
from nemo_gym_ckpt.checkpoint.mount import mount_checkpointing
from nemo_gym_ckpt.config import ServerConfig
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.errors import ConfigError, InvalidRequest, StaleAttempt
from nemo_gym_ckpt.identity import (
    RolloutIdentity,
    identity_of_episode_id,
    identity_of_row,
    request_identity,
    without_dispatch_keys,
)
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
from nemo_gym_ckpt.responses import last_message_text
from nemo_gym_ckpt.server import OrjsonResponse, create_app, declare_body, refuse_unencodable

if TYPE_CHECKING:
    from nemo_gym_ckpt.resources.mcp import McpTool

__all__ = [
    "CHECKPOINT_MODES",
    "CHECKPOINT_VERIFY_MODES",
    "EPISODE_SEED_KEYS",
    "EXPORTED_HOOKS",
    "RESTART_HEADER",
    "VERIFY_HEADER",
    "CheckpointMode",
    "CheckpointVerify",
    "CloseRequest",
    "EpisodeSeed",
    "ResourcesConfig",
    "ResourcesServer",
    "ResponseObject",
    "Session",
    "SessionTable",
    "TaskRow",
    "ToolArgs",
    "ToolSpec",
    "Verdict",
    "VerifyRequest",
    "final_text",
    "session_cookie_name",
    "tool",
]

RESERVED_ROUTES = frozenset({"seed_session", "verify", "tools", "close_session", "health", "ng-control"})
_TOOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")
_TOOL_MARK = "__ng_tool__"
EXPORTED_HOOKS = ("export_session", "restore_session", "park_session")

_C = TypeVar("_C", bound=ServerConfig)


# ---- payloads ------------------------------------------------------------------------------------


class ResourcesConfig(ServerConfig):
    """Settings every resources server may take: ``expose_tools_over_mcp`` (NeMo Gym's key)."""

    expose_tools_over_mcp: bool = False


class TaskRow(BaseModel):
    """A task row in the NeMo Gym shape; the task's own fields pass through."""

    model_config = ConfigDict(extra="allow")

    responses_create_params: dict[str, Any] | None = None


class ResponseObject(BaseModel):
    """The part of a Responses API object a verifier reads; everything else passes through."""

    model_config = ConfigDict(extra="allow")

    output: list[dict[str, Any]] = Field(max_length=MAX_ITEMS)


class VerifyRequest(TaskRow):
    """The body of ``/verify``: the task row plus the rollout's ``response``."""

    response: ResponseObject


class Verdict(BaseModel):
    """What ``verify`` decides: ``reward``; a server subclasses it to add its own typed fields."""

    reward: float


EPISODE_SEED_KEYS = frozenset({"resources_session_id", "episode_id", "task_id", "task_data"})
"""The fields of NeMo Gym's ``ResourcesSeedSessionRequest`` (an environment server's seed), exactly."""


class EpisodeSeed(BaseModel):
    """NeMo Gym's ``ResourcesSeedSessionRequest``: the caller names the session, its episode and task."""

    model_config = ConfigDict(extra="forbid")

    resources_session_id: str = Field(pattern=f"^{SESSION_ID.pattern}$")
    episode_id: dict[str, Any]
    task_id: dict[str, str]
    task_data: dict[str, Any]


class CloseRequest(BaseModel):
    """``/close_session``: NeMo Gym's ``{resources_session_id, episode_id}``, or nothing (the cookie names
    the session)."""

    model_config = ConfigDict(extra="forbid")

    resources_session_id: str | None = Field(None, max_length=128)
    episode_id: dict[str, Any] | None = None


class ToolArgs(BaseModel):
    """Base of tool argument models: unknown arguments are errors."""

    model_config = ConfigDict(extra="forbid")


def final_text(response: ResponseObject) -> str | None:
    """The text of the last ``message`` output item (its ``output_text`` parts), or None."""
    return last_message_text(response.output)


# ---- sessions ------------------------------------------------------------------------------------


# ---- tools ---------------------------------------------------------------------------------------


def tool(func: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Mark an ``async`` method as a tool, served at ``POST /<method name>``."""
    if not inspect.iscoroutinefunction(func):
        raise TypeError(f"tool {func.__name__} must be an async method")
    setattr(func, _TOOL_MARK, True)
    return func


@dataclass(frozen=True)
class ToolSpec:
    """One tool: its name, description, argument model, and whether it needs a session."""

    name: str
    description: str
    args_model: type[ToolArgs]
    takes_session: bool

    def definition(self, shape: Literal["responses", "chat"] = "responses") -> dict[str, Any]:
        """The OpenAI function-tool definition."""
        parameters = _schema_without_titles(self.args_model.model_json_schema())
        parameters.setdefault("properties", {})
        strict = set(parameters.get("required", ())) == set(parameters["properties"])
        function = {"name": self.name, "description": self.description, "parameters": parameters}
        if shape == "chat":
            return {"type": "function", "function": {**function, "strict": strict}}
        return {"type": "function", **function, "strict": strict}


def _schema_without_titles(schema: Any) -> Any:
    """A JSON schema without pydantic's ``title`` keys (a property named "title" stays)."""
    if isinstance(schema, list):
        return [_schema_without_titles(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {key: _named_schemas(value) if key in ("properties", "$defs") else _schema_without_titles(value)
            for key, value in schema.items() if key != "title"}


def _named_schemas(mapping: Any) -> Any:
    if not isinstance(mapping, dict):
        return _schema_without_titles(mapping)
    return {name: _schema_without_titles(sub) for name, sub in mapping.items()}


@dataclass(frozen=True)
class _Signature:
    """A typed method (unbound): its payload model and whether it takes ``session``."""

    func: Callable[..., Awaitable[Any]]
    model: type[BaseModel]
    takes_session: bool


def _signature(func: Callable[..., Awaitable[Any]], base: type[BaseModel], owner: str) -> _Signature:
    params = list(inspect.signature(func).parameters.values())[1:]
    names = [param.name for param in params]
    where = f"{owner}.{func.__name__}"
    if not params or names[1:] not in ([], ["session"]):
        raise TypeError(f"{where} must take (self, <model>) or (self, <model>, session), got {names}")
    model = get_type_hints(func).get(params[0].name)
    if not (isinstance(model, type) and issubclass(model, base)):
        raise TypeError(f"{where}: the first parameter must be annotated with a {base.__name__} subclass")
    return _Signature(func, model, takes_session=len(params) == 2)


def _tool_spec(name: str, func: Callable[..., Awaitable[Any]], owner: str) -> ToolSpec:
    if not _TOOL_NAME.match(name) or name in RESERVED_ROUTES:
        raise TypeError(f"{owner}.{name}: {name!r} cannot be a tool name")
    description = (inspect.getdoc(func) or "").split("\n\n")[0].replace("\n", " ").strip()
    if not description:
        raise TypeError(f"{owner}.{name}: a tool needs a docstring (its description for the model)")
    signature = _signature(func, ToolArgs, owner)
    args_model = cast(type[ToolArgs], signature.model)  # _signature checked it subclasses ToolArgs
    return ToolSpec(name, description, args_model, signature.takes_session)


# ---- request plumbing ----------------------------------------------------------------------------

_M = TypeVar("_M", bound=BaseModel)


async def _read_json(request: Request) -> Any:
    """The request's JSON (an empty body reads as ``{}``), refused (400) unless the mesh can write it
    again: a reply echoes it (``/verify``), a record or a call may carry it."""
    raw = await request.body()
    try:
        data = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError as error:
        raise InvalidRequest(f"request body is not valid JSON: {error}") from None
    return refuse_unencodable(data)


async def _read_body(request: Request) -> dict[str, Any]:
    """The request's JSON object (``_read_json``)."""
    data = await _read_json(request)
    if not isinstance(data, dict):
        raise InvalidRequest("the request body is a JSON object")
    return data


def _validated(model: type[_M], data: Any) -> _M:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise InvalidRequest(_validation_detail(error)) from None


async def _read_model(request: Request, model: type[_M]) -> _M:
    return _validated(model, await _read_json(request))


def _validation_detail(error: ValidationError) -> str:
    parts = []
    for item in error.errors()[:5]:
        loc = ".".join(str(part) for part in item["loc"])
        parts.append(f"{loc or 'body'}: {item['msg']}")
    return "; ".join(parts)


def _tool_output(result: Any) -> Response:
    """The tool's result as compact JSON text (exact for any int, non-ASCII kept)."""
    body = json.dumps(result, separators=(",", ":"), ensure_ascii=False)
    return Response(content=body, media_type="application/json")


# ---- the base ------------------------------------------------------------------------------------


class ResourcesServer(Generic[_C]):
    """Base of every resources server; see the module docstring for the routes and the rules.

    A subclass defines ``async def verify(self, task: <VerifyRequest subclass>[, session]) ->
    Verdict``, optionally ``async def initial_state(self, task: <TaskRow subclass>) -> dict`` (the
    JSON state of a new session) and ``@tool`` methods.
    """

    checkpoint_mode: ClassVar[CheckpointMode] = "restart_only"
    checkpoint_verify: ClassVar[CheckpointVerify] = "wait"
    tool_specs: ClassVar[dict[str, ToolSpec]] = {}
    verify_signature: ClassVar[_Signature]
    seed_signature: ClassVar[_Signature]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.checkpoint_mode not in CHECKPOINT_MODES:
            raise TypeError(f"{cls.__name__}.checkpoint_mode must be one of {CHECKPOINT_MODES}")
        if cls.checkpoint_verify not in CHECKPOINT_VERIFY_MODES:
            raise TypeError(f"{cls.__name__}.checkpoint_verify must be one of {CHECKPOINT_VERIFY_MODES}")
        verify = getattr(cls, "verify", None)
        if not inspect.iscoroutinefunction(verify):
            raise TypeError(f"{cls.__name__} must define `async def verify(self, task)`")
        cls.verify_signature = _signature(verify, VerifyRequest, cls.__name__)
        cls.seed_signature = _seed_signature(cls)
        cls.tool_specs = {
            name: _tool_spec(name, attr, cls.__name__)
            for klass in reversed(cls.__mro__) for name, attr in vars(klass).items()
            if getattr(attr, _TOOL_MARK, False)
        }
        cls._check_sessions()
        cls._check_hooks()

    @classmethod
    def _check_sessions(cls) -> None:
        needy = [spec.name for spec in cls.tool_specs.values() if spec.takes_session]
        needy += ["verify"] if cls.verify_signature.takes_session else []
        if needy and not cls.keeps_sessions():
            raise TypeError(f"{cls.__name__} is stateless, but {needy} take a session")

    @classmethod
    def _check_hooks(cls) -> None:
        """Checkpoint hooks only where the mode uses them: they would silently never run."""
        overridden = [name for name in (*EXPORTED_HOOKS, "retire_session", "release_session")
                      if getattr(cls, name) is not getattr(ResourcesServer, name)]
        unused = overridden if not cls.keeps_sessions() else [
            name for name in overridden if name in EXPORTED_HOOKS and cls.checkpoint_mode != "exported"]
        if unused:
            raise TypeError(f"{cls.__name__} is {cls.checkpoint_mode}: {unused} never run "
                            f"(export, restore and park are for exported servers)")

    @classmethod
    def keeps_sessions(cls) -> bool:
        """Whether this server keeps a session table (derived from its checkpoint mode)."""
        return cls.checkpoint_mode != "stateless"

    def __init__(self, ctx: ServerContext[_C]) -> None:
        self.ctx = ctx
        self.settings: _C = ctx.settings
        self.sessions = SessionTable()
        self.cookie_name = session_cookie_name(ctx.name)
        self.checkpoint: ResourcesAdapter | None = None  # set by build_app when checkpointing is on

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """Startup and shutdown of the server's own resources; override to add some."""
        yield

    async def initial_state(self, task: Any) -> dict[str, Any]:
        """The JSON state of a new session; override with ``task`` annotated by a TaskRow subclass."""
        return {}

    # -- checkpoint hooks (docs/participants.md, "Resources servers")

    async def export_session(self, session: Session) -> dict[str, Any]:
        """Exported servers: the session's state as a JSON object, for its checkpoint record.

        Called while the checkpoint is open, after ``park_session``, with no tool call in flight.
        The default exports ``session.state`` as it is.
        """
        return session.state

    async def restore_session(self, state: Any) -> dict[str, Any]:
        """Exported servers: check a state read from a checkpoint; return the state to install.

        No side effects: a restore installs every session or none. Raise ``ValueError`` (a
        pydantic ``ValidationError`` is one) for a malformed state: the restore then fails with
        ``invalid_checkpoint_state`` and nothing is installed. The default wants a JSON object.
        """
        if not isinstance(state, dict):
            raise ValueError(f"a session state must be a JSON object, got {type(state).__name__}")
        return state

    async def park_session(self, session: Session) -> None:
        """Exported servers: quiesce the session (settle background work) so that its export is
        consistent. Called once per checkpoint, at prepare, when no tool call of it is in flight;
        the session keeps being used after the checkpoint. The default has nothing to settle."""

    async def release_session(self, session: Session) -> None:
        """A commit with ``stop: true`` is durable and the mesh is about to stop: free what the session
        holds outside its JSON state (its record already holds the rest). The session stays in the
        table. The default does what ``retire_session`` does; a failure is logged, never fatal."""
        await self.retire_session(session)

    async def retire_session(self, session: Session) -> None:
        """Free what the session holds outside its JSON state (a process, a file, a connection).

        Called after the session left the table, whenever it is dropped: ``/close_session``, a
        retire or forget of its rollout, a restored session that a commit left out. The default
        holds nothing."""

    async def drop_session(self, session_id: str | None) -> bool:
        """Remove a session and free it (``retire_session``); ``False`` when there was none (a closed
        session's id is remembered by ``/close_session`` itself)."""
        session = self.sessions.pop(session_id)
        if session is None:
            return False
        await self.retire_session(session)
        return True

    # -- the app

    def build_app(self, *, clock: Clock = SYSTEM_CLOCK) -> FastAPI:
        """The server's app; a checkpoint participant too when the mesh enables checkpointing."""
        if (self.settings.num_workers or 1) > 1 and self.keeps_sessions():
            raise ConfigError(f"{self.ctx.name}: num_workers > 1 needs a stateless resources server; "
                              f"{type(self).__name__} is {self.checkpoint_mode} and keeps session state in "
                              "one process (docs/protocol.md section 13)", key=f"{self.ctx.name}.num_workers")
        app = create_app(self.ctx.name, lifespan=self.lifespan)
        app.add_api_route("/seed_session", self._seed_route, methods=["POST"],
                          openapi_extra=declare_body(self.seed_signature.model))
        app.add_api_route("/verify", self._verify_route, methods=["POST"],
                          openapi_extra=declare_body(self.verify_signature.model))
        app.add_api_route("/close_session", self._close_route, methods=["POST"])
        app.add_api_route("/tools", self._tools_route, methods=["GET"])
        for spec in self.tool_specs.values():
            app.add_api_route(f"/{spec.name}", self._tool_route(spec), methods=["POST"],
                              openapi_extra=declare_body(spec.args_model))
        if getattr(self.settings, "expose_tools_over_mcp", False):
            def admitted(request: Request) -> AbstractAsyncContextManager[Any]:
                return self._entered("tool", self._identity(request))

            from nemo_gym_ckpt.resources.mcp import McpExposure  # the mcp package: only where tools go over MCP

            McpExposure(self.ctx.name, self._mcp_tools(), self._mcp_call, admitted).mount(app)
        adapter = ResourcesAdapter(self)
        participant = mount_checkpointing(app, self.ctx, adapter, kind="resources", clock=clock)
        if participant is not None:
            adapter.participant, self.checkpoint = participant, adapter
        return app

    def tool_definitions(self, shape: Literal["responses", "chat"] = "responses") -> list[dict[str, Any]]:
        return [spec.definition(shape) for spec in self.tool_specs.values()]

    def checkpoint_headers(self) -> dict[str, str]:
        """The headers of every ``/seed_session`` reply (docs/protocol.md section 7)."""
        headers: dict[str, str] = {VERIFY_HEADER: self.checkpoint_verify}
        if self.checkpoint_mode == "restart_only":
            headers[RESTART_HEADER] = "1"
        return headers

    # -- routes

    def _entered(self, route: Route, identity: RolloutIdentity | None) -> AbstractAsyncContextManager[Any]:
        """Admission of a rollout-scoped request: the participant's when checkpointing is on."""
        return self.checkpoint.admitted(route, identity) if self.checkpoint is not None else nullcontext()

    def _identity(self, request: Request, named: RolloutIdentity | None = None) -> RolloutIdentity | None:
        """Who a request is for: its ``/ng-rollout/`` prefix, else what its body names, else its session's."""
        identity = request_identity(named)
        if identity is not None:
            return identity
        session = self.sessions.find(request.cookies.get(self.cookie_name))
        return session.identity if session is not None else None

    async def _seed_route(self, request: Request) -> Response:
        body = await _read_body(request)
        named: RolloutIdentity | None
        session_id: str | None
        if {"resources_session_id", "episode_id"} <= body.keys():  # NeMo Gym's environment-server form
            seed = _validated(EpisodeSeed, body)
            named, session_id, row = identity_of_episode_id(seed.episode_id), seed.resources_session_id, seed.task_data
        else:  # the task row, as an agent's /run sends it
            named, session_id, row = identity_of_row(body), None, without_dispatch_keys(body)
        task = _validated(self.seed_signature.model, row)
        identity = self._identity(request, named)
        async with self._entered("seed", identity):
            session_id = await self._open(task, identity, session_id)
        reply = OrjsonResponse({"resources_session_id": session_id, "resources_tools": None, "sandbox_access": None},
                               headers=self.checkpoint_headers())
        reply.set_cookie(self.cookie_name, session_id, httponly=True, samesite="lax")
        return reply

    async def _open(self, task: BaseModel, identity: RolloutIdentity | None, session_id: str | None) -> str:
        """The seeded session's id: a new session, or the one a repeated seed of the same id and episode names."""
        if not (self.keeps_sessions() or self.checkpoint is not None):  # stateless: membership only
            return session_id or uuid.uuid4().hex
        existing = self.sessions.find(session_id)
        if existing is not None:
            if existing.identity != identity:
                raise InvalidRequest(f"session {session_id!r} belongs to another episode")
            return existing.session_id
        session = self.sessions.open(identity, await self.initial_state(task), session_id)
        if self.checkpoint is not None:
            self.checkpoint.seeded(session)
        return session.session_id

    async def _verify_route(self, request: Request) -> Response:
        signature = self.verify_signature
        body = await _read_body(request)
        task = _validated(signature.model, without_dispatch_keys(body))
        identity = self._identity(request, identity_of_row(body))
        async with self._entered("verify", identity):
            args = (task, self._session(request, identity)) if signature.takes_session else (task,)
            verdict = await signature.func(self, *args)
        row = task.model_dump(mode="json", exclude_unset=True)
        return OrjsonResponse({**row, **verdict.model_dump(mode="json")})

    async def _close_route(self, request: Request) -> Response:
        body = await _read_body(request)
        close = _validated(CloseRequest, body)
        session_id = request.cookies.get(self.cookie_name) or close.resources_session_id
        named = identity_of_episode_id(close.episode_id) if close.episode_id is not None else None
        identity = self._identity(request, named)
        async with self._entered("close", identity):
            session = self.sessions.find(session_id)
            if session is not None:
                _refuse_another_episode(session, identity)
            if not await self.drop_session(session_id) and self.checkpoint is not None and identity is not None:
                await self.checkpoint.close_elsewhere(identity)  # another worker of this server may hold it
        if session_id:
            self.sessions.note_closed(session_id)
        reply = OrjsonResponse({"resources_session_id": session_id or ""})
        reply.delete_cookie(self.cookie_name)
        return reply

    async def _tools_route(self, shape: Literal["responses", "chat"] = "responses") -> list[dict[str, Any]]:
        return self.tool_definitions(shape)

    def _tool_route(self, spec: ToolSpec) -> Callable[[Request], Awaitable[Response]]:
        method = getattr(self, spec.name)

        async def call_tool(request: Request) -> Response:
            args = await _read_model(request, spec.args_model)
            identity = self._identity(request)
            async with self._entered("tool", identity):
                if spec.takes_session:
                    return _tool_output(await method(args, self._session(request, identity)))
                return _tool_output(await method(args))

        call_tool.__name__ = f"tool_{spec.name}"
        return call_tool

    def _mcp_tools(self) -> list[McpTool]:
        from nemo_gym_ckpt.resources.mcp import McpTool

        return [McpTool(spec.name, spec.description, spec.definition()["parameters"])
                for spec in self.tool_specs.values()]

    async def _mcp_call(self, name: str, arguments: dict[str, Any], request: Request) -> Any:
        """One tool called over MCP: the same method and session as ``POST /<name>``."""
        spec = self.tool_specs[name]
        try:
            args = spec.args_model.model_validate(arguments)
        except ValidationError as error:
            raise InvalidRequest(_validation_detail(error)) from None
        method = getattr(self, spec.name)
        if spec.takes_session:
            return await method(args, self._session(request, self._identity(request)))
        return await method(args)

    def _session(self, request: Request, identity: RolloutIdentity | None) -> Session:
        """The request's session (by cookie), refused when it belongs to another episode than the
        ``identity`` the request was admitted under."""
        session = self.sessions.get(request.cookies.get(self.cookie_name))
        _refuse_another_episode(session, identity)
        session.restored = None  # touched: its next export is fresh, under its current attempt
        return session


def _refuse_another_episode(session: Session, identity: RolloutIdentity | None) -> None:
    """``StaleAttempt`` (409) when a request of ``identity`` uses a session opened under another
    rollout or attempt (a session or a request without identity belongs to anyone)."""
    if identity is not None and session.identity is not None and identity != session.identity:
        raise StaleAttempt(
            f"session {session.session_id} belongs to rollout {session.identity.capture_key}, "
            f"not {identity.capture_key}"
        )


def _seed_signature(cls: type[ResourcesServer[Any]]) -> _Signature:
    """``initial_state``'s task model (``TaskRow`` for the default); it never takes a session."""
    if cls.initial_state is ResourcesServer.initial_state:
        return _Signature(cls.initial_state, TaskRow, takes_session=False)
    signature = _signature(cls.initial_state, TaskRow, cls.__name__)
    if signature.takes_session:
        raise TypeError(f"{cls.__name__}.initial_state(self, task) takes no session: it makes one")
    if not cls.keeps_sessions():
        raise TypeError(f"{cls.__name__} is stateless: it has no session state to initialise")
    return signature
