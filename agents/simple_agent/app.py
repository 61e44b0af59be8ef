"""The simple agent: policy-model calls and tool calls on a resources server, until an answer.

Routes (also under ``/ng-rollout/<capture_key>/``, where the capture key names the agent session):

- ``POST /v1/responses``: a Responses create body (``input``, ``tools``, sampling parameters, which
  pass through to the policy model). Runs the loop of ``loop.py``: a model call with the original
  input plus every output so far and the request's tools; each function call on the resources
  server (``POST /<name>`` with the parsed arguments and the request's cookies, which are the
  resources server's); again, until a message without calls, ``max_steps`` model calls, or an
  incomplete response. Answers a Responses object whose ``output`` is the whole trajectory and whose
  ``usage`` is summed; the resources cookies as they stand after the last tool call come back as
  ``Set-Cookie``. The policy model's answers echo the request's parameters (its ``tools``), and the
  agent keeps an answer only as deep as it can write it again (``ANSWER_LEVELS``, with
  checkpointing ``RECORD_LEVELS`` more): a request nested deeper than that is 400, not the
  policy model's 502. The header ``x-ng-agent-activation: <n>`` (1-based) numbers the calls of one
  episode. With checkpointing on, each reply says ``x-ng-checkpoint-close: replay``: its ``/close``
  may run again, so an environment need not hold a checkpoint for it.
- ``POST /training-token-capture/v1/responses`` (NeMo Gym's training-capture path, under the
  rollout prefix): the same activation, token ids asked for even without ``return_token_ids``.
- ``POST /run`` (what NeMo Gym's ``legacy_agent`` relays; its rollout named by the prefix or the
  row's ``_ng_task_index``/``_ng_rollout_index``/``_ng_attempt_index``): one whole rollout of a
  task row: resources ``/seed_session`` with the row, the loop, ``/verify`` with the row and the
  response, ``/close_session`` (a failed close is logged only; once seeded, a ``/run`` that fails
  closes too, see ``_closes_after``); answers the verified row (the task row, the verifier's
  fields, ``response``, ``reward``). Needs a ``resources_server``. A row the agent could not write
  again in its reply (and record) is 400; a policy model's answer or a ``/verify`` answer it could
  not keep (in its reply, and with checkpointing in its record: ``VERDICT_LEVELS``) is 502.
- ``POST /v1/agent_sessions`` and ``POST /v1/agent_sessions/close``: NeMo Gym's agent sessions
  (``agent_sessions.py``): a session names its episode and, in a ``direct_http`` tool access, the
  resources server and cookies its activations use; the close answers the resources cookies after
  the last activation and ends the episode's activation session. With checkpointing on, a retire of
  the session's attempt (or a later one of its rollout) or a forget of its rollout drops it too.
- ``POST /aggregate_metrics``: NeMo Gym's ``AggregateMetrics`` of the rows sent.
- ``POST /close``: frees the session of the request's capture key (idempotent).
- ``POST /v1/responses/refill``: ``{"items": [...]}`` (output items of this rollout that an
  environment kept, e.g. at a boundary restored from a checkpoint) answered as ``{"items",
  "refilled"}``: the same items, with the token arrays of their model calls put back from the policy
  model's capture route where they lack them (``restored_tokens.refill``). It needs no session (an
  environment may have closed it before the checkpoint), changes nothing and never waits for a
  checkpoint (only a retired attempt is refused); with checkpointing or ``return_token_ids`` off it
  answers the items unchanged.

The answer's ``metadata.policy_versions`` lists each model call's policy version (JSON text) when
the calls carried one: NeMo Gym's response model drops the items' ``policy_version`` but keeps
``metadata``.

Checkpointing (``docs/participants.md``, "Agents"): with the mesh's ``checkpoint:`` block on, the
agent is a participant of kind ``agent`` over ``nemo_gym_ckpt.agent.sessions.AgentSessions``: the
activation header deduplicates (a completed activation invoked again answers the same reply;
skipping ahead is ``activation_out_of_order``), every model and tool call is a boundary of the
loop, and the session's record is built from its ``LoopState`` as each call starts (a commit
only looks it up). A restored session continues its loop under the next capture key without making a
completed model or tool call again. With ``return_token_ids``, a restored loop first asks the
policy model for the token arrays of the calls it made before the checkpoint (``GET
/v1/capture/tokens`` under its capture key; the policy model keeps them in its token sidecar) and
puts them back on its output items (``restored_tokens``), so its answer equals an uninterrupted
run's, token arrays included. If the policy model cannot answer, the loop goes on without them
(logged); the policy model still splices the next prompt from the ids it restored. A restored
completed reply invoked again is refilled the same way before it is answered (``AgentSessions``'
``refill`` hook), so a re-invoked activation answers its reply token arrays included.
A ``/run`` is its session's activation 1: seed and verify are gated like tool calls (a prepare
waits for them; after a restore the continued activation seeds no more), and a ``/run`` or an
agent-session seed or close arriving while a checkpoint is open waits for its resume. Once its
verify answered, inside that gate, the ``/run``'s state (``RunState``) keeps the verdict (without its
echoes of the row and the response, which the restored ``/run`` takes from them again): a restored
``/run`` answers that verdict without verifying again. Its resources close is not gated (a failed
close is only logged, and a repeated one is harmless): a checkpoint that lands during it does not
wait, and the restored ``/run`` closes again.
``checkpoint_sessions`` (a class attribute, not config) says
whether the implementation captures its sessions; ``agents/restart_only_agent`` is the same loop
with it off. With checkpointing off the activation header is only recorded.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, ClassVar, cast

import orjson
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agents.simple_agent.agent_sessions import AgentSession as NgAgentSession
from agents.simple_agent.agent_sessions import (
    AgentSessionTable,
    CloseAgentSession,
    SeedAgentSession,
    agent_cookie_name,
)
from agents.simple_agent.loop import (
    MAX_TOOL_CALLS_PER_TURN,
    LoopCalls,
    LoopState,
    ModelReply,
    check_loop_state,
    response_object,
    run_loop,
)
from agents.simple_agent.restored_tokens import missing_calls, reattach, refill
from nemo_gym_ckpt.agent.sessions import RECORD_LEVELS, ActivationReply, AgentSessions, Turn
from nemo_gym_ckpt.aggregate_metrics import mount_aggregate_metrics
from nemo_gym_ckpt.bounds import MAX_ITEMS, Text
from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK, Clock
from nemo_gym_ckpt.checkpoint.headers import ACTIVATION_HEADER, CLOSE_HEADER, RESTART_HEADER
from nemo_gym_ckpt.checkpoint.mount import mount_checkpointing
from nemo_gym_ckpt.client import MeshClient, decode_json
from nemo_gym_ckpt.config import ServerConfig, ServerRef
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.echoes import echoed_keys, with_echoes, without_echoes
from nemo_gym_ckpt.environment.base import REFILL_PATH, cookies_of, lacks_token_arrays
from nemo_gym_ckpt.errors import GymError, InvalidCheckpointState, InvalidRequest, StaleAttempt, UpstreamError
from nemo_gym_ckpt.identity import (
    current_identity,
    identity_of_episode_id,
    identity_of_row,
    request_identity,
    serving_as,
    without_dispatch_keys,
)
from nemo_gym_ckpt.responses import normalize_input
from nemo_gym_ckpt.server import OrjsonResponse, close_on_shutdown, declare_body, refuse_unencodable
from nemo_gym_ckpt.server import create_app as create_app_base

__all__ = [
    "ANSWER_LEVELS",
    "MODEL_CALL_HEADER",
    "VERDICT_LEVELS",
    "AgentRequest",
    "AgentSession",
    "Config",
    "GatedCalls",
    "HttpCalls",
    "RefillRequest",
    "RunState",
    "SimpleAgent",
    "build_app",
    "check_agent_state",
    "create_app",
    "parse_activation",
    "request_fields",
    "resumed_run_state",
    "resumed_state",
]


logger = logging.getLogger(__name__)

MODEL_CALL_HEADER = "x-nemo-gym-model-call-id"
"""The policy model's id of a call in its capture ledger (checkpointing on): the agent's lineage."""
ANSWER_LEVELS = 1
"""Levels deeper than in its own JSON that the agent keeps a policy model's answer: a ``/run``'s reply
holds the loop's answer in its ``response`` (the next model call and a ``/v1/responses`` reply hold
its items as deep as it did). An exported session's record (``RECORD_LEVELS``) adds its own: its
running state keeps the answer's fields in ``last_response``, its reply a ``/run``'s ``response``."""


class Config(ServerConfig):
    model_server: ServerRef
    resources_server: ServerRef | None = None
    max_steps: int = Field(8, ge=1)
    """Model calls per activation, at most."""
    max_tool_calls_per_turn: int = Field(MAX_TOOL_CALLS_PER_TURN, ge=1)
    """Function calls of one model reply that run, at most; each later one is answered with an error text."""
    return_token_ids: bool = False
    """Ask the policy model for token ids, log probs and policy versions on every output item."""
    model_timeout_s: float = Field(600.0, gt=0)
    tool_timeout_s: float = Field(120.0, gt=0)


class AgentRequest(BaseModel):
    """A Responses create body; fields other than ``input`` pass through to the policy model."""

    model_config = ConfigDict(extra="allow")

    input: Text | Annotated[list[dict[str, Any]], Field(max_length=MAX_ITEMS)]
    tools: Annotated[list[dict[str, Any]], Field(max_length=1024)] | None = None
    stream: bool | None = None


_NEVER_ECHOED = frozenset({"input", "stream"})
"""Fields of a ``/v1/responses`` body the policy model's answer does not repeat (its parameters,
``tools`` among them, it does), so they need not fit the deeper place the answer is kept in."""


class RefillRequest(BaseModel):
    """``POST /v1/responses/refill``: output items of this rollout, as an environment kept them."""

    model_config = ConfigDict(extra="forbid")

    items: Annotated[list[dict[str, Any]], Field(max_length=MAX_ITEMS)]


_ACTIVATION = re.compile(r"[0-9]{1,18}")
"""An activation index: ASCII digits (``str.isdigit`` takes other scripts' digits and superscripts,
which ``int`` refuses), at most 18 of them (a 64-bit integer, as its record writes it)."""


def parse_activation(value: str | None) -> int | None:
    """The ``x-ng-agent-activation`` header as an int >= 1 (None when absent)."""
    if value is None:
        return None
    if _ACTIVATION.fullmatch(value) is None or int(value) < 1:
        raise InvalidRequest(f"{ACTIVATION_HEADER} must be an integer >= 1 of at most 18 digits, "
                             f"got {value[:40]!r}{'...' if len(value) > 40 else ''}")
    return int(value)


@dataclass
class AgentSession:
    """One episode's session: the activations seen so far and the loop of the latest one."""

    activations: list[int] = field(default_factory=list)
    loop: LoopState | None = None


