"""python_repl: a persistent Python interpreter per session; verify runs the task's check in it.

The tool ``run_python`` runs code in the caller's session interpreter (the session cookie from
``/seed_session``): variables, imports and functions persist from call to call, and the reply is
what the code printed plus the values of its expression statements, and its error if it raised.
Verify runs the task's ``check`` code (for example ``assert square(3) == 9``) in the same
interpreter: the reward is 1.0 when it raises nothing.

Restart-only, and honestly so: a session's real state is a live child process (``child.py``), its
objects, open files, generators and random state. It cannot be written down as JSON, pickling a
namespace fails on exactly the objects that matter, and replaying the calls would run arbitrary,
possibly slow or non-deterministic code again. So the server declares ``restart_only``: its
episodes are listed as restarts, never block a checkpoint, keep running while one is open, and
start over after a crash. Its one checkpoint hook is ``retire_session``: the child is killed when
its session is closed, retired or forgotten.

The interpreter is not a sandbox: the code can do whatever the server's user may (it only runs in
isolated mode, with a per-call timeout). Run the server in a container when the code is untrusted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from pydantic import Field

from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.errors import InvalidRequest
from nemo_gym_ckpt.resources.base import (
    ResourcesConfig,
    ResourcesServer,
    Session,
    ToolArgs,
    Verdict,
    VerifyRequest,
    tool,
)
from nemo_gym_ckpt.server import close_on_shutdown
from resources_servers.python_repl.interpreter import Interpreter

__all__ = ["CodeArgs", "Config", "PythonRepl", "ReplTask", "ReplVerdict", "create_app"]


class Config(ResourcesConfig):
    call_timeout_s: float = Field(10.0, gt=0, le=600)
    max_output_chars: int = Field(8192, ge=1, le=100_000)
    max_interpreters: int = Field(64, ge=1, le=4096)


class CodeArgs(ToolArgs):
    code: str = Field(max_length=100_000, description="Python source; bare expressions show their values")


class ReplTask(VerifyRequest):
    check: str = Field(min_length=1, max_length=100_000)


class ReplVerdict(Verdict):
    check_error: str | None


class PythonRepl(ResourcesServer[Config]):
    checkpoint_mode = "restart_only"
    checkpoint_verify = "wait"

    def __init__(self, ctx: ServerContext[Config]) -> None:
        super().__init__(ctx)
        self.interpreters: dict[str, Interpreter] = {}
        self._starting = asyncio.Lock()

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await self.close_interpreters()

    @tool
    async def run_python(self, args: CodeArgs, session: Session) -> dict[str, Any]:
        """Run Python code in this session's interpreter; variables and functions persist between calls.

        Answers {"output", "error"}: what the code printed plus the values of its bare expressions,
        and the last line of the traceback when it raised (else null).
        """
        return await self._run(session, args.code)

    async def verify(self, task: ReplTask, session: Session) -> ReplVerdict:
        reply = await self._run(session, task.check)
        return ReplVerdict(reward=1.0 if reply["error"] is None else 0.0, check_error=reply["error"])

    async def retire_session(self, session: Session) -> None:
        interpreter = self.interpreters.pop(session.session_id, None)
        if interpreter is not None:
            await interpreter.close()

    async def close_interpreters(self) -> None:
        while self.interpreters:
            _, interpreter = self.interpreters.popitem()
            await interpreter.close()

    async def _run(self, session: Session, code: str) -> dict[str, Any]:
        interpreter = await self._interpreter(session)
        reply = await interpreter.run(code, self.settings.call_timeout_s)
        if reply is not None:
            return reply
        if self.interpreters.get(session.session_id) is interpreter:
            del self.interpreters[session.session_id]
        return {"output": "", "error": f"InterpreterLost: the interpreter {interpreter.lost}; the next "
                                       f"call starts a fresh one (earlier variables are gone)"}

    async def _interpreter(self, session: Session) -> Interpreter:
        """The session's interpreter, started on first use (one start at a time)."""
        async with self._starting:
            interpreter = self.interpreters.get(session.session_id)
            if interpreter is not None:
                return interpreter
            if len(self.interpreters) >= self.settings.max_interpreters:
                raise InvalidRequest(f"{len(self.interpreters)} interpreters are live "
                                     f"(max_interpreters): close a session first")
            interpreter = await Interpreter.start(self.settings.max_output_chars)
            if session.session_id not in self.sessions:  # dropped while the child started
                await interpreter.close()
                raise InvalidRequest(f"session {session.session_id!r} was closed")
            self.interpreters[session.session_id] = interpreter
            return interpreter


def create_app(ctx: ServerContext[Config]) -> FastAPI:
    return close_on_shutdown(PythonRepl(ctx).build_app(), ctx.aclose)
