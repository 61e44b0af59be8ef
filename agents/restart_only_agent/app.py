"""restart_only_agent: the simple agent's loop in an implementation that cannot capture sessions.

It stands for every agent whose state lives somewhere a checkpoint cannot reach (an opaque
runtime, a remote service): ``checkpoint_sessions = False``. Routes, config and behaviour are the
simple agent's, except for checkpointing (docs/protocol.md section 7):

- every reply carries ``x-ng-checkpoint-restart: 1``, so the environment marks the episode a
  restart (and, remembering it, classifies later episodes as restarts from their first step);
- with the mesh's ``checkpoint:`` block on, its sessions are listed as ``restarts`` in every
  prepare report; they never park, never block a prepare and are never exported, and a restore
  that carries a record of this agent is ``invalid_checkpoint_state``. A new session waits while a
  checkpoint is open; calls of existing sessions keep running.

Why an implementation and not a config flag: whether an agent can capture its state is a property
of its code, like a resources server's ``checkpoint_mode``; a config key could declare a
capturing agent restart-only, but never make a non-capturing one capturable, so the declaration is
a class attribute that config cannot change.
"""

from __future__ import annotations

from fastapi import FastAPI

from agents.simple_agent.app import Config, SimpleAgent, build_app
from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK, Clock
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.server import close_on_shutdown

__all__ = ["Config", "RestartOnlyAgent", "create_app"]


class RestartOnlyAgent(SimpleAgent):
    """The simple agent's loop, declared restart-only."""

    checkpoint_sessions = False


def create_app(ctx: ServerContext[Config], *, clock: Clock = SYSTEM_CLOCK) -> FastAPI:
    return close_on_shutdown(build_app(RestartOnlyAgent(ctx), ctx, clock=clock), ctx.aclose)