@dataclass(frozen=True)
class HttpCalls:
    """``LoopCalls`` over the mesh client."""

    client: MeshClient
    settings: Config
    model_url: str
    resources_url: str | None
    token_ids: bool = False
    """Ask for token ids even when ``return_token_ids`` is off (NeMo Gym's training-capture path)."""
    answer_levels: int = ANSWER_LEVELS
    """Levels deeper than in its own JSON that the agent keeps a model's answer (``ANSWER_LEVELS``, and
    ``RECORD_LEVELS`` more when its sessions are exported): a deeper one is ``upstream_error``."""

    async def call_model(self, body: dict[str, Any], cookies: dict[str, str]) -> ModelReply:
        if self.settings.return_token_ids or self.token_ids:
            body = {**body, "return_token_ids": True}
        reply = await self.client.request(
            "POST", f"{self.model_url}/v1/responses", json=body, cookies=cookies,
            timeout_s=self.settings.model_timeout_s,
        )
        response = decode_json(reply)
        if not isinstance(response, dict):
            raise UpstreamError("the policy model answered something other than a Responses object")
        refuse_unencodable(response, "the policy model's answer", levels=self.answer_levels, refusal=UpstreamError)
        return ModelReply(response, cookies_of(reply), reply.headers.get(MODEL_CALL_HEADER))

    async def capture_tokens(self) -> list[dict[str, Any]]:
        """The policy model's calls of this rollout with their token arrays (its capture route)."""
        reply = await self.client.request("GET", f"{self.model_url}/v1/capture/tokens",
                                          timeout_s=self.settings.model_timeout_s)
        answer = decode_json(reply)
        calls = answer.get("calls") if isinstance(answer, dict) else None
        if not isinstance(calls, list) or not all(isinstance(call, dict) for call in calls):
            raise UpstreamError("the policy model's capture route answered no list of calls")
        return calls

    async def call_tool(
        self, name: str, arguments: dict[str, Any], cookies: dict[str, str]
    ) -> tuple[str, dict[str, str]]:
        if self.resources_url is None:
            return '{"error": {"code": "no_tools", "detail": "this agent has no resources server"}}', {}
        reply = await self.client.request(
            "POST", f"{self.resources_url}/{name}", json=arguments, cookies=cookies, check=False,
            timeout_s=self.settings.tool_timeout_s,
        )
        return reply.text, cookies_of(reply)


