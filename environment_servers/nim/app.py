"""nim: a multi-step game environment whose own state and RNG carry over between steps.

Each agent action is one environment step: the environment sends the conversation so far (the task's
input, then each observation and each of the agent's outputs) to the agent as activation n, reads
the move from the agent's final message, applies it, lets the opponent reply (with the game's own
RNG, see ``game.py``), and appends what happened as the next observation. The reward is 1 if the
agent took the last stone, else 0.

Steps (``nemo_gym_ckpt.environment.episode``):

- ``start`` (replay): a new game from the row's ``nim`` rules (RNG seeded from them) and the first
  observation;
- ``act`` (replay): one agent activation and one move; repeats until the game is over or
  ``max_turns`` activations;
- ``close_agent``: agent ``POST /close``; ``replay`` when the agent's last activation reply said its
  ``/close`` may run again (``x-ng-checkpoint-close: replay``), else ``wait``;
- ``return`` (replay): the rollout row: the task row, ``response`` (every item after the task's own
  input: observations and agent outputs), ``reward``, ``winner``, ``moves``, ``invalid_actions``,
  ``activations``.

The game (pile, moves, the RNG's state) is JSON in the episode state, so every boundary holds the
whole game and a restored episode continues with the same dice.

Checkpointing (``docs/participants.md``, "Environment servers"): with the mesh's ``checkpoint:``
block on, the server is a participant of kind ``environment``. Each boundary after ``act`` holds
the game, its RNG state, the transcript and the activation count, so a restored episode re-invokes
the agent with the same activation index and the same conversation, and the opponent rolls the
same dice. Records strip the token arrays of the agent's outputs in the transcript; ``act`` and
``return`` take them back from the agent first (``AgentClient.refilled``, when the state notes the
agent sent some), so the conversation sent again and the row equal an uninterrupted run's. An
episode whose agent says ``x-ng-checkpoint-restart: 1`` is a restart. A restore checks each
record's state first (``check_state``): from ``act`` on it must hold the game (as ``NimGame.to_json``
writes it; not over yet for ``act``), the transcript (a list of objects), ``input_items``,
``activation``, ``usage`` and ``last_response``; a record that does not is ``invalid_checkpoint_state``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from pydantic import Field

from environment_servers.nim.game import NimGame, NimRules, parse_move
from nemo_gym_ckpt.bounds import MAX_INT64
from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK, Clock
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.environment.base import (
    AgentClient,
    EnvironmentConfig,
    EpisodeTask,
    close_step_mode,
    mount_environment,
    note_agent_close,
    note_token_arrays,
)
from nemo_gym_ckpt.environment.episode import Episode, Program, Step
from nemo_gym_ckpt.errors import GymError
from nemo_gym_ckpt.responses import add_usage, last_message_text, normalize_input
from nemo_gym_ckpt.server import close_on_shutdown
from nemo_gym_ckpt.server import create_app as create_app_base

__all__ = ["Config", "Nim", "NimTask", "check_state", "create_app"]

logger = logging.getLogger(__name__)


class Config(EnvironmentConfig):
    max_turns: int = Field(50, ge=1)
    """Agent activations per episode, at most (a game still running then is lost)."""


class NimTask(EpisodeTask):
    nim: NimRules


def _observation(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def check_state(next_step: str | None, state: Mapping[str, Any]) -> None:
    """What the steps from ``next_step`` on read (``ValueError`` naming what is missing or wrong):
    nothing before ``start``, the game and the conversation after it."""
    if next_step == "start":
        return
    game = NimGame.from_json(state.get("game"))
    if next_step == "act" and game.over:
        raise ValueError("the game is over, yet its next step is act")
    transcript, start = state.get("transcript"), state.get("input_items")
    if not isinstance(transcript, list) or not all(isinstance(item, dict) for item in transcript):
        raise ValueError("transcript must be a list of objects")
    if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= len(transcript):
        raise ValueError(f"input_items must be an int from 0 to the transcript's length, got {start!r}")
    activation = state.get("activation")
    if not isinstance(activation, int) or isinstance(activation, bool) or not 0 <= activation <= MAX_INT64:
        raise ValueError(f"activation must be an int >= 0, got {activation!r}")
    if "usage" not in state or not isinstance(state.get("last_response", ()), dict | None):
        raise ValueError("usage must be there, last_response an object or null")


class Nim:
    """The steps of one game, bound to this server's agent client and settings."""

    def __init__(self, ctx: ServerContext[Config]) -> None:
        self.settings = ctx.settings
        self.agent = AgentClient(ctx.client, ctx.url_of(ctx.settings.agent_server), ctx.settings,
                                 activations=ctx.long_calls)
        self.program = Program.of(
            [
                Step("start", self.start, "replay"),
                Step("act", self.act, "replay", stage="agent"),
                Step("close_agent", self.close_agent, close_step_mode, stage="agent"),
                Step("return", self.finish, "replay"),
            ],
            cleanup=self.cleanup, check_state=check_state,
        )

    async def start(self, episode: Episode) -> str:
        if self.agent.restart_only:
            episode.mark_restart()
        game = NimGame.new(NimRules.model_validate(episode.task["nim"]))
        transcript = normalize_input(episode.task["responses_create_params"]["input"])
        episode.state.update(
            game=game.to_json(), input_items=len(transcript), activation=0, usage=None, last_response=None,
            transcript=[*transcript, _observation(game.observation())],
        )
        return "act"

    async def _refill(self, episode: Episode) -> None:
        """The agent's outputs in the transcript with their token arrays, if a restored boundary lacks them."""
        state = episode.state
        transcript, start = state["transcript"], state["input_items"]
        transcript[start:] = await self.agent.refilled(episode.identity, state, transcript[start:])

    async def act(self, episode: Episode) -> str:
        await self._refill(episode)
        state = episode.state
        state["activation"] += 1
        params = {k: v for k, v in episode.task["responses_create_params"].items() if k != "input"}
        reply = await self.agent.invoke(
            episode.identity, state["activation"], {**params, "input": state["transcript"]}, {}
        )
        if reply.restart:
            episode.mark_restart()
        output = reply.response["output"]
        note_token_arrays(state, output)
        note_agent_close(state, reply)
        state["transcript"].extend(output)
        state["usage"] = add_usage(state["usage"], reply.response.get("usage"))
        state["last_response"] = {k: v for k, v in reply.response.items() if k != "output"}
        game = NimGame.from_json(state["game"])
        happened = game.play(parse_move(last_message_text(output)))
        state["game"] = game.to_json()
        if game.over or state["activation"] >= self.settings.max_turns:
            state["transcript"].append(_observation(happened))
            return "close_agent"
        state["transcript"].append(_observation(f"{happened} {game.observation()}"))
        return "act"

    async def close_agent(self, episode: Episode) -> str:
        await self.agent.close(episode.identity)
        episode.state["agent_closed"] = True
        return "return"

    async def finish(self, episode: Episode) -> None:
        await self._refill(episode)
        state = episode.state
        game = NimGame.from_json(state.pop("game"))
        output = state.pop("transcript")[state["input_items"]:]
        response = {**(state.pop("last_response") or {}), "output": output, "usage": state.pop("usage")}
        state["result"] = {
            **episode.task, "response": response, "reward": 1.0 if game.winner == "agent" else 0.0,
            "winner": game.winner, "moves": len(game.moves), "invalid_actions": game.invalid,
            "activations": state["activation"],
        }
        return None

    async def cleanup(self, episode: Episode) -> None:
        if episode.state.get("agent_closed"):
            return
        try:
            await self.agent.close(episode.identity)
        except GymError as error:
            logger.warning("could not close the agent session: %r", error)


def create_app(ctx: ServerContext[Config], *, clock: Clock = SYSTEM_CLOCK) -> FastAPI:
    app = create_app_base(ctx.name)
    mount_environment(app, ctx, Nim(ctx).program, task_model=NimTask, clock=clock)
    return close_on_shutdown(app, ctx.aclose)
