"""single_agent_turn: one agent activation per episode, verified by a resources server.

``POST /run`` (under ``/ng-rollout/<capture_key>/``) takes a task row and runs these steps
(``nemo_gym_ckpt.environment.episode``; the mode says what a checkpoint does with a step in flight):

- ``seed`` (replay): resources ``POST /seed_session`` with the row (NeMo Gym's seed of an agent's
  ``/run``); keeps its cookies, the ``resources_session_id`` it answers and its
  ``x-ng-checkpoint-verify`` and ``x-ng-checkpoint-restart`` answers;
- ``invoke_agent`` (replay): agent ``POST /v1/responses`` as activation 1, the body the row's
  ``responses_create_params``, the resources cookies passed explicitly;
- ``close_agent``: agent ``POST /close``, which frees the agent session; ``replay`` when the agent's
  activation reply said its ``/close`` may run again (``x-ng-checkpoint-close: replay``, as the simple
  agent's does), else ``wait``;
- ``verify`` (the mode the seed reply announced; default wait): resources ``POST /verify`` with the
  row and ``response``;
- ``close_session`` (replay): resources ``POST /close_session`` with NeMo Gym's body
  ``{resources_session_id, episode_id}`` (idempotent); a close that fails is logged and never fails
  the finished rollout;
- ``return`` (replay): the rollout row: the task row, ``response``, ``reward``, the verifier's fields.

A failed step answers its error with the step named in the detail; the agent session and the
resources session are closed on the way out. Each step names its NeMo Gym failure stage (``seed``,
``agent``, ``verification``, ``cleanup``), which an episode request's ``failure`` reply carries.

Checkpointing (``docs/participants.md``, "Environment servers"): with the mesh's ``checkpoint:``
block on, the server is a participant of kind ``environment``. The boundary after ``seed`` holds
the resources cookies and the seed reply's answers, so a restored episode never seeds again; the
one after ``invoke_agent`` holds the agent's response (and notes whether it came with token
arrays). Records strip those arrays, so ``verify`` and ``return`` take the response through
``AgentClient.refilled``: after a restore from any later boundary, the agent puts them back (its
session may be closed by then: the refill needs none), and the row equals an uninterrupted run's,
token arrays included. The response and the verdict are kept without their echoes of the requests
they answered (``nemo_gym_ckpt.echoes``), and put back from the row when needed. The episode is a
restart when the seed reply says ``x-ng-checkpoint-restart: 1`` (a restart-only resources server)
or the agent does (a restart-only agent). A restore checks each record's state first
(``check_state``): it must hold what the steps from its next step on read (``resources`` with its
cookies, ``response`` with its output items, ``verdict`` with a numeric reward; ``STATE_NEEDS``); a
record that does not is ``invalid_checkpoint_state``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import httpx
from fastapi import FastAPI

from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK, Clock
from nemo_gym_ckpt.checkpoint.headers import RESTART_HEADER, VERIFY_HEADER
from nemo_gym_ckpt.client import decode_json
from nemo_gym_ckpt.config import ServerRef
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.echoes import echoed_keys, with_echoes, without_echoes
from nemo_gym_ckpt.environment.base import (
    AgentClient,
    EnvironmentConfig,
    close_step_mode,
    cookies_of,
    mount_environment,
    note_agent_close,
    note_token_arrays,
)
from nemo_gym_ckpt.environment.episode import Episode, Program, Step, StepMode
from nemo_gym_ckpt.errors import GymError, InvalidCheckpointState, UpstreamError
from nemo_gym_ckpt.identity import naming_the_attempt
from nemo_gym_ckpt.server import close_on_shutdown
from nemo_gym_ckpt.server import create_app as create_app_base

__all__ = ["STATE_NEEDS", "Config", "SingleAgentTurn", "check_state", "create_app", "verify_mode"]

logger = logging.getLogger(__name__)


class Config(EnvironmentConfig):
    resources_server: ServerRef


def verify_mode(state: Mapping[str, Any]) -> StepMode:
    """The verify step's mode: what the resources server announced at seed time (default wait)."""
    return "replay" if state.get("resources", {}).get("verify_mode") == "replay" else "wait"


STATE_NEEDS: Mapping[str, tuple[str, ...]] = {
    "seed": (),
    "invoke_agent": ("resources",),
    "close_agent": ("resources", "response"),
    "verify": ("resources", "response"),
    "close_session": ("resources", "response", "verdict"),
    "return": ("response", "verdict"),
}
"""The state keys the steps from each step on read before they write them."""