@dataclass(frozen=True)
class GatedCalls:
    """``LoopCalls`` whose every call goes through the activation's gate (a checkpoint boundary)."""

    calls: LoopCalls
    turn: Turn

    async def call_model(self, body: dict[str, Any], cookies: dict[str, str]) -> ModelReply:
        async with self.turn.call("model"):
            return await self.calls.call_model(body, cookies)

    async def call_tool(
        self, name: str, arguments: dict[str, Any], cookies: dict[str, str]
    ) -> tuple[str, dict[str, str]]:
        async with self.turn.call("tool"):
            return await self.calls.call_tool(name, arguments, cookies)


class SimpleAgent:
    """The agent of one server instance: its calls and its sessions by capture key."""

    checkpoint_sessions: ClassVar[bool] = True
    """Whether this implementation captures its sessions at a checkpoint (False: restart-only)."""

    def __init__(self, ctx: ServerContext[Config]) -> None:
        settings = ctx.settings
        resources = settings.resources_server
        self.settings = settings
        self.calls = HttpCalls(
            ctx.client, settings, ctx.url_of(settings.model_server),
            ctx.url_of(resources) if resources is not None else None,
        )
        self.sessions: dict[str, AgentSession] = {}
        self.checkpoint: AgentSessions | None = None
        self.row_levels = 0
        """Levels deeper than in its own JSON that the agent keeps a ``/run`` row: its reply merges the
        row's keys; an exported session's record holds that reply ``RECORD_LEVELS`` deeper."""
        self.verdict_levels = 0
        """Levels deeper than in its own JSON that the agent keeps a ``/verify`` answer (its echoes of
        the row and the response left out): its reply merges its keys into the row; an exported
        ``/run``'s running state keeps it in ``verdict`` (``VERDICT_LEVELS`` more)."""
        self.agent_sessions = AgentSessionTable()
        self.agent_cookie = agent_cookie_name(ctx.name)

    def take_part(self, sessions: AgentSessions) -> None:
        """Checkpointing is on: the activations run under ``sessions``; when this implementation
        exports them, what it keeps (rows, model answers) must be writable in their records."""
        self.checkpoint = sessions
        if self.checkpoint_sessions:
            self.row_levels = RECORD_LEVELS
            self.verdict_levels = VERDICT_LEVELS
            self.calls = replace(self.calls, answer_levels=ANSWER_LEVELS + RECORD_LEVELS)

    async def _loop(self, state: LoopState, calls: LoopCalls) -> None:
        """Run ``state``'s loop to its stop over ``calls``, with this agent's bounds."""
        await run_loop(state, calls, max_tool_calls_per_turn=self.settings.max_tool_calls_per_turn)

    def session(self, activation: int | None) -> AgentSession | None:
        """The request's session (created at its first call); None outside a rollout."""
        identity = current_identity()
        if identity is None:
            return None
        session = self.sessions.setdefault(identity.capture_key, AgentSession())
        if activation is not None:
            session.activations.append(activation)
        return session

    def fresh_state(self, body: AgentRequest, cookies: Mapping[str, str]) -> LoopState:
        return LoopState(**request_fields(body), max_steps=self.settings.max_steps, cookies=dict(cookies))

    async def responses(self, body: AgentRequest, request: Request) -> OrjsonResponse:
        return await self._responses(body, request, token_ids=False)

    async def capture_responses(self, body: AgentRequest, request: Request) -> OrjsonResponse:
        """NeMo Gym's training-capture path: the same activation, token ids asked for."""
        return await self._responses(body, request, token_ids=True)

    async def _responses(self, body: AgentRequest, request: Request, *, token_ids: bool) -> OrjsonResponse:
        if body.stream:
            raise InvalidRequest("the simple agent does not stream; send stream: false")
        echoed = {name: value for name, value in dict(body).items() if name not in _NEVER_ECHOED}
        refuse_unencodable(echoed, levels=self.calls.answer_levels)  # what the answer repeats, kept deeper
        activation = parse_activation(request.headers.get(ACTIVATION_HEADER))
        session = self.agent_sessions.find(request.cookies.get(self.agent_cookie))
        calls, cookies = self._calls_for(session, request, token_ids)
        if self.checkpoint is None:
            reply = await self._plain(activation, body, cookies, calls)
        else:
            request_json = body.model_dump(mode="json")
            reply = await self.checkpoint.activate(activation, request_json,
                                                   lambda turn: self._turn(turn, body, cookies, calls))
        if session is not None:
            session.cookies = dict(reply.cookies)
        return self._http_reply(reply)

    def _calls_for(
        self, session: NgAgentSession | None, request: Request, token_ids: bool
    ) -> tuple[HttpCalls, dict[str, str]]:
        """The calls and resources cookies of an activation: an agent session's tools when it names some."""
        cookies = {name: value for name, value in request.cookies.items() if name != self.agent_cookie}
        calls = replace(self.calls, token_ids=True) if token_ids else self.calls
        if session is None:
            return calls, cookies
        identity = current_identity()
        if identity is not None and identity != session.identity:
            raise InvalidRequest(f"agent session {session.seed.agent_session_id!r} belongs to episode "
                                 f"{session.identity.capture_key}, not {identity.capture_key}")
        if session.tools_url is not None:
            calls = replace(calls, resources_url=session.tools_url)
        return calls, {**cookies, **session.cookies}

    async def _plain(
        self, activation: int | None, body: AgentRequest, cookies: dict[str, str], calls: LoopCalls
    ) -> ActivationReply:
        session = self.session(activation)
        state = self.fresh_state(body, cookies)
        if session is not None:
            session.loop = state
        await self._loop(state, calls)
        return ActivationReply(response_object(state), dict(state.cookies))

    async def _turn(
        self, turn: Turn, body: AgentRequest, cookies: dict[str, str], calls: LoopCalls
    ) -> ActivationReply:
        """One checkpointed activation: the loop from its restored state, or afresh."""
        resume = turn.resume
        if resume is not None and not VERDICT_KEYS.isdisjoint(resume):
            raise InvalidCheckpointState("a restored /v1/responses activation's state carries a /run's verdict")
        state = self.fresh_state(body, cookies) if resume is None else resumed_state(resume, body)
        turn.track(state.view)
        if resume is not None and self.settings.return_token_ids:
            await self._reattach_tokens(state)
        await self._loop(state, GatedCalls(calls, turn))
        return ActivationReply(response_object(state), dict(state.cookies))

    # ---- NeMo Gym's agent /run: seed, the loop, verify, close -------------------------------

    async def run(self, request: Request) -> OrjsonResponse:
        """``POST /run``: one whole rollout of a task row, answered as its verified row."""
        body = await read_object(request, self.row_levels)
        identity = request_identity(identity_of_row(body))
        row = without_dispatch_keys(body)
        params = _run_params(row)
        if self.calls.resources_url is None:
            raise InvalidRequest("this agent has no resources_server: /run seeds and verifies there")
        with serving_as(identity):
            if self.checkpoint is None:
                reply = await self._run_work(None, row, params)
            else:
                reply = await self.checkpoint.activate(RUN_ACTIVATION, row,
                                                       lambda turn: self._run_work(turn, row, params))
        return self._http_reply(reply)

    async def _run_work(self, turn: Turn | None, row: dict[str, Any], params: AgentRequest) -> ActivationReply:
        """Seed, loop, verify, close; under a checkpoint every call is a gated boundary (a restored
        activation continues its loop and does not seed again; one restored after its verify answered
        takes the verdict from its state and only closes the resources session, which may run again).
        Once seeded, the resources session is closed however the rollout ends (``_closes_after``)."""
        resume = turn.resume if turn is not None else None
        if resume is None:
            async with _gate(turn):
                cookies = await self._seed(row)
            run = RunState(self.fresh_state(params, cookies))
        else:
            run = resumed_run_state(resume, params)
        try:
            result = await self._seeded_run(turn, run, row)
        except (Exception, asyncio.CancelledError) as error:
            if _closes_after(error, turn):
                await self._close_after_failure(run.loop.cookies)
            raise
        await self._close_resources(run.loop.cookies)
        return ActivationReply(result, dict(run.loop.cookies))

    async def _seeded_run(self, turn: Turn | None, run: RunState, row: dict[str, Any]) -> dict[str, Any]:
        """The loop and the verify of a seeded ``/run``: its verified row."""
        state = run.loop
        if turn is not None:
            turn.track(run.view)
            if turn.resume is not None and self.settings.return_token_ids:
                await self._reattach_tokens(state)
        await self._loop(state, GatedCalls(self.calls, turn) if turn is not None else self.calls)
        response = response_object(state)
        verify_request = {**row, "response": response}
        if run.verdict is None:
            async with _gate(turn):
                verdict = await self._verify(row, response, state.cookies)
                # inside the gate: the verify is done exactly once
                run.verified(verdict, verify_request, levels=self.verdict_levels)
        else:  # restored after its verify answered: that verdict, and no verify again
            verdict = run.restored_verdict(verify_request)
        return {**row, **verdict, "response": response, "reward": float(verdict["reward"])}

    async def _seed(self, row: dict[str, Any]) -> dict[str, str]:
        reply = await self.calls.client.request("POST", f"{self.calls.resources_url}/seed_session", json=row,
                                                timeout_s=self.settings.tool_timeout_s)
        return cookies_of(reply)

    async def _verify(self, row: dict[str, Any], response: dict[str, Any], cookies: dict[str, str]) -> dict[str, Any]:
        verdict = await self.calls.client.post_json(
            f"{self.calls.resources_url}/verify", json={**row, "response": response}, cookies=cookies,
            timeout_s=self.settings.tool_timeout_s)
        reward = verdict.get("reward") if isinstance(verdict, dict) else None
        if not isinstance(reward, int | float) or isinstance(reward, bool):
            raise UpstreamError("the resources server's /verify answered no numeric reward")
        return dict(verdict)

    async def _close_after_failure(self, cookies: dict[str, str]) -> None:
        """Close the resources session of a ``/run`` that failed: best effort (within ``tool_timeout_s``,
        whatever goes wrong only logged), so the rollout's own error is what its caller gets."""
        try:
            await self._close_resources(cookies)
        except Exception:
            logger.exception("could not close the resources session of a failed /run")

    async def _close_resources(self, cookies: dict[str, str]) -> None:
        """Close the resources session (NeMo Gym's body); a failed close is logged, never the rollout's."""
        identity = current_identity()
        body: dict[str, Any] = {"resources_session_id": next(iter(cookies.values()), "")}
        if identity is not None:
            body["episode_id"] = identity.to_json()
        try:
            await self.calls.client.request("POST", f"{self.calls.resources_url}/close_session", json=body,
                                            cookies=cookies, idempotent=True, timeout_s=self.settings.tool_timeout_s)
        except GymError as error:
            logger.warning("could not close the resources session: %s: %s", error.code, error.detail)

    # ---- NeMo Gym's agent sessions ----------------------------------------------------------

    async def seed_agent_session(self, body: SeedAgentSession) -> OrjsonResponse:
        """``POST /v1/agent_sessions``: a session of one episode, with the tools it may use."""
        identity = request_identity(identity_of_episode_id(body.episode_id))
        assert identity is not None  # an episode id always names one
        with serving_as(identity):
            if self.checkpoint is not None:
                await self.checkpoint.admitted()
            session = self.agent_sessions.seed(body, identity)
        reply = OrjsonResponse({"agent_session_id": session.seed.agent_session_id})
        reply.set_cookie(self.agent_cookie, session.seed.agent_session_id, httponly=True, samesite="lax")
        return reply

    async def close_agent_session(self, body: CloseAgentSession) -> OrjsonResponse:
        """``POST /v1/agent_sessions/close``: the session's resources cookies; its activations end."""
        identity = request_identity(identity_of_episode_id(body.episode_id))
        assert identity is not None
        with serving_as(identity):
            if self.checkpoint is not None:
                await self.checkpoint.close()
            else:
                self.sessions.pop(identity.capture_key, None)
        return OrjsonResponse(self.agent_sessions.close(body, identity))

    async def _reattach_tokens(self, state: LoopState) -> None:
        """Put the token arrays of the calls made before the checkpoint back on their output items."""
        if not missing_calls(state):
            return
        try:
            calls = await self.calls.capture_tokens()
        except GymError as error:
            logger.warning("restored loop: token arrays not put back (%s: %s)", error.code, error.detail)
            return
        reattach(state, calls)

    async def refill(self, body: RefillRequest) -> dict[str, Any]:
        """``POST /v1/responses/refill``: the items with the token arrays the policy model kept."""
        if self.checkpoint is None or not self.settings.return_token_ids:
            return {"items": body.items, "refilled": 0}
        self.checkpoint.fenced()
        if not lacks_token_arrays(body.items):
            return {"items": body.items, "refilled": 0}
        items, stamped = refill(body.items, await self.calls.capture_tokens())
        return {"items": items, "refilled": stamped}

    async def refill_reply(self, reply: ActivationReply) -> ActivationReply:
        """A restored completed reply with its token arrays put back (logged when they cannot be); a
        ``/run`` reply (a row) has them put back on its ``response``."""
        nested = isinstance(reply.response.get("response"), dict) and "output" not in reply.response
        response = reply.response["response"] if nested else reply.response
        output = response.get("output")
        if not self.settings.return_token_ids or not isinstance(output, list) or not lacks_token_arrays(output):
            return reply
        try:
            calls = await self.calls.capture_tokens()
        except GymError as error:
            logger.warning("restored reply: token arrays not put back (%s: %s)", error.code, error.detail)
            return reply
        items, stamped = refill(output, calls)
        if not stamped:
            return reply
        refilled = {**response, "output": items}
        return ActivationReply({**reply.response, "response": refilled} if nested else refilled, reply.cookies)

    def _http_reply(self, reply: ActivationReply) -> OrjsonResponse:
        response = OrjsonResponse(reply.response)
        for name, value in reply.cookies.items():
            response.set_cookie(name, value, httponly=True, samesite="lax")
        if not self.checkpoint_sessions:
            response.headers[RESTART_HEADER] = "1"
        if self.checkpoint is not None:  # its /close may run again: an environment need not wait for it
            response.headers[CLOSE_HEADER] = "replay"
        return response

    async def close(self) -> dict[str, bool]:
        if self.checkpoint is not None:
            return {"closed": await self.checkpoint.close()}
        identity = current_identity()
        closed = identity is not None and self.sessions.pop(identity.capture_key, None) is not None
        return {"closed": closed}


