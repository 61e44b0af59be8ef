"""The environment-server side of a rollout: ``POST /run`` serving a ``Program``, and the agent calls.

An environment server declares its settings as a subclass of ``EnvironmentConfig``, its task rows as
a subclass of ``EpisodeTask``, and its episode as a ``Program`` (``nemo_gym_ckpt.environment.episode``)::

    def create_app(ctx: ServerContext[Config], *, clock: Clock = SYSTEM_CLOCK) -> FastAPI:
        app = create_app_base(ctx.name)
        mount_environment(app, ctx, MyEnvironment(ctx).program, task_model=MyTask, clock=clock)
        return app

``mount_environment`` mounts ``POST /run`` and, when the mesh enables checkpointing, makes the
server a participant of kind ``environment`` (``nemo_gym_ckpt.environment.adapter``): every
``/run`` then needs a rollout identity, parks at boundaries during a checkpoint and continues from
a restored boundary when it is the next attempt of a checkpointed episode. With checkpointing off
it is ``mount_run``: no control route, no waiting.

``POST /run`` (called under ``/ng-rollout/<capture_key>/``) takes a task row, runs one episode of
the program for the request's rollout identity and answers the final state's ``result`` (the
rollout row). A row that fails validation is a 400 before any step runs, and so is a row nested too
deep for the episode to keep (``run_levels``: the state wraps it in one level, a record in two
more); a failed step answers its error, named after the step. A ``/run`` without a rollout prefix
runs under a fresh ``anon-...`` id; a second ``/run`` of a capture key while one runs is a 400,
checkpointing on or off (two episodes would share the agent's session of that key).

``AgentClient`` makes the two agent calls of an episode: ``invoke`` (``POST /v1/responses`` with the
``x-ng-agent-activation`` header and the resources cookies passed explicitly; an answer that is no
Responses object, whose output items are not all objects, or that cannot be written as JSON again is
``upstream_error``) and ``close``. A
reply carrying ``x-ng-checkpoint-restart: 1`` comes from a restart-only agent: ``AgentReply.restart``
says so, and the client remembers it (``restart_only``) so later episodes are restarts from their
first step.

Token arrays after a restore: records never carry them (docs/protocol.md section 6), so an episode
restored from a boundary holds the agent's output items without them. A step that keeps agent
items notes with ``note_token_arrays`` that they came with token arrays; a later step passes them
through ``AgentClient.refilled``, which, when the note is there and a model item now lacks them
(the boundary came from a record), asks the agent to put them back (``POST
/v1/responses/refill`` under the episode's capture key: the agent knows where they are kept, the
environment only knows that records strip them). The agent's answer is taken only if it changes
nothing but token arrays; an agent that cannot answer leaves the items as they are (logged).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self, cast

import httpx
import orjson
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from nemo_gym_ckpt.aggregate_metrics import mount_aggregate_metrics
from nemo_gym_ckpt.capture import TOKEN_ARRAYS, without_token_arrays
from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK, Clock
from nemo_gym_ckpt.checkpoint.headers import ACTIVATION_HEADER, CLOSE_HEADER, RESTART_HEADER
from nemo_gym_ckpt.checkpoint.mount import mount_checkpointing
from nemo_gym_ckpt.client import MeshClient, decode_json
from nemo_gym_ckpt.config import ServerConfig, ServerRef
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.environment.adapter import RECORD_LEVELS, EpisodesAdapter, RunLimits
from nemo_gym_ckpt.environment.capacity import DEFAULT_MAX_ROLLOUTS, RUN_PATH, RolloutCapacity, RunAdmission
from nemo_gym_ckpt.environment.episode import (
    NO_HOOKS,
    RESULT_LEVELS,
    Episode,
    EpisodeHooks,
    Program,
    StepBudget,
    StepMode,
    run_episode,
)
from nemo_gym_ckpt.errors import BadInput, GymError, InternalError, InvalidRequest, StorageError, UpstreamError
from nemo_gym_ckpt.identity import (
    RolloutIdentity,
    identity_of_episode_id,
    identity_of_row,
    request_identity,
    without_attempt_keys,
    without_dispatch_keys,
)
from nemo_gym_ckpt.server import OrjsonResponse, declare_body, refuse_unencodable

__all__ = [
    "CLOSE_REPLAYS_NOTE",
    "EPISODE_REQUEST_KEYS",
    "REFILL_PATH",
    "TOKEN_ARRAYS_NOTE",
    "AgentClient",
    "AgentReply",
    "EnvironmentConfig",
    "EpisodeTask",
    "RunRequest",
    "Runner",
    "close_step_mode",
    "cookies_of",
    "episode_failure",
    "episode_reply",
    "is_model_item",
    "lacks_token_arrays",
    "mount_environment",
    "mount_run",
    "note_agent_close",
    "note_token_arrays",
    "read_run",
    "read_task",
    "run_levels",
    "serve_run",
    "task_row_of",
]

logger = logging.getLogger(__name__)

EPISODE_REQUEST_KEYS = frozenset({"episode_id", "task"})
"""The keys of NeMo Gym's episode request (``BaseEpisodeRequest``), exactly."""
TASK_DATA = "task_data"
COLLECTOR_KEYS = frozenset({"ng_trajectory", "ng_model_call_capture", "ng_perf"})
"""Keys NeMo Gym's collector writes itself (besides ``_ng_*``): never in an episode's result."""
FAILURE_REASON_CHARS = 2000
REFILL_PATH = "/v1/responses/refill"
"""The agent route that puts token arrays back on output items (rollout-scoped)."""
AGENTS_TYPE = "responses_api_agents"
TOKEN_ARRAYS_NOTE = "agent_token_arrays"
"""The state key ``note_token_arrays`` sets: the agent's items came with token arrays."""
CLOSE_REPLAYS_NOTE = "agent_close_replays"
"""The state key ``note_agent_close`` sets: the agent's last activation reply said its ``/close`` may
run again."""


