"""The control routes match after the server's own routes once the app has started.

A data request (an environment's ``/run``, a model call) then never walks the control routes
first; the control routes still answer as before, and unknown paths are still 404.
"""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from starlette.routing import BaseRoute

from nemo_gym_ckpt.checkpoint.mount import mount_checkpointing
from nemo_gym_ckpt.checkpoint.router import CONTROL_PREFIX
from nemo_gym_ckpt.config import CheckpointConfig
from nemo_gym_ckpt.environment.adapter import EpisodesAdapter, RunLimits
from nemo_gym_ckpt.environment.episode import Episode, Program, Step
from nemo_gym_ckpt.server import create_app

pytestmark = pytest.mark.unit

async def _finish(episode: Episode) -> None:
    return None


PROGRAM = Program.of([Step("finish", _finish, "replay")])


def app_with_data_routes(config: CheckpointConfig) -> tuple[FastAPI, list[BaseRoute]]:
    """An app whose data routes are added after the control routes were mounted (as servers do)."""
    app = create_app("server")
    before = list(app.router.routes)
    adapter = EpisodesAdapter(PROGRAM, RunLimits(None, 1.0))
    assert mount_checkpointing(app, config, adapter, kind="environment", instance="server") is not None
    mounted = [route for route in app.router.routes if route not in before]
    assert mounted

    @app.post("/run")
    async def run() -> dict[str, bool]:
        return {"ran": True}

    return app, mounted


async def test_control_routes_come_last_once_started(config: CheckpointConfig) -> None:
    assert config.control_auth_token is not None
    token = config.control_auth_token.get_secret_value()
    app, mounted = app_with_data_routes(config)
    data = [route for route in app.router.routes if getattr(route, "path", None) == "/run"]
    assert len(data) == 1
    async with app.router.lifespan_context(app):
        routes = list(app.router.routes)
        assert routes[-len(mounted):] == mounted
        assert routes.index(data[0]) < min(routes.index(route) for route in mounted)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as http:
            assert (await http.post("/ng-rollout/r1/run")).json() == {"ran": True}
            status = await http.get(f"{CONTROL_PREFIX}/status", headers={"authorization": f"Bearer {token}"})
            assert status.status_code == 200 and status.json()["phase"] == "idle"
            assert (await http.get(f"{CONTROL_PREFIX}/status")).status_code == 401
            missing = await http.get(f"{CONTROL_PREFIX}/nothing-here", headers={"authorization": f"Bearer {token}"})
            assert missing.status_code == 404
