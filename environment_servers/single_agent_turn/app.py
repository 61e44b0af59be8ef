"""single_agent_turn: one agent activation per episode, verified by a resources server.

``POST /run`` (under ``/ng-rollout/<capture_key>/``) takes a task row and runs these steps
(``nemo_gym_ckpt.environment.episode``; the mode says what a checkpoint does with a step in flight):

- ``seed`` (replay): resources ``POST /seed_session`` with the row; keeps its cookies and its
  ``x-ng-checkpoint-verify`` and ``x-ng-checkpoint-restart`` answers;
- ``invoke_agent`` (replay): agent ``POST /v1/responses`` as activation 1, the body the row's
  ``responses_create_params``, the resources cookies passed explicitly;
- ``close_agent`` (wait): agent ``POST /close``, which frees the agent session;
- ``verify`` (the mode the seed reply announced; default wait): resources ``POST /verify`` with the
  row and ``response``;
- ``close_session`` (replay): resources ``POST /close_session`` (idempotent) with NeMo Gym's body
  ``{resources_session_id, episode_id}`` (the session id the seed answered, else the capture key);
- ``return`` (replay): the rollout row: the task row, ``response``, ``reward``, the verifier's fields.

A failed step answers its error with the step named in the detail; the agent session and the
resources session are closed on the way out.

Checkpointing (``docs/participants.md``, "Environment servers"): with the mesh's ``checkpoint:``
block on, the server is a participant of kind ``environment``. The boundary after ``seed`` holds
the resources cookies and the seed reply's answers, so a restored episode never seeds again; the
one after ``invoke_agent`` holds the agent's response (and notes whether it came with token
arrays). Records strip those arrays, so ``verify`` and ``return`` take the response through
``AgentClient.refilled``: after a restore from any later boundary, the agent puts them back (its
session may be closed by then: the refill needs none), and the row equals an uninterrupted run's,
token arrays included. The episode is a restart when the seed
reply says ``x-ng-checkpoint-restart: 1`` (a restart-only resources server) or the agent does (a
restart-only agent).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI

from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK, Clock
from nemo_gym_ckpt.checkpoint.headers import RESTART_HEADER, VERIFY_HEADER
from nemo_gym_ckpt.client import decode_json
from nemo_gym_ckpt.config import ServerRef
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.environment.base import (
    AgentClient,
    EnvironmentConfig,
    cookies_of,
    mount_environment,
    note_token_arrays,
)
from nemo_gym_ckpt.environment.episode import Episode, Program, Step, StepMode
from nemo_gym_ckpt.errors import GymError, UpstreamError
from nemo_gym_ckpt.server import close_on_shutdown
from nemo_gym_ckpt.server import create_app as create_app_base

__all__ = ["Config", "SingleAgentTurn", "create_app", "verify_mode"]

logger = logging.getLogger(__name__)


class Config(EnvironmentConfig):
    resources_server: ServerRef


def verify_mode(state: Mapping[str, Any]) -> StepMode:
    """The verify step's mode: what the resources server announced at seed time (default wait)."""
    return "replay" if state.get("resources", {}).get("verify_mode") == "replay" else "wait"


class SingleAgentTurn:
    """The steps of one episode, bound to this server's clients and settings."""

    def __init__(self, ctx: ServerContext[Config]) -> None:
        self.client = ctx.client
        self.settings = ctx.settings
        self.resources_url = ctx.url_of(ctx.settings.resources_server)
        self.agent = AgentClient(ctx.client, ctx.url_of(ctx.settings.agent), ctx.settings)
        self.program = Program.of(
            [
                Step("seed", self.seed, "replay"),
                Step("invoke_agent", self.invoke_agent, "replay"),
                Step("close_agent", self.close_agent, "wait"),
                Step("verify", self.verify, verify_mode),
                Step("close_session", self.close_session, "replay"),
                Step("return", self.finish, "replay"),
            ],
            cleanup=self.cleanup,
        )

    async def _resources(self, episode: Episode, path: str, body: Any, **kwargs: Any) -> Any:
        cookies = episode.state.get("resources", {}).get("cookies", {})
        return await self.client.request(
            "POST", f"{self.resources_url}{path}", json=body, cookies=cookies, identity=episode.identity,
            timeout_s=self.settings.call_timeout_s, **kwargs,
        )

    async def seed(self, episode: Episode) -> str:
        reply = await self._resources(episode, "/seed_session", episode.task)
        restart = reply.headers.get(RESTART_HEADER) == "1"
        episode.state["resources"] = {
            "session_id": _session_id_of(decode_json(reply), episode.identity.capture_key),
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
        episode.state["response"] = reply.response
        note_token_arrays(episode.state, reply.response["output"])
        return "close_agent"

    async def close_agent(self, episode: Episode) -> str:
        await self.agent.close(episode.identity)
        episode.state["agent_closed"] = True
        return "verify"

    async def _response(self, episode: Episode) -> dict[str, Any]:
        """The agent's response, its token arrays put back if a restored boundary lacks them."""
        response: dict[str, Any] = episode.state["response"]
        response["output"] = await self.agent.refilled(episode.identity, episode.state, response["output"])
        return response

    async def verify(self, episode: Episode) -> str:
        body = {**episode.task, "response": await self._response(episode)}
        reply = await self._resources(episode, "/verify", body)
        verdict = decode_json(reply)
        reward = verdict.get("reward") if isinstance(verdict, dict) else None
        if not isinstance(reward, int | float) or isinstance(reward, bool):
            raise UpstreamError("the resources server's /verify answered no numeric reward")
        episode.state["verdict"] = verdict
        return "close_session"

    async def close_session(self, episode: Episode) -> str:
        await self._resources(episode, "/close_session", _close_body(episode), idempotent=True)
        episode.state["resources"]["closed"] = True
        return "return"

    async def finish(self, episode: Episode) -> None:
        await self._response(episode)
        verdict = episode.state.pop("verdict")
        response = episode.state.pop("response")
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
            closing = self._resources(episode, "/close_session", _close_body(episode), idempotent=True)
            await _best_effort(closing, "close the resources session")


def _session_id_of(reply: Any, fallback: str) -> str:
    """The session id a seed reply names (ours: ``session_id``; NeMo Gym's: ``resources_session_id``)."""
    if isinstance(reply, dict):
        for key in ("resources_session_id", "session_id"):
            if isinstance(reply.get(key), str) and reply[key]:
                return str(reply[key])
    return fallback


def _close_body(episode: Episode) -> dict[str, Any]:
    """NeMo Gym's close body: the session and the episode it belongs to (our servers read the cookie)."""
    resources = episode.state.get("resources", {})
    session_id = resources.get("session_id") or episode.identity.capture_key
    return {"resources_session_id": session_id, "episode_id": episode.identity.to_json()}


async def _best_effort(call: Any, what: str) -> None:
    try:
        await call
    except GymError as error:
        logger.warning("could not %s: %r", what, error)


def create_app(ctx: ServerContext[Config], *, clock: Clock = SYSTEM_CLOCK) -> FastAPI:
    app = create_app_base(ctx.name)
    mount_environment(app, ctx, SingleAgentTurn(ctx).program, clock=clock)
    return close_on_shutdown(app, ctx.aclose)
