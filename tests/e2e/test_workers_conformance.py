"""The conformance suite against a real 2-worker server: one participant over two processes.

Each participant the suite asks for is a fresh ``calculator_tools`` (stateless) at ``num_workers:
2`` launched from config (the next one starting while a check runs): a main process holding the
port and the coordinator, and two uvicorn worker processes; every control call lands on whichever
worker the kernel picks and is run by the coordinator's one participant. The data-plane hook seeds
sessions (records of the worker that got the seed; after a restore, installed on both workers and
exported once). The suite's ``block`` hook holds a tool call open and releases it through an
in-process gate, which a process of its own cannot offer: those checks answer "not applicable"
(in-process and single-process runs cover them).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.launch.launcher import MeshLauncher
from nemo_gym_ckpt.testing.conformance import CHECKS, NotApplicable, ParticipantUnderTest, check_participant

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

TOKEN = "workers-conformance-token"
NAME = "calc"
WORKERS = 2


class SeedHooks:
    """Seeds a session per episode; cannot hold a call open across processes."""

    async def request(
        self, client: httpx.AsyncClient, episode: RolloutIdentity, payload: dict[str, object]
    ) -> httpx.Response:
        return await client.post(f"/ng-rollout/{episode.capture_key}/seed_session", json=dict(payload))

    async def block(self, client: httpx.AsyncClient, episode: RolloutIdentity, blocked: bool) -> None:
        raise NotApplicable("a held call is released through an in-process gate")


async def until_registered(client: httpx.AsyncClient) -> None:
    """Healthy means one worker serves; wait (bounded) until both registered with the coordinator."""
    deadline = time.monotonic() + 30
    while True:
        reply = await client.get("/ng-control/v1/checkpoint/status", headers={"authorization": f"Bearer {TOKEN}"})
        if reply.json()["extras"]["workers"] == WORKERS:
            return
        assert time.monotonic() < deadline, reply.text
        await asyncio.sleep(0.05)


async def test_a_two_worker_server_passes_the_conformance_suite(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    root.mkdir()
    raw = {
        "head_server": {"host": "127.0.0.1", "port": 0},
        NAME: {"resources_servers": {"calculator_tools": {"num_workers": WORKERS}}},
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "root": str(root), "lease_grace_seconds": 0.5},
    }

    def launched() -> MeshLauncher:
        launcher = MeshLauncher(load_config_dict(raw), on_line=lambda name, line: None)
        launcher.start(ready_timeout_s=60)
        return launcher

    # Every check gets a fresh server; the next one starts while a check runs (a start is most of
    # a check's time here).
    spare: list[asyncio.Future[MeshLauncher]] = [asyncio.ensure_future(asyncio.to_thread(launched))]

    @asynccontextmanager
    async def make() -> AsyncIterator[ParticipantUnderTest]:
        launcher = await spare.pop()
        spare.append(asyncio.ensure_future(asyncio.to_thread(launched)))
        try:
            async with httpx.AsyncClient(base_url=launcher.url_of(NAME), timeout=30) as client:
                await until_registered(client)
                yield ParticipantUnderTest(client, TOKEN, root, data=SeedHooks())
        finally:
            await asyncio.to_thread(launcher.stop)

    try:
        results = await check_participant(make)
    finally:
        (await spare.pop()).stop()
    passed = sorted(name for name, result in results.items() if result == "passed")
    assert sorted(results) == sorted(CHECKS)
    assert [name for name, result in results.items() if result != "passed"] == [
        name for name in CHECKS if name in NEEDS_A_HELD_CALL], results
    assert len(passed) == len(CHECKS) - len(NEEDS_A_HELD_CALL)


NEEDS_A_HELD_CALL = ("prepare_reports_blockers_until_ready",)


def children_of(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(child) for child in text.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return status != "Z"


async def test_with_checkpointing_off_two_workers_serve_without_a_coordinator() -> None:
    raw = {"head_server": {"host": "127.0.0.1", "port": 0},
           NAME: {"resources_servers": {"calculator_tools": {"num_workers": WORKERS}}}}
    launcher = MeshLauncher(load_config_dict(raw), on_line=lambda name, line: None)
    launcher.start(ready_timeout_s=60)
    try:
        assert len(children_of(launcher.pid_of(NAME))) == WORKERS
        async with httpx.AsyncClient(base_url=launcher.url_of(NAME), timeout=30) as client:
            status = await client.get("/ng-control/v1/checkpoint/status")
            assert status.status_code == 404  # no participant, no coordinator
            answers = [await client.post("/add", json={"a": 2, "b": i}) for i in range(4)]
            assert [reply.text for reply in answers] == ["2", "3", "4", "5"]
    finally:
        launcher.stop()


async def test_workers_do_not_outlive_their_main_process(tmp_path: Path) -> None:
    raw = {"head_server": {"host": "127.0.0.1", "port": 0},
           NAME: {"resources_servers": {"calculator_tools": {"num_workers": WORKERS}}},
           "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "root": str(tmp_path)}}
    launcher = MeshLauncher(load_config_dict(raw), on_line=lambda name, line: None)
    launcher.start(ready_timeout_s=60)
    try:
        main = launcher.pid_of(NAME)
        async with httpx.AsyncClient(base_url=launcher.url_of(NAME), timeout=30) as client:
            await until_registered(client)
        workers = children_of(main)
        assert len(workers) == WORKERS
        os.kill(main, signal.SIGKILL)  # the main process only (coordinator and parent): the workers follow
        deadline = time.monotonic() + 20
        while any(alive(pid) for pid in workers):
            assert time.monotonic() < deadline, [pid for pid in workers if alive(pid)]
            await asyncio.sleep(0.1)
    finally:
        launcher.stop()