class EnvironmentConfig(ServerConfig):
    """Settings every environment server has: its agent and its timeouts (NeMo Gym's names where it has them).

    ``max_concurrent_episodes`` and ``queue_timeout_seconds`` are NeMo Gym's episode queue; here they
    must stay unset (no queue: every ``/run`` starts at once).
    """

    renamed_keys: ClassVar[Mapping[str, str]] = {
        "agent": "agent_server",
        "episode_timeout_s": "default_episode_timeout_seconds",
        "cleanup_timeout_s": "cleanup_timeout_seconds",
    }

    agent_server: ServerRef
    """The agent instance (``type: responses_api_agents``, which may be left out as NeMo Gym allows)."""
    default_episode_timeout_seconds: float | None = Field(3600.0, gt=0)
    """Time an episode may spend inside its steps (parked time is not charged); null: no limit."""
    call_timeout_s: float = Field(120.0, gt=0)
    """Deadline of each short call (seed, close, verify)."""
    agent_timeout_s: float = Field(3600.0, gt=0)
    """Deadline of one agent activation (a whole model/tool loop)."""
    cleanup_timeout_seconds: float = Field(30.0, gt=0)
    max_rollouts_in_flight: int | None = Field(DEFAULT_MAX_ROLLOUTS, ge=1, le=10_000_000)
    """``/run`` calls run at once; the next is refused up front (429 ``capacity_exceeded``); null: no limit."""
    overload_retry_after_s: float = Field(1.0, ge=1.0, le=60.0)
    """The ``Retry-After`` of that refusal."""
    max_concurrent_episodes: int | None = None
    queue_timeout_seconds: float | None = None

    @field_validator("agent_server", mode="before")
    @classmethod
    def _agent_type_by_default(cls, value: Any) -> Any:
        if isinstance(value, dict) and "type" not in value:
            return {**value, "type": AGENTS_TYPE}
        return value

    @field_validator("agent_server")
    @classmethod
    def _an_agent(cls, ref: ServerRef) -> ServerRef:
        if ref.type != AGENTS_TYPE:
            raise ValueError(f"agent_server must be a {AGENTS_TYPE} instance, got {ref.type}")
        return ref

    @model_validator(mode="after")
    def _no_episode_queue(self) -> Self:
        if self.max_concurrent_episodes is not None or self.queue_timeout_seconds is not None:
            raise ValueError("max_concurrent_episodes and queue_timeout_seconds (NeMo Gym's episode queue) are "
                             "not supported here: leave them null")
        return self


