"""``Interpreter``: one child Python process (``child.py``) with a persistent namespace.

The parent side of the JSON-lines protocol: ``run(code, timeout_s)`` sends one request and reads
one reply, one call at a time. A child that runs out of time is killed; one that died answers
nothing; one whose reply is not a whole, valid line (longer than ``READ_LIMIT``, not JSON, not
``{output, error, id}`` with this request's ``id``) has lost the protocol. In each case ``run``
answers ``None``, ``lost`` says why, and the interpreter is closed, so that no later call can read
what is left of the bad line as its reply.

The child leads a process group of its own: ``close`` kills the whole group (whatever the code
started with it) and reaps the child. Only ``close`` reaps it: until then the child, or its zombie,
holds its pid, which is the group's id, so the kernel cannot hand that id to another group and the
kill reaches this group alone, even when the child died long before. The child also holds the read
end of a lifeline pipe whose write end only this process holds: when this process dies, however it
dies, the child's watcher kills the group (``child.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["CHILD", "Interpreter"]

CHILD = Path(__file__).with_name("child.py")
READ_LIMIT = 4 << 20  # one reply line: output and error of at most 100k characters each, JSON-escaped
BROKEN = "broke the reply protocol (a reply too long, not JSON or not the reply to this call)"
REAP_TIMEOUT_S = 10.0  # for a SIGKILLed child to exit (a large one takes a while to free its memory)
REAP_POLL_S = (0.001, 0.05)  # the first and the longest pause between two looks
logger = logging.getLogger(__name__)


class Interpreter:
    """A live child interpreter; start one with ``await Interpreter.start(max_output_chars)``."""

    def __init__(self, process: subprocess.Popen[bytes], lifeline: int) -> None:
        self._process = process
        self._lifeline: int | None = lifeline  # the write end; closed by close
        self._reader = asyncio.StreamReader(limit=READ_LIMIT)
        self._reading: asyncio.ReadTransport | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()
        self._calls = 0
        self.lost = "exited"  # why the last ``run`` answered None

    @classmethod
    async def start(cls, max_output_chars: int) -> Interpreter:
        interpreter = cls(*_spawn(max_output_chars))
        try:
            await interpreter._connect()
        except BaseException:
            await asyncio.shield(interpreter.close())
            raise
        return interpreter

    async def _connect(self) -> None:
        """Speak to the child's stdin and stdout through the event loop."""
        stdin, stdout = self._process.stdin, self._process.stdout
        assert stdin is not None and stdout is not None  # both are pipes (_spawn)
        loop = asyncio.get_running_loop()
        self._reading, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(self._reader), stdout)
        writing, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, stdin)
        self._writer = asyncio.StreamWriter(writing, protocol, None, loop)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def alive(self) -> bool:
        """Whether the child runs (it may have exited, not yet reaped: only ``close`` reaps it)."""
        if self._process.returncode is not None:
            return False
        return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None

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
        writer, reader = self._writer, self._reader
        if writer is None:  # closed
            return b""
        self.lost = f"exited or ran past {timeout_s} s"
        request = json.dumps({"code": code, "id": self._calls}).encode() + b"\n"

        async def exchange() -> bytes:
            writer.write(request)
            await writer.drain()  # under the deadline too: a busy child may not read its request
            return await reader.readline()

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
        if self._process.returncode is None:  # not reaped: the group's id is still the child's pid
            with contextlib.suppress(ProcessLookupError, PermissionError):  # no process of it is left
                os.killpg(self._process.pid, signal.SIGKILL)
            await self._reap()
        self._disconnect()

    def _disconnect(self) -> None:
        """Close both pipes to the child (dropping what it never read) and the lifeline; once."""
        if self._writer is not None:
            if not self._writer.transport.is_closing():  # it closes itself once the child is gone
                self._writer.transport.abort()
            self._writer = None
        if self._reading is not None:
            self._reading.close()
            self._reading = None
        for pipe in (self._process.stdin, self._process.stdout):  # not yet a transport's, if start failed
            if pipe is not None:
                pipe.close()
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None

    async def _reap(self) -> None:
        """Wait for the killed child to exit and reap it, for at most ``REAP_TIMEOUT_S``."""
        deadline = time.monotonic() + REAP_TIMEOUT_S
        pause, longest = REAP_POLL_S
        while self._process.poll() is None:
            if time.monotonic() >= deadline:
                logger.warning("interpreter %d still runs %g s after SIGKILL", self.pid, REAP_TIMEOUT_S)
                return
            await asyncio.sleep(pause)
            pause = min(2 * pause, longest)


def _spawn(max_output_chars: int) -> tuple[subprocess.Popen[bytes], int]:
    """A new child in a session of its own, and the write end of its lifeline."""
    lifeline, held = os.pipe()  # both close on exec: only the child gets the read end (pass_fds)
    try:
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", str(CHILD), str(max_output_chars), str(lifeline)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True, pass_fds=(lifeline,),
        )
    except BaseException:
        os.close(held)
        raise
    finally:
        os.close(lifeline)
    return process, held


def _utf8(text: str) -> str:
    """``text`` with each lone surrogate (``print(chr(0xd800))``) written as its escape, ``\\ud800``:
    the reply must be UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
