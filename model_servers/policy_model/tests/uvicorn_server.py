"""A real uvicorn server for tests, with an explicit readiness wait and guaranteed shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

__all__ = ["serving"]

START_DEADLINE_S = 60.0  # the worker loads its model in its lifespan: slow on a busy 2-core machine


@asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[int]:
    """``app`` on real uvicorn at 127.0.0.1 (a free port); yields the port once it accepts."""
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", ws="none", lifespan="on")
    )
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(START_DEADLINE_S):
            while not server.started:
                if task.done():
                    task.result()
                    raise RuntimeError("uvicorn stopped before it started")
                await asyncio.sleep(0.01)
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        async with asyncio.timeout(START_DEADLINE_S):
            await task