def build_app(agent: SimpleAgent, ctx: ServerContext[Config], *, clock: Clock = SYSTEM_CLOCK) -> FastAPI:
    """The app of ``agent``; a participant of kind ``agent`` when the mesh enables checkpointing."""
    sessions = AgentSessions(restart_only=not agent.checkpoint_sessions, check_state=check_agent_state,
                             refill=agent.refill_reply, release=agent.agent_sessions.drop)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await sessions.aclose()

    app = create_app_base(ctx.name, lifespan=lifespan)
    participant = mount_checkpointing(app, ctx, sessions, kind="agent", clock=clock)
    if participant is not None:
        sessions.participant = participant
        agent.take_part(sessions)
    app.add_api_route("/v1/responses", agent.responses, methods=["POST"])
    app.add_api_route(f"/{TOKEN_CAPTURE_SEGMENT}/v1/responses", agent.capture_responses, methods=["POST"])
    app.add_api_route("/close", agent.close, methods=["POST"])
    app.add_api_route(REFILL_PATH, agent.refill, methods=["POST"])
    app.add_api_route("/run", agent.run, methods=["POST"], openapi_extra=declare_body(RunRow))
    app.add_api_route("/v1/agent_sessions", agent.seed_agent_session, methods=["POST"])
    app.add_api_route("/v1/agent_sessions/close", agent.close_agent_session, methods=["POST"])
    mount_aggregate_metrics(app)
    return app


