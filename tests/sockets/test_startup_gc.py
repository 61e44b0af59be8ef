"""A server process starts without the cyclic collector and serves with it (``launch/startup_gc.py``).

The ``serve`` entry point turns the collector off before its imports (checked in a process of its
own, run as the launcher runs it, ``--help`` ending it before any app); an app served by uvicorn
behind ``settled_at_startup`` starts with the collector off and serves with it on, what the start
made frozen; an app without a lifespan settles at its first request; a collector that was off
before the pause stays off.
"""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from nemo_gym_ckpt.launch import startup_gc
from nemo_gym_ckpt.launch.child import SERVE_MODULE

pytestmark = pytest.mark.sockets


@pytest.fixture(autouse=True)
def collector_as_it_was() -> Iterator[None]:
    """Each test starts with the collector on and nothing frozen, and leaves it so."""
    assert gc.isenabled() and gc.get_freeze_count() == 0 and not startup_gc.paused()
    yield
    startup_gc.settle_collector()
    gc.unfreeze()
    gc.enable()


def test_a_server_process_imports_its_modules_with_the_collector_off() -> None:
    code = ("import gc, runpy, sys\n"
            f"sys.argv = ['{SERVE_MODULE}', '--help']\n"
            "try:\n"
            f"    runpy.run_module('{SERVE_MODULE}', run_name='__main__', alter_sys=True)\n"
            "except SystemExit:\n"
            "    pass\n"
            "print('collector on' if gc.isenabled() else 'collector off', 'uvicorn' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "collector off True"  # its imports done, no app started


def test_an_app_starts_with_the_collector_off_and_serves_with_it_on_its_start_frozen(
    serve_app: Callable[[Any], str],
) -> None:
    seen: dict[str, Any] = {}

    async def startup() -> None:
        seen["starting"] = gc.isenabled()
        seen["made"] = [{"made": index} for index in range(1000)]  # tracked objects the start made

    app = FastAPI(on_startup=[startup])

    @app.get("/collector")
    async def collector() -> dict[str, Any]:
        return {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}

    startup_gc.pause_collector()
    url = serve_app(startup_gc.settled_at_startup(app))
    reply = httpx.get(f"{url}/collector", timeout=10).json()
    assert seen["starting"] is False
    assert reply["enabled"] is True and reply["frozen"] >= len(seen["made"])
    assert not startup_gc.paused()


async def test_an_app_without_a_lifespan_settles_at_its_first_request() -> None:
    sent: list[dict[str, Any]] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        body = b"on" if gc.isenabled() else b"off"
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    startup_gc.pause_collector()
    await startup_gc.settled_at_startup(app)({"type": "http", "method": "GET", "path": "/"}, receive, send)
    assert sent[-1]["body"] == b"on" and not startup_gc.paused()


def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    startup_gc.pause_collector()
    assert not startup_gc.paused()
    startup_gc.settle_collector()
    assert not gc.isenabled() and gc.get_freeze_count() == 0
