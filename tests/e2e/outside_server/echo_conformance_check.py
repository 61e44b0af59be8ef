"""The conformance suite of the installed test kit, against a server that lives outside the repository."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from echo_server import Echo

import nemo_gym_ckpt
import nemo_gym_ckpt.testing
from nemo_gym_ckpt.config import ServerConfig
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.testing import FakeClock, ParticipantUnderTest, check_participant, conformance
from nemo_gym_ckpt.testing.conformance import CHECKS
from nemo_gym_ckpt.testing.placement import InProcess, checkpoint_config, instance_at, mesh_of
from nemo_gym_ckpt.testing.resources import ResourcesHooks, held

TOKEN = "outside-token-5678"


def test_the_kit_comes_from_the_installed_wheel() -> None:
    site = Path(os.environ["WHEEL_SITE"])
    for module in (nemo_gym_ckpt, nemo_gym_ckpt.testing, conformance):
        assert Path(module.__file__ or "").is_relative_to(site), module.__file__


async def test_an_outside_server_passes_the_conformance_suite(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    root.mkdir()
    clock = FakeClock()
    placement = InProcess()
    server_class = held(Echo)

    @asynccontextmanager
    async def make() -> AsyncIterator[ParticipantUnderTest]:
        url = placement.reserve()
        mesh = mesh_of([instance_at("echo", "resources_servers", "echo", ServerConfig(), url)],
                       checkpoint_config(root, TOKEN, grace_s=5.0))
        ctx = ServerContext("echo", mesh.instance("echo").settings, mesh, placement.mesh_client())
        async with placement.run(server_class(ctx).build_app(clock=clock), url), placement.client(url) as client:
            yield ParticipantUnderTest(client, TOKEN, root, now=clock.now, advance_clock=clock.advance,
                                       data=ResourcesHooks(Echo))
        await ctx.aclose()

    assert await check_participant(make) == {name: "passed" for name in CHECKS}
