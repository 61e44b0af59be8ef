"""Entry point of one server process: ``python -m nemo_gym_ckpt.serve <instance>``.

The launcher passes the resolved mesh config (ports assigned) as JSON in ``NEMO_GYM_CKPT_CONFIG``.
This module builds the instance's ``ServerContext``, asks its ``app`` module for the FastAPI app and
serves it with uvicorn (uvloop and httptools). It exits by itself when its parent dies: a
``PR_SET_PDEATHSIG`` on Linux and a watchdog on the parent pid everywhere.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, cast

import orjson
import uvicorn
from fastapi import FastAPI

from nemo_gym_ckpt.config import MeshConfig, load_config_dict
from nemo_gym_ckpt.context import ServerContext

__all__ = ["CONFIG_ENV", "build_app", "main", "watch_parent"]

CONFIG_ENV = "NEMO_GYM_CKPT_CONFIG"
PARENT_ENV = "NEMO_GYM_CKPT_PARENT_PID"
_PR_SET_PDEATHSIG = 1
logger = logging.getLogger(__name__)


def build_app(mesh: MeshConfig, name: str) -> FastAPI:
    """The app of instance ``name``, with the context's client closed at shutdown."""
    instance = mesh.instance(name)
    module = importlib.import_module(instance.module)
    ctx: ServerContext[Any] = ServerContext(name=name, settings=instance.settings, mesh=mesh)
    app = cast(FastAPI, module.create_app(ctx))
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[Any]:
        async with inner(a) as state:
            try:
                yield state
            finally:
                await ctx.aclose()

    app.router.lifespan_context = lifespan
    return app


def watch_parent(parent_pid: int, on_orphaned: Callable[[], None], interval_s: float = 0.5) -> None:
    """Call ``on_orphaned`` once the parent process is gone (a daemon thread polls)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    def poll() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        on_orphaned()

    threading.Thread(target=poll, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nemo_gym_ckpt.serve")
    parser.add_argument("instance")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    mesh = load_config_dict(orjson.loads(os.environ[CONFIG_ENV]))
    instance = mesh.instance(args.instance)
    if PARENT_ENV in os.environ:
        watch_parent(int(os.environ[PARENT_ENV]), lambda: os.kill(os.getpid(), signal.SIGTERM))
    app = build_app(mesh, args.instance)
    uvicorn.run(
        app,
        host=instance.settings.host,
        port=cast(int, instance.settings.port),
        loop="uvloop",
        http="httptools",
        log_level="warning",
        timeout_graceful_shutdown=5,
    )


if __name__ == "__main__":
    main()
