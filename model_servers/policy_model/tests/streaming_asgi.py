"""An in-process ASGI transport for httpx that streams: the reply comes back at its first bytes.

``httpx.ASGITransport`` runs the app to its end before it answers, so a stream that pauses (a
generation in flight, a stream that has started to be delivered) cannot be observed through it.
``StreamingASGITransport`` runs the app in a task, answers once ``http.response.start`` is sent,
and streams the body chunks as the app sends them. Closing the response early tells the app the
client went away (``http.disconnect``). Every wait has a deadline; an app failure is raised.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import unquote

import httpx

__all__ = ["StreamingASGITransport"]

WAIT_S = 10.0


class _Exchange:
    """One request to the app: its body in, the reply's start and chunks out."""

    def __init__(self, app: Any, request: httpx.Request, body: bytes) -> None:
        self.app, self.request, self.body = app, request, body
        self.started = asyncio.Event()
        self.gone = asyncio.Event()
        self.chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.status = 500
        self.headers: list[tuple[bytes, bytes]] = []
        self._sent_body = False
        self.task = asyncio.create_task(self._run())

    def scope(self) -> dict[str, Any]:
        url = self.request.url
        return {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": self.request.method,
            "headers": [(key.lower(), value) for key, value in self.request.headers.raw],
            "scheme": url.scheme,
            "path": unquote(url.path),
            "raw_path": url.raw_path.split(b"?")[0],
            "query_string": url.query,
            "server": (url.host, url.port),
            "client": ("127.0.0.1", 50000),
            "root_path": "",
        }

    async def _run(self) -> None:
        try:
            await self.app(self.scope(), self.receive, self.send)
        finally:
            self.started.set()
            self.chunks.put_nowait(None)

    async def receive(self) -> dict[str, Any]:
        if not self._sent_body:
            self._sent_body = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status, self.headers = message["status"], list(message.get("headers", []))
            self.started.set()
        elif message["type"] == "http.response.body" and message.get("body"):
            self.chunks.put_nowait(message["body"])

    async def finish(self) -> None:
        """The client is done: the app is told so, and awaited (its failure raised)."""
        self.gone.set()
        done, _ = await asyncio.wait({self.task}, timeout=WAIT_S)
        if not done:
            self.task.cancel()
            raise TimeoutError(f"the app did not end within {WAIT_S} s after its client went away")
        _raise_failure(self.task)


class _Body(httpx.AsyncByteStream):
    def __init__(self, exchange: _Exchange) -> None:
        self.exchange = exchange

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            async with asyncio.timeout(WAIT_S):
                chunk = await self.exchange.chunks.get()
            if chunk is None:
                return
            yield chunk

    async def aclose(self) -> None:
        await self.exchange.finish()


class StreamingASGITransport(httpx.AsyncBaseTransport):
    """Sends each request to ``app`` in process; the reply streams as the app writes it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        exchange = _Exchange(self.app, request, await request.aread())
        try:
            async with asyncio.timeout(WAIT_S):
                await exchange.started.wait()
        finally:
            if not exchange.started.is_set():  # timed out, or the caller gave up: stop the app
                exchange.task.cancel()
        if exchange.task.done():
            _raise_failure(exchange.task)
        return httpx.Response(exchange.status, headers=exchange.headers, stream=_Body(exchange))


def _raise_failure(task: asyncio.Task[None]) -> None:
    error = None if task.cancelled() else task.exception()
    if error is not None:
        raise error
