"""The public test kit: check a checkpoint participant of your own against the contract.

A server author installs ``nemo-gym-ckpt`` and runs ``check_participant`` against their server
(docs/participants.md, "Testing your participant")::

    from nemo_gym_ckpt.testing import ParticipantUnderTest, check_participant

    async def test_my_server_keeps_the_contract(tmp_path):
        @asynccontextmanager
        async def make():  # a fresh server per check, checkpointing on, root tmp_path
            app = my_create_app(...)
            async with app.router.lifespan_context(app), httpx.AsyncClient(
                    transport=httpx.ASGITransport(app), base_url="http://server") as client:
                yield ParticipantUnderTest(client, TOKEN, tmp_path, data=MyHooks())

        results = await check_participant(make)

The modules: ``conformance`` (the suite), ``transports`` (apps in process), ``placement`` (in
process or on sockets), ``environments``, ``agents`` and ``resources`` (per-kind harnesses),
``scripted_model``, ``tally``, ``clock`` (``FakeClock``), ``waits`` (``until``), ``crashfs``
(``CrashFS``), ``minimal`` (a minimal participant).
"""

from __future__ import annotations

from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.conformance import DataHooks, NotApplicable, ParticipantUnderTest, check_participant
from nemo_gym_ckpt.testing.crashfs import CrashFS, SimulatedCrash
from nemo_gym_ckpt.testing.transports import InProcessMesh, RoutingTransport
from nemo_gym_ckpt.testing.waits import until, until_sync

__all__ = [
    "CrashFS",
    "DataHooks",
    "FakeClock",
    "InProcessMesh",
    "NotApplicable",
    "ParticipantUnderTest",
    "RoutingTransport",
    "SimulatedCrash",
    "check_participant",
    "until",
    "until_sync",
]