RUN_ACTIVATION = 1
"""A ``/run`` is its session's one activation."""
TOKEN_CAPTURE_SEGMENT = "training-token-capture"
"""NeMo Gym's path segment (after the rollout prefix) of an activation whose token ids are captured."""


def _gate(turn: Turn | None) -> AbstractAsyncContextManager[None]:
    """A seed or verify of ``/run``: a call a checkpoint waits for (none without checkpointing)."""
    return turn.call("tool") if turn is not None else nullcontext()


def _closes_after(error: BaseException, turn: Turn | None) -> bool:
    """Whether a seeded ``/run`` that ended with ``error`` closes its resources session. Without
    checkpointing, always: nothing continues it. With checkpointing, a failed activation keeps no
    state (invoked again, it seeds afresh), so it closes too, unless its attempt ended: cancelled (a
    retire or forget of its rollout, a ``/close`` of its session, the agent's shutdown) or
    ``stale_attempt``. Then the resources server ends that attempt's sessions itself (it is retired
    there too), and a checkpoint holding the rollout continues it, after a restore, with the session
    it restores: the ``/run`` leaves it alone."""
    return turn is None or not isinstance(error, asyncio.CancelledError | StaleAttempt)


class RunRow(BaseModel):
    """What ``POST /run`` reads (declared in the OpenAPI document): a task row, its
    ``responses_create_params`` the agent request; the row's other keys go to the resources server."""

    model_config = ConfigDict(extra="allow")

    responses_create_params: AgentRequest


