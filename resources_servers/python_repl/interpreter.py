"""``Interpreter``: one child Python process (``child.py``) with a persistent namespace.

The parent side of the JSON-lines protocol: ``run(code, timeout_s)`` sends one request and reads
one reply, one call at a time. A child that runs out of time is killed; one that died answers
nothing; one whose reply is not a whole, valid line (longer than ``READ_LIMIT``, not JSON, not
``{output, error, id}`` with this request's ``id``) has lost the protocol. In each case ``run``
answers ``None``, ``lost`` says why, and the interpreter is closed, so that no later call can read
what is left of the bad line as its reply. The child leads a process group of its own: ``close``
kills the whole group (whatever the code started with it) and reaps the child.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

__all__ = ["CHILD", "Interpreter"]

CHILD = Path(__file__).with_name("child.py")
READ_LIMIT = 4 << 20  # one reply line: output and error of at most 100k characters each, JSON-escaped
BROKEN = "broke the reply protocol (a reply too long, not JSON or not the reply to this call)"


class Interpreter:
    """A live child interpreter; start one with ``await Interpreter.start(max_output_chars)``."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process
        self._lock = asyncio.Lock()
        self._calls = 0
        self.lost = "exited"  # why the last ``run`` answered None

    @classmethod
    async def start(cls, max_output_chars: int) -> Interpreter:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", str(CHILD), str(max_output_chars),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, limit=READ_LIMIT,
            start_new_session=True,  # its own process group, so close kills what the code started too
        )
        return cls(process)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return self._process.returncode is None

    async def run(self, code: str, timeout_s: float) -> dict[str, Any] | None:
        """The child's reply, or ``None`` when it died or ran past ``timeout_s`` (then it is closed)."""
        async with self._lock:
            self._calls += 1
            line = await self._exchange(code, timeout_s)
            reply = self._reply(line, self._calls) if line else None
            if reply is None:
                await self.close()
        return reply

    async def _exchange(self, code: str, timeout_s: float) -> bytes:
        """The child's reply line; empty when it died, ran past ``timeout_s`` or broke the protocol."""
        stdin, stdout = self._process.stdin, self._process.stdout
        assert stdin is not None and stdout is not None  # both are pipes (start)
        self.lost = f"exited or ran past {timeout_s} s"
        request = json.dumps({"code": code, "id": self._calls}).encode() + b"\n"

        async def exchange() -> bytes:
            stdin.write(request)
            await stdin.drain()  # under the deadline too: a busy child may not read its request
            return await stdout.readline()

        try:
            line = await asyncio.wait_for(exchange(), timeout_s)
        except (TimeoutError, ConnectionError):
            return b""
        except ValueError:  # the line is longer than READ_LIMIT (LimitOverrunError's ValueError)
            self.lost = BROKEN
            return b""
        if line and not line.endswith(b"\n"):  # a part line, then end of file: the child died
            return b""
        return line

    def _reply(self, line: bytes, call: int) -> dict[str, Any] | None:
        """The reply in ``line`` when it is a valid one for this ``call``, else ``None``."""
        try:
            reply = json.loads(line)
        except ValueError:  # not JSON, or not UTF-8
            reply = None
        if (isinstance(reply, dict) and reply.keys() == {"output", "error", "id"}
                and isinstance(reply["output"], str) and isinstance(reply["error"], (str, type(None)))
                and type(reply["id"]) is int and reply["id"] == call):
            error = None if reply["error"] is None else _utf8(reply["error"])
            return {"output": _utf8(reply["output"]), "error": error}
        self.lost = BROKEN
        return None

    async def close(self) -> None:
        """Kill the child's process group (the child and what its code started) and reap the child.

        A process the code moved to a session or group of its own is out of reach: not a sandbox.
        """
        # The group outlives the child while any of its processes runs; its id is the child's pid.
        with contextlib.suppress(ProcessLookupError, PermissionError):  # no process of it is left
            os.killpg(self._process.pid, signal.SIGKILL)
        await self._process.wait()
        if self._process.stdin is not None:
            self._process.stdin.close()


def _utf8(text: str) -> str:
    """``text`` with each lone surrogate (``print(chr(0xd800))``) written as its escape, ``\\ud800``:
    the reply must be UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
