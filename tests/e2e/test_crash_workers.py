"""Issue 15 item 4 on real processes: a resources server, an agent and an environment of 2 workers each.

One mesh: ``configs/quickstart.yaml`` with ``calculator_tools``, ``simple_agent`` and
``single_agent_turn`` at ``num_workers: 2`` (each one port, two uvicorn worker processes, one coordinator and one
participant), checkpointing on. A few rollouts run uninterrupted for reference; the same rows are
then checkpointed in flight (each rollout past a model call and a tool call, its next model call
admitted), every server is SIGKILLed, fresh processes restore, and the continued attempts finish
with the reference rows, token arrays included, each exactly once, no call made twice. Each
multi-worker server wrote one manifest, and the mesh ends idle across both workers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import load_config
from nemo_gym_ckpt.launch.launcher import MeshLauncher
from tests.e2e.test_checkpoint_mesh import model_calls
from tests.e2e.test_crash_scenarios import (
    AGENT,
    ENV,
    MODEL,
    RESOURCES,
    assert_reference_rows,
    batched,
    checkpoint,
    lost,
    next_rows,
    of,
    reference,
    restore,
)
from tests.support.crash_scenarios import CrashMesh, holding, mesh_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
WORKERS = 2
ROLLOUTS = 4


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MeshLauncher, Path]]:
    root = tmp_path_factory.mktemp("checkpoints")
    overrides = [f"{RESOURCES}.resources_servers.{RESOURCES}.num_workers={WORKERS}",
                 f"{AGENT}.responses_api_agents.{AGENT}.num_workers={WORKERS}",
                 f"{ENV}.environment_servers.{ENV}.num_workers={WORKERS}"]
    config = load_config([ROOT / "configs/quickstart.yaml"], [*mesh_overrides(root), *overrides])
    started = MeshLauncher(config)
    started.start(ready_timeout_s=180)
    try:
        yield started, root
    finally:
        started.stop()


@pytest.fixture
async def mesh(launcher: tuple[MeshLauncher, Path]) -> AsyncIterator[CrashMesh]:
    async with MeshClient() as client:
        crash = CrashMesh(launcher[0], launcher[1], client)
        await crash.discover()
        try:
            yield crash
        finally:
            await crash.cancel_all()
            crash.proceed_all()


async def test_multi_worker_resources_and_agent_continue_after_a_crash_with_the_uninterrupted_rows(
    mesh: CrashMesh,
) -> None:
    for name in (RESOURCES, AGENT, ENV):
        extras = await mesh.extras(name)
        assert (extras["workers"], extras["expected_workers"]) == (WORKERS, WORKERS), extras
    rows = of("calculator", "w", range(ROLLOUTS))
    expected = await reference(mesh, ENV, rows, "w-reference-gate")
    tasks = await mesh.admit_calls(ENV, rows)
    await mesh.deliver_one_call(AGENT, "w-gate")  # each: a model call and a tool call, the next call in flight
    directory, scope = await checkpoint(mesh, "w", tasks)
    assert len(scope) == ROLLOUTS
    for kind, name in (("resources", RESOURCES), ("agent", AGENT), ("environment", ENV)):  # one manifest each
        assert sorted(p.name for p in (directory / "gym" / kind).iterdir()) == [name]
        assert (directory / "gym" / kind / name / "manifest.json").is_file()
    await mesh.crash()
    await lost(tasks)

    restored = await restore(mesh, "w-restore", directory, scope)
    assert restored.continued() == [e.next_attempt() for e in scope]
    finished = await batched(mesh, ENV, next_rows(rows, restored.continued()))
    counts = await mesh.counts([MODEL, AGENT])

    assert_reference_rows(finished, expected)
    calls = sum(model_calls(row) for row in expected.values())
    assert (counts[MODEL]["rows"], counts[MODEL]["ledgers"]) == (calls, ROLLOUTS)
    assert counts[AGENT]["tool_calls"] == 0  # every tool call was made before the checkpoint, once
    await mesh.assert_idle([e.rollout_id for e in scope])
    async with mesh.coordinator() as coordinator:
        assert holding(await coordinator.status()) == []