def check_state(next_step: str | None, state: Mapping[str, Any]) -> None:
    """Whether the steps from ``next_step`` on find what they read (``ValueError`` naming what not)."""
    missing = [key for key in STATE_NEEDS.get(next_step or "", ()) if key not in state]
    if missing:
        raise ValueError(f"the steps from {next_step} on read {missing}, which it lacks")
    for key in ("response" + _ECHOES, "verdict" + _ECHOES):
        echoed = state.get(key, [])
        if not isinstance(echoed, list) or not all(isinstance(name, str) for name in echoed):
            raise ValueError(f"{key} must be a list of strings")
    if "resources" in state:
        _check_resources(state["resources"])
    if "response" in state:
        _check_response(state["response"], "output" in state.get("response" + _ECHOES, []))
    if "verdict" in state:
        _check_verdict(state["verdict"])


def _check_resources(resources: Any) -> None:
    cookies = resources.get("cookies") if isinstance(resources, dict) else None
    if not isinstance(cookies, dict) or not all(isinstance(value, str) for value in cookies.values()):
        raise ValueError("resources must be an object whose cookies are an object of strings")


def _check_response(response: Any, output_echoed: bool) -> None:
    if not isinstance(response, dict):
        raise ValueError("response must be an object")
    output = response.get("output")
    if output_echoed:  # the request's, put back when read
        return
    if not isinstance(output, list) or not all(isinstance(item, dict) for item in output):
        raise ValueError("response's output must be a list of objects")


def _check_verdict(verdict: Any) -> None:
    reward = verdict.get("reward") if isinstance(verdict, dict) else None
    if not isinstance(reward, int | float) or isinstance(reward, bool):
        raise ValueError("verdict must be an object with a numeric reward")



class SingleAgentTurn:
    """The steps of one episode, bound to this server's clients and settings."""

    def __init__(self, ctx: ServerContext[Any], resources: ServerRef | None = None) -> None:
        """``resources``: where seed and verify go (default: the settings' ``resources_server``)."""
        self.client = ctx.client
        self.settings = ctx.settings
        self.resources_url = ctx.url_of(resources or ctx.settings.resources_server)
        self.agent = AgentClient(ctx.client, ctx.url_of(ctx.settings.agent_server), ctx.settings,
                                 activations=ctx.long_calls)
        self.program = Program.of(
            [
                Step("seed", self.seed, "replay", stage="seed"),
                Step("invoke_agent", self.invoke_agent, "replay", stage="agent"),
                Step("close_agent", self.close_agent, close_step_mode, stage="agent"),
                Step("verify", self.verify, verify_mode, stage="verification"),
                Step("close_session", self.close_session, "replay", stage="cleanup"),
                Step("return", self.finish, "replay"),
            ],
            cleanup=self.cleanup, check_state=check_state,
        )

    async def _resources(self, episode: Episode, path: str, body: Any, **kwargs: Any) -> Any:
        cookies = episode.state.get("resources", {}).get("cookies", {})
        if isinstance(body, dict):
            body = naming_the_attempt(body, episode.identity)
        return await self.client.request(
            "POST", f"{self.resources_url}{path}", json=body, cookies=cookies, identity=episode.identity,
            timeout_s=self.settings.call_timeout_s, **kwargs,
        )

    async def seed(self, episode: Episode) -> str:
        reply = await self._resources(episode, "/seed_session", episode.task)
        restart = reply.headers.get(RESTART_HEADER) == "1"
        episode.state["resources"] = {
            "session_id": _session_id_of(reply),
            "cookies": cookies_of(reply),
            "verify_mode": "replay" if reply.headers.get(VERIFY_HEADER) == "replay" else "wait",
            "restart": restart,
        }
        if restart or self.agent.restart_only:
            episode.mark_restart()
        return "invoke_agent"

    async def invoke_agent(self, episode: Episode) -> str:
        resources = episode.state["resources"]
        body = episode.task["responses_create_params"]
        reply = await self.agent.invoke(episode.identity, 1, body, resources["cookies"])
        if reply.restart:
            episode.mark_restart()
        resources["cookies"] = reply.cookies
        _keep_without_echoes(episode.state, "response", reply.response, body)
        note_token_arrays(episode.state, reply.response["output"])
        note_agent_close(episode.state, reply)
        return "close_agent"

    async def close_agent(self, episode: Episode) -> str:
        await self.agent.close(episode.identity)
        episode.state["agent_closed"] = True
        return "verify"

    async def _response(self, episode: Episode) -> dict[str, Any]:
        """The agent's response: its echoes of the request put back, and its token arrays if a
        restored boundary lacks them (kept in the state, so that the next step need not ask again)."""
        state = episode.state
        response = _with_echoes(state, "response", episode.task["responses_create_params"])
        response["output"] = state["response"]["output"] = await self.agent.refilled(
            episode.identity, state, response["output"])
        return response

    async def verify(self, episode: Episode) -> str:
        body = {**episode.task, "response": await self._response(episode)}
        reply = await self._resources(episode, "/verify", body)
        verdict = decode_json(reply)
        reward = verdict.get("reward") if isinstance(verdict, dict) else None
        if not isinstance(reward, int | float) or isinstance(reward, bool):
            raise UpstreamError("the resources server's /verify answered no numeric reward")
        _keep_without_echoes(episode.state, "verdict", verdict, body)
        return "close_session"

    async def close_session(self, episode: Episode) -> str:
        """Close the resources session; a failed close is logged and never fails the finished rollout."""
        await _best_effort(self._close_resources(episode), "close the resources session")
        episode.state["resources"]["closed"] = True
        return "return"

    def _close_resources(self, episode: Episode) -> Any:
        """``/close_session`` with NeMo Gym's body ``{resources_session_id, episode_id}``."""
        resources = episode.state.get("resources", {})
        body = {"resources_session_id": resources.get("session_id") or _fallback_session_id(episode),
                "episode_id": episode.identity.to_json()}
        return self._resources(episode, "/close_session", body, idempotent=True)

    async def finish(self, episode: Episode) -> None:
        response = await self._response(episode)
        verdict = _with_echoes(episode.state, "verdict", {**episode.task, "response": response})
        for key in ("verdict", "response", "verdict" + _ECHOES, "response" + _ECHOES):
            episode.state.pop(key, None)
        reward = float(verdict["reward"])
        episode.state["result"] = {**episode.task, **verdict, "response": response, "reward": reward}
        return None

    async def cleanup(self, episode: Episode) -> None:
        """After a failure or cancellation: close whatever the episode still holds open."""
        state = episode.state
        if not state.get("agent_closed"):
            await _best_effort(self.agent.close(episode.identity), "close the agent session")
        resources = state.get("resources")
        if resources and not resources.get("closed"):
            await _best_effort(self._close_resources(episode), "close the resources session")


