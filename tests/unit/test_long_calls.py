"""Activations have a pool of their own: an environment's short calls never queue behind them."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import load_config
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.environment.base import AgentClient
from nemo_gym_ckpt.identity import RolloutIdentity

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
ENV = "single_agent_turn"


def recording(seen: list[str], lane: str) -> MeshClient:
    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(f"{lane} {request.url.path.rsplit('/', 1)[-1]}")
        return httpx.Response(200, json={"output": []})

    return MeshClient(transport=httpx.MockTransport(answer))


async def test_activations_go_over_their_own_pool_and_closes_over_the_shared_one() -> None:
    mesh = load_config([ROOT / "configs/quickstart.yaml"], [])
    seen: list[str] = []
    shared, long_calls = recording(seen, "shared"), recording(seen, "long")
    agent = AgentClient(shared, "http://agent", mesh.instance(ENV).settings, activations=long_calls)
    await agent.invoke(RolloutIdentity("r"), 1, {"input": []}, {})
    await agent.close(RolloutIdentity("r"))
    assert seen == ["long responses", "shared close"]


async def test_a_server_context_gets_a_pool_for_long_calls_of_its_clients_kind() -> None:
    mesh = load_config([ROOT / "configs/quickstart.yaml"], [])
    settings = mesh.instance(ENV).settings
    pooled = ServerContext(name=ENV, settings=settings, mesh=mesh)
    assert pooled.long_calls is not None and pooled.long_calls is not pooled.client
    in_process = ServerContext(name=ENV, settings=settings, mesh=mesh, client=recording([], "x"))
    assert in_process.long_calls is in_process.client  # no pool to keep apart: the same client
    await pooled.aclose()
    await in_process.aclose()