class EpisodeTask(BaseModel):
    """A task row in the NeMo Gym shape; the task's own fields pass through unchanged."""

    model_config = ConfigDict(extra="allow")

    responses_create_params: dict[str, Any]

    @field_validator("responses_create_params")
    @classmethod
    def _has_input(cls, value: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(value.get("input"), str | list):
            raise ValueError("must carry 'input' (a string or a list of input items)")
        return value


def run_levels(*, checkpointing: bool) -> int:
    """Levels an episode wraps a ``/run`` row in: the final state's ``result`` (one), and with
    checkpointing on the record around each boundary's state (two more). A row that cannot be
    written that much deeper is refused up front."""
    return RESULT_LEVELS + (RECORD_LEVELS if checkpointing else 0)


def _loaded_object(raw: bytes, what: str) -> dict[str, Any]:
    """The JSON object of a body, not yet checked to be writable again."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise InvalidRequest(f"request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise InvalidRequest(f"{what} is a JSON object")
    return data


def _writable(data: dict[str, Any], what: str, levels: int = 0) -> dict[str, Any]:
    """``data`` if it can be written as JSON ``levels`` levels deeper (``InvalidRequest`` otherwise)."""
    return cast(dict[str, Any], refuse_unencodable(data, what, levels=levels))


def _check_task(data: dict[str, Any], model: type[EpisodeTask], where: str = "task row") -> None:
    try:
        model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        loc = ".".join(str(part) for part in first["loc"]) or "body"
        raise InvalidRequest(f"{where} {loc}: {first['msg']}") from None


def read_task(raw: bytes, model: type[EpisodeTask]) -> dict[str, Any]:
    """Validate a task row; answers the row as sent (``InvalidRequest`` when it is not one)."""
    data = _writable(_loaded_object(raw, "a task row"), "a task row")
    _check_task(data, model)
    return data


@dataclass(frozen=True)
class RunRequest:
    """One ``/run``: the rollout it is for, the task row, and the task id of an episode request."""

    identity: RolloutIdentity | None
    task: dict[str, Any]
    task_id: dict[str, str] | None = None
    """NeMo Gym's ``TaskId`` when the request was an episode request ``{episode_id, task}``."""


def read_run(raw: bytes, model: type[EpisodeTask], levels: int = RESULT_LEVELS) -> RunRequest:
    """A ``/run`` body: a task row (NeMo Gym's dispatch keys read as its identity; the attempt's keys left
    out of the task, the task and rollout index kept for the verifier) or NeMo Gym's episode request;
    the identity joined with the ``/ng-rollout/`` prefix. The task row must be writable as JSON
    ``levels`` levels deeper (``run_levels``: what the episode wraps it in)."""
    data = _loaded_object(raw, "a /run body")
    if set(data) == EPISODE_REQUEST_KEYS:
        return _episode_request(_writable(data, "a /run body"), model, levels)
    _writable(data, "a /run row", levels)  # its attempt keys are numbers: as deep as the task
    task = without_attempt_keys(data)
    _check_task(task, model)
    return RunRequest(request_identity(identity_of_row(data)), task)


def _episode_request(data: dict[str, Any], model: type[EpisodeTask], levels: int) -> RunRequest:
    identity = identity_of_episode_id(data["episode_id"])
    task = data["task"]
    if not isinstance(task, dict) or set(task) != {"task_id", "task_input"}:
        raise InvalidRequest("an episode request's task is {task_id, task_input}")
    task_id = task["task_id"]
    if (not isinstance(task_id, dict) or set(task_id) != {"taskset", "task_id"}
            or not all(isinstance(value, str) for value in task_id.values())):
        raise InvalidRequest("task.task_id is {taskset, task_id}, two strings")
    row = task_row_of(task["task_input"])
    _writable(row, "the row of task.task_input", levels)
    _check_task(row, model, "task.task_input")
    return RunRequest(request_identity(identity), row, dict(task_id))


def task_row_of(task_input: Any) -> dict[str, Any]:
    """The task row of an episode's ``task_input``: the row itself, or NeMo Gym's single-agent form
    ``{responses_create_params, task_data: {...}}`` with ``task_data``'s fields laid flat."""
    if not isinstance(task_input, dict):
        raise InvalidRequest("task.task_input is a JSON object")
    data = task_input.get(TASK_DATA)
    if data is None:
        return dict(task_input)
    if not isinstance(data, dict):
        raise InvalidRequest("task.task_input.task_data is a JSON object")
    return {**data, **{key: value for key, value in task_input.items() if key != TASK_DATA}}


def _collector_key(key: str) -> bool:
    return key.startswith("_ng_") or key in COLLECTOR_KEYS


def episode_reply(run: RunRequest, outcome: dict[str, Any] | GymError, program: Program) -> dict[str, Any]:
    """NeMo Gym's ``BaseEpisodeResponse``: ``{episode_id, task_id}`` and ``result`` or ``failure``."""
    assert run.identity is not None and run.task_id is not None
    reply: dict[str, Any] = {"episode_id": run.identity.to_json(), "task_id": run.task_id}
    if isinstance(outcome, GymError):
        reply["failure"] = episode_failure(outcome, program)
    else:
        reply["result"] = {key: value for key, value in outcome.items() if not _collector_key(key)}
    return reply


def episode_failure(error: GymError, program: Program) -> dict[str, Any]:
    """NeMo Gym's ``EpisodeFailure`` of an error: its detail, whether a retry could help, its code, its stage."""
    step = error.fields.get("step")
    stage: str | None = "admission"  # an error of no step: the episode was not let in, or not continued
    if isinstance(step, str):
        stage = program.steps[step].stage if step in program.steps else None
    failure: dict[str, Any] = {
        "failure_reason": error.detail[:FAILURE_REASON_CHARS],
        "terminal": isinstance(error, BadInput | StorageError | InternalError),
        "failure_kind": error.code,
    }
    if stage is not None:
        failure["stage"] = stage
    return failure


Runner = Callable[[RolloutIdentity | None, dict[str, Any]], Awaitable[Mapping[str, Any]]]
"""Runs one episode for an identity and a task row; answers its final state."""


async def serve_run(
    request: Request, task_model: type[EpisodeTask], program: Program, runner: Runner, levels: int = RESULT_LEVELS
) -> Any:
    """One ``/run``: a row's reply is the rollout row; an episode request's is a ``BaseEpisodeResponse``
    (a failed episode answers 200 with its ``failure``; a body that is no request is still a 400).
    ``levels``: what the episode wraps the row in (``run_levels``)."""
    run = read_run(await request.body(), task_model, levels)
    if run.task_id is None:  # the collector stamps its dispatch keys on the row itself
        return OrjsonResponse(without_dispatch_keys(_result(await runner(run.identity, run.task))))
    try:
        outcome: dict[str, Any] | GymError = _result(await runner(run.identity, run.task))
    except GymError as error:
        outcome = error
    return OrjsonResponse(episode_reply(run, outcome, program))


def mount_run(
    app: FastAPI,
    program: Program,
    settings: EnvironmentConfig,
    *,
    task_model: type[EpisodeTask] = EpisodeTask,
    hooks: EpisodeHooks = NO_HOOKS,
) -> None:
    """Mount ``POST /run``: one episode of ``program`` per call, answering its ``result``; and
    ``POST /aggregate_metrics``. A second ``/run`` of a capture key while one runs is refused (400),
    as with checkpointing on: the agent and the model keep one session per capture key."""

    running: set[str] = set()

    async def runner(identity: RolloutIdentity | None, task: dict[str, Any]) -> Mapping[str, Any]:
        identity = identity or RolloutIdentity(f"anon-{uuid.uuid4().hex[:16]}")
        key = identity.capture_key
        if key in running:
            raise InvalidRequest(f"episode {key} is already running; wait for it or dispatch another rollout")
        running.add(key)
        try:
            return await run_episode(
                program, Episode.start(identity, task, program), hooks=hooks,
                budget=StepBudget(settings.default_episode_timeout_seconds),
                cleanup_timeout_s=settings.cleanup_timeout_seconds,
            )
        finally:
            running.discard(key)

    async def run(request: Request) -> Any:
        return await serve_run(request, task_model, program, runner, run_levels(checkpointing=False))

    app.add_api_route(RUN_PATH, run, methods=["POST"], openapi_extra=declare_body(task_model))
    _bound_runs(app, settings)
    mount_aggregate_metrics(app)


def _result(final: Mapping[str, Any]) -> dict[str, Any]:
    result = final.get("result")
    if not isinstance(result, dict):
        raise InternalError("the episode ended without a result")
    return result


def mount_environment(
    app: FastAPI,
    ctx: ServerContext[Any],
    program: Program,
    *,
    task_model: type[EpisodeTask] = EpisodeTask,
    clock: Clock = SYSTEM_CLOCK,
) -> EpisodesAdapter | None:
    """Mount ``POST /run`` for ``program`` and ``POST /aggregate_metrics``; a participant too when
    the mesh enables checkpointing.

    Answers the adapter (``None`` when checkpointing is off and ``/run`` is plain ``mount_run``).
    """
    settings = cast(EnvironmentConfig, ctx.settings)
    limits = RunLimits(settings.default_episode_timeout_seconds, settings.cleanup_timeout_seconds)
    adapter = EpisodesAdapter(program, limits)
    participant = mount_checkpointing(app, ctx, adapter, kind="environment", clock=clock)
    if participant is None:
        mount_run(app, program, settings, task_model=task_model)
        return None
    adapter.participant = participant

    async def run(request: Request) -> Any:
        return await serve_run(request, task_model, program, adapter.run, run_levels(checkpointing=True))

    app.add_api_route(RUN_PATH, run, methods=["POST"], openapi_extra=declare_body(task_model))
    _bound_runs(app, settings)
    mount_aggregate_metrics(app)
    return adapter


def _bound_runs(app: FastAPI, settings: EnvironmentConfig) -> None:
    """At most ``max_rollouts_in_flight`` ``/run`` calls at once; the next is refused (429) by the
    app's outermost middleware, ahead of ``ControlFirst``'s pacing (``environment/capacity.py``)."""
    capacity = RolloutCapacity(settings.max_rollouts_in_flight, settings.overload_retry_after_s)
    app.add_middleware(RunAdmission, capacity=capacity)


def _responses_object(response: Any, activation: int) -> dict[str, Any]:
    """An activation's answer if it is a Responses object the episode can keep: its output a list of
    objects, the whole writable as JSON again; ``UpstreamError`` otherwise."""
    output = response.get("output") if isinstance(response, dict) else None
    if not isinstance(output, list):
        raise UpstreamError(f"agent activation {activation} answered no Responses object")
    if not all(isinstance(item, dict) for item in output):
        raise UpstreamError(f"agent activation {activation} answered output items that are not all objects")
    return cast(dict[str, Any], refuse_unencodable(response, f"agent activation {activation}'s answer",
                                                   refusal=UpstreamError))


def cookies_of(response: httpx.Response) -> dict[str, str]:
    """The cookies a reply sets, by name."""
    return dict(response.cookies.items())


@dataclass(frozen=True)
class AgentReply:
    """One activation's answer: the Responses object, the resources cookies after it, whether the
    agent declared itself restart-only, and whether it declared that its ``/close`` may run again."""

    response: dict[str, Any]
    cookies: dict[str, str]
    restart: bool = False
    close_replays: bool = False


@dataclass
class AgentClient:
    """The agent calls of one environment server; ``restart_only`` once the agent said so.

    Activations go over ``activations`` (the context's ``long_calls``), every other call over
    ``client``: a close never waits for a connection behind thousands of running activations (a
    prepare waits for the episodes in a ``close_agent`` step whose agent did not say its close may
    run again).
    """

    client: MeshClient
    url: str
    settings: EnvironmentConfig
    activations: MeshClient | None = None
    restart_only: bool = False

    async def invoke(
        self, identity: RolloutIdentity, activation: int, body: Mapping[str, Any], cookies: Mapping[str, str]
    ) -> AgentReply:
        """Activation ``activation`` (1-based) of the episode's agent session."""
        reply = await (self.activations or self.client).request(
            "POST", f"{self.url}/v1/responses", json=dict(body), cookies=cookies, identity=identity,
            headers={ACTIVATION_HEADER: str(activation)}, timeout_s=self.settings.agent_timeout_s,
        )
        response = _responses_object(decode_json(reply), activation)
        restart = reply.headers.get(RESTART_HEADER) == "1"
        self.restart_only = self.restart_only or restart
        return AgentReply(response, {**cookies, **cookies_of(reply)}, restart,
                          close_replays=reply.headers.get(CLOSE_HEADER) == "replay")

    async def refilled(
        self, identity: RolloutIdentity, state: Mapping[str, Any], items: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """``items`` with their token arrays back when the state's note says they had some and a model
        item lacks them now (a restored boundary); else ``items`` unchanged, without a call."""
        if not state.get(TOKEN_ARRAYS_NOTE) or not lacks_token_arrays(items):
            return items
        try:
            reply = await self.client.request(
                "POST", f"{self.url}{REFILL_PATH}", json={"items": items}, identity=identity, idempotent=True,
                timeout_s=self.settings.call_timeout_s,
            )
            answer = decode_json(reply)
        except GymError as error:
            logger.warning("%s: token arrays not put back (%s: %s)", identity.capture_key, error.code, error.detail)
            return items
        refilled = answer.get("items") if isinstance(answer, dict) else None
        if not isinstance(refilled, list) or without_token_arrays(refilled) != without_token_arrays(items):
            logger.warning("%s: the agent's refill changed more than token arrays; not taken", identity.capture_key)
            return items
        return refilled

    async def close(self, identity: RolloutIdentity) -> None:
        """Free the agent's session of this episode (idempotent on the agent's side)."""
        await self.client.request(
            "POST", f"{self.url}/close", json={}, identity=identity, idempotent=True,
            timeout_s=self.settings.call_timeout_s,
        )


# ---- token arrays of agent items ----------------------------------------------------------------


def is_model_item(item: Mapping[str, Any]) -> bool:
    """An output item a model call made: an assistant message, a function call or reasoning."""
    return item.get("type") in ("function_call", "reasoning") or item.get("role") == "assistant"


def lacks_token_arrays(items: list[dict[str, Any]]) -> bool:
    """Whether a model item among ``items`` is without its token arrays."""
    return any(is_model_item(item) and not all(name in item for name in TOKEN_ARRAYS) for item in items)


def note_agent_close(state: MutableMapping[str, Any], reply: AgentReply) -> None:
    """Note in the episode state whether the agent's last reply said its ``/close`` may run again."""
    if reply.close_replays:
        state[CLOSE_REPLAYS_NOTE] = True
    else:
        state.pop(CLOSE_REPLAYS_NOTE, None)


def close_step_mode(state: Mapping[str, Any]) -> StepMode:
    """The mode of a step that closes the agent's session: ``replay`` when the agent said its
    ``/close`` may run again (``CLOSE_HEADER``), else ``wait`` (an agent that says nothing)."""
    return "replay" if state.get(CLOSE_REPLAYS_NOTE) is True else "wait"


def note_token_arrays(state: MutableMapping[str, Any], items: list[dict[str, Any]]) -> None:
    """Note in the episode state that the agent's items came with token arrays (a record keeps the
    note, not the arrays)."""
    if any(all(name in item for name in TOKEN_ARRAYS) for item in items):
        state[TOKEN_ARRAYS_NOTE] = True
