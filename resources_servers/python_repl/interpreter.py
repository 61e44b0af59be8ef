"""``Interpreter``: one child Python process (``child.py``) with a persistent namespace.

The parent side of the JSON-lines protocol: ``run(code, timeout_s)`` sends one request and reads
one reply, one call at a time. A child that runs out of time is killed; one that died answers
nothing; either way ``run`` answers ``None`` and the interpreter is closed. ``close`` kills and
reaps the process.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["CHILD", "Interpreter"]

CHILD = Path(__file__).with_name("child.py")
READ_LIMIT = 4 << 20  # one reply line: output of at most 100k characters, JSON-escaped


class Interpreter:
    """A live child interpreter; start one with ``await Interpreter.start(max_output_chars)``."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process
        self._lock = asyncio.Lock()

    @classmethod
    async def start(cls, max_output_chars: int) -> Interpreter:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", str(CHILD), str(max_output_chars),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, limit=READ_LIMIT,
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
            line = await self._exchange(code, timeout_s)
        if not line:
            await self.close()
            return None
        reply: dict[str, Any] = json.loads(line)
        return reply

    async def _exchange(self, code: str, timeout_s: float) -> bytes:
        stdin, stdout = self._process.stdin, self._process.stdout
        assert stdin is not None and stdout is not None  # both are pipes (start)
        try:
            stdin.write(json.dumps({"code": code}).encode() + b"\n")
            await stdin.drain()
            return await asyncio.wait_for(stdout.readline(), timeout_s)
        except (TimeoutError, ConnectionError):
            return b""

    async def close(self) -> None:
        """Kill the child (if it still runs) and reap it."""
        if self._process.returncode is None:
            self._process.kill()
        await self._process.wait()
        if self._process.stdin is not None:
            self._process.stdin.close()
