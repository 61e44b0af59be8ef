"""A small stateful resources server built on the real base: a per-session tally.

``POST /bump`` adds ``by`` to the session's tally and answers the new total; verify rewards a final
tally equal to the task's ``target``. Sessions are real (``checkpoint_mode = "exported"``), so a call
without the session cookie is refused, which makes it a probe for cookie passing.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from nemo_gym_ckpt.config import ServerConfig
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.resources.base import ResourcesServer, Session, TaskRow, ToolArgs, Verdict, VerifyRequest, tool

__all__ = ["Tally", "create_app"]


class Bump(ToolArgs):
    by: int


class TallyTask(VerifyRequest):
    target: int


class TallyVerdict(Verdict):
    tally: int


class Tally(ResourcesServer[ServerConfig]):
    checkpoint_mode = "exported"
    checkpoint_verify = "wait"

    async def initial_state(self, task: TaskRow) -> dict[str, Any]:
        return {"tally": 0}

    @tool
    async def bump(self, args: Bump, session: Session) -> int:
        """Add ``by`` to the tally."""
        session.state["tally"] += args.by
        return int(session.state["tally"])

    async def verify(self, task: TallyTask, session: Session) -> TallyVerdict:
        tally = session.state["tally"]
        return TallyVerdict(reward=1.0 if tally == task.target else 0.0, tally=tally)


def create_app(ctx: ServerContext[ServerConfig]) -> FastAPI:
    return Tally(ctx).build_app()