_ECHOES = "_echoes"


def _keep_without_echoes(state: dict[str, Any], name: str, reply: dict[str, Any], request: Mapping[str, Any]) -> None:
    """Keep a reply in the state without its echoes of the request (NeMo Gym's replies repeat their
    requests: the agent's response its tools, the verifier's verdict the whole row and response),
    which the next steps take from the request again (``_with_echoes``)."""
    echoed = echoed_keys(reply, request)
    state[name] = without_echoes(reply, echoed)
    state[name + _ECHOES] = echoed


def _with_echoes(state: Mapping[str, Any], name: str, request: Mapping[str, Any]) -> dict[str, Any]:
    """A reply kept by ``_keep_without_echoes`` (or whole, by a server before it), as it was answered."""
    try:
        return with_echoes(state[name], state.get(name + _ECHOES, ()), request)
    except (ValueError, TypeError) as error:
        raise InvalidCheckpointState(f"the episode's {name} does not fit its task: {error}") from None


def _session_id_of(reply: httpx.Response) -> str | None:
    """The session id a seed reply names (``resources_session_id``, or our ``session_id``; NeMo Gym's legacy
    seed answers ``{}``: none)."""
    try:
        body = reply.json()
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    found = (body.get(key) for key in ("resources_session_id", "session_id"))
    return next((value for value in found if isinstance(value, str) and value), None)


def _fallback_session_id(episode: Episode) -> str:
    """The id a close names when the seed reply named none (the cookie names the session then)."""
    return "resources-session-" + re.sub(r"[^A-Za-z0-9_-]", "_", episode.identity.capture_key)


async def _best_effort(call: Any, what: str) -> None:
    try:
        await call
    except GymError as error:
        logger.warning("could not %s: %r", what, error)


def create_app(ctx: ServerContext[Config], *, clock: Clock = SYSTEM_CLOCK) -> FastAPI:
    app = create_app_base(ctx.name)
    mount_environment(app, ctx, SingleAgentTurn(ctx).program, clock=clock)
    return close_on_shutdown(app, ctx.aclose)
