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
episode whose agent says ``x-ng-checkpoint-restart: 1`` is a restart.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI
from pydantic import Field

from environment_servers.nim.game import NimGame, NimRules, parse_move
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

__all__ = ["Config", "Nim", "NimTask", "create_app"]

logger = logging.getLogger(__name__)


class Config(EnvironmentConfig):
    max_turns: int = Field(50, ge=1)
    """Agent activations per episode, at most (a game still running then is lost)."""


class NimTask(EpisodeTask):
    nim: NimRules


def _observation(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


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
            cleanup=self.cleanup,
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