def request_fields(body: AgentRequest) -> dict[str, Any]:
    """The loop state's fields that its request gives (``REQUEST_FIELDS``): the input, and the other
    parameters as the model calls send them."""
    return {"input": normalize_input(body.input),
            "params": body.model_dump(exclude={"input", "stream"}, exclude_none=True)}


def resumed_state(snapshot: dict[str, Any], body: AgentRequest) -> LoopState:
    """The loop state a restored activation continues from: its snapshot, with what it left out
    taken from the request invoking it again; 422 ``invalid_checkpoint_state`` when they do not fit."""
    try:
        return LoopState.resumed(snapshot, request_fields(body))
    except ValueError as error:
        raise InvalidCheckpointState(f"the restored loop state does not fit its request: {error}") from None


VERDICT_KEYS = frozenset({"verdict", "verdict_echoes"})
"""The keys a ``/run``'s state adds to its loop's once its verify answered (``RunState.view``)."""
VERDICT_LEVELS = RECORD_LEVELS + 1
"""Levels deeper than in its own JSON that an exported ``/run`` keeps its verify's answer: its record
holds the running state ``RECORD_LEVELS`` deep, and the state holds it in ``verdict``."""


@dataclass
class RunState:
    """A ``/run``'s state: its loop, and the verdict once its verify answered (kept without its echoes
    of the verify request, the row and the response, as ``single_agent_turn`` keeps it)."""

    loop: LoopState
    verdict: dict[str, Any] | None = None
    verdict_echoes: list[str] = field(default_factory=list)

    def view(self) -> dict[str, Any]:
        """The loop's snapshot (``LoopState.view``), with ``verdict`` and ``verdict_echoes`` once verified."""
        snapshot = self.loop.view()
        if self.verdict is not None:
            snapshot["verdict"], snapshot["verdict_echoes"] = self.verdict, self.verdict_echoes
        return snapshot

    def verified(self, verdict: dict[str, Any], request: Mapping[str, Any], *, levels: int = 0) -> None:
        """Keep the verify's answer (to ``request``, the row and the response) without its echoes;
        502 ``upstream_error`` when what it keeps cannot be written ``levels`` levels deeper (a record)."""
        echoed = echoed_keys(verdict, request)
        kept = without_echoes(verdict, echoed)
        refuse_unencodable(kept, "the resources server's /verify answer", levels=levels, refusal=UpstreamError)
        self.verdict, self.verdict_echoes = kept, echoed

    def restored_verdict(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The verdict as the verify answered it, its echoes taken from ``request`` again."""
        assert self.verdict is not None
        try:
            return with_echoes(self.verdict, self.verdict_echoes, request)
        except ValueError as error:
            raise InvalidCheckpointState(f"the restored verdict does not fit its row: {error}") from None


def check_agent_state(data: dict[str, Any]) -> None:
    """``ValueError`` unless ``data`` is a loop state (``check_loop_state``), or a ``/run``'s state
    after its verify: a stopped loop's, with ``verdict`` (an object with a numeric ``reward``, its
    echoes null) and ``verdict_echoes`` (its keys taken from the verify request again)."""
    present = VERDICT_KEYS & set(data)
    if not present:
        check_loop_state(data)
        return
    if present != VERDICT_KEYS:
        raise ValueError(f"a /run's state after its verify has both {sorted(VERDICT_KEYS)}, got {sorted(present)}")
    loop = {key: value for key, value in data.items() if key not in VERDICT_KEYS}
    check_loop_state(loop)
    if loop.get("stop_reason") is None:
        raise ValueError("a /run's state has a verdict only after its loop stopped")
    verdict, echoed = data["verdict"], data["verdict_echoes"]
    reward = verdict.get("reward") if isinstance(verdict, dict) else None
    if not isinstance(reward, int | float) or isinstance(reward, bool):
        raise ValueError("a /run's verdict is an object with a numeric reward")
    if not isinstance(echoed, list) or not all(isinstance(key, str) and key in verdict and verdict[key] is None
                                               for key in echoed):
        raise ValueError("a /run's verdict_echoes name keys of its verdict, each null there")


def resumed_run_state(snapshot: dict[str, Any], params: AgentRequest) -> RunState:
    """The state a restored ``/run`` continues from: its loop (``resumed_state``) and its verdict, if
    its verify had answered."""
    loop = {key: value for key, value in snapshot.items() if key not in VERDICT_KEYS}
    run = RunState(resumed_state(loop, params))
    if "verdict" in snapshot:
        run.verdict, run.verdict_echoes = dict(snapshot["verdict"]), list(snapshot["verdict_echoes"])
    return run


def _run_params(row: dict[str, Any]) -> AgentRequest:
    params = row.get("responses_create_params")
    if not isinstance(params, dict):
        raise InvalidRequest("a /run row carries responses_create_params (an object)")
    try:
        return AgentRequest.model_validate(params)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise InvalidRequest(f"responses_create_params.{where}: {first['msg']}") from None


async def read_object(request: Request, levels: int = 0) -> dict[str, Any]:
    """The request's JSON object, if the mesh can write it again ``levels`` levels deeper
    (``refuse_unencodable``; 400 ``invalid_request`` otherwise)."""
    try:
        data = orjson.loads(await request.body())
    except orjson.JSONDecodeError as error:
        raise InvalidRequest(f"request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("the request body is a JSON object")
    return cast(dict[str, Any], refuse_unencodable(data, levels=levels))


def create_app(ctx: ServerContext[Config], *, clock: Clock = SYSTEM_CLOCK) -> FastAPI:
    return close_on_shutdown(build_app(SimpleAgent(ctx), ctx, clock=clock), ctx.aclose)
