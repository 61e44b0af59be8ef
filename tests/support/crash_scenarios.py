"""Real-process crash scenarios: a quickstart mesh whose servers a test pauses, kills and restarts.

``CrashMesh`` wraps a started ``MeshLauncher`` (``configs/quickstart.yaml``, plus the kv_store
environment of ``tests/fixtures/kv_turn.yaml``, checkpointing on) for a test that plays the
controller: it dispatches rollouts, reads every participant's checkpoint ``/status``, drives a
``Coordinator``, and holds the mesh still with real signals instead of timing:

- ``pause(name)`` / ``proceed(name)``: SIGSTOP / SIGCONT a server's process group. A paused server's
  listening socket still accepts connections, so the requests sent to it simply wait in the kernel:
  a paused inference worker leaves every admitted model call in flight at the policy model, a paused
  resources server leaves a verify (or a tool call) in flight at its caller.
- ``admit_calls``: with the worker paused, dispatch rollouts and wait until each one's next model
  call is admitted (all of them then reach the worker as one batch when it continues).
- ``deliver_one_call``: from there, deliver exactly those calls and no later one: a checkpoint is
  prepared (the policy model holds the finished replies), the worker continues until every reply is
  held, is paused again, and the checkpoint is resumed (abort): each rollout gets its reply, makes
  its tool call and waits with its next model call admitted at the paused worker.
- ``crash()``: SIGKILL every server (paused ones too) and start fresh processes on the same ports.
- ``until(probe, ok, what)``: poll with a deadline; ``assert_idle``: nothing held anywhere;
  ``start`` / ``cancel_all``: background work (dispatches, a pending prepare) a failed test leaves.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson

from nemo_gym_ckpt.checkpoint.coordinator import Coordinator
from nemo_gym_ckpt.checkpoint.records import episode_of
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.launch.launcher import MeshLauncher

__all__ = [
    "AUTH",
    "TOKEN",
    "WAIT_S",
    "CrashMesh",
    "holding",
    "mesh_overrides",
    "records_of",
    "snapshot",
    "until",
]

TOKEN = "issue-6-crash-scenarios"
AUTH = {"authorization": f"Bearer {TOKEN}"}
WAIT_S = 60.0
RUN_TIMEOUT_S = 120.0
RESTART_S = 180.0
WORKER, MODEL = "inference_worker", "policy_model"

T = TypeVar("T")


def mesh_overrides(root: Path) -> list[str]:
    return ["head_server.port=0", "checkpoint.enabled=true", f"checkpoint.control_auth_token={TOKEN}",
            f"checkpoint.root={root}"]


async def until(
    probe: Callable[[], Awaitable[T]], ok: Callable[[T], bool], what: str, timeout_s: float = WAIT_S
) -> T:
    """Poll ``probe`` until ``ok`` holds; fail naming ``what`` (and the last value) at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await probe()
        if ok(value):
            return value
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}; last seen {value}"
        await asyncio.sleep(0.01)


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory``, by relative path, with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def records_of(directory: Path, kind: str, instance: str) -> dict[str, dict[str, Any]]:
    """The committed records of one participant, by capture key."""
    where = directory / "gym" / kind / instance
    manifest = orjson.loads((where / "manifest.json").read_bytes())
    lines = (where / manifest["records_file"]).read_bytes().splitlines()
    records = [orjson.loads(line) for line in lines]
    return {episode_of(record).capture_key: record for record in records}


@dataclass
class CrashMesh:
    """A started mesh of real processes and the test's client to it."""

    launcher: MeshLauncher
    root: Path
    client: MeshClient
    _coordinator: Coordinator | None = None
    _tasks: list[asyncio.Task[Any]] = field(default_factory=list)

    async def discover(self) -> None:
        """Find the participants while nothing is paused (discovery asks every server, the worker too).

        Fresh processes come back on the same ports, so the list stays right across crashes.
        """
        self._coordinator = Coordinator(self.launcher.head_url, TOKEN, client=self.client)
        await self._coordinator.discover()

    def coordinator(self) -> Coordinator:
        """The discovered coordinator (on the test's client: leaving ``async with`` closes nothing)."""
        assert self._coordinator is not None, "discover first"
        return self._coordinator

    # ---- reading the participants -----------------------------------------------------------

    async def status(self, name: str) -> dict[str, Any]:
        reply = await self.client.get_json(self.launcher.url_of(name) + "/ng-control/v1/checkpoint/status",
                                           headers=AUTH, rollout_prefix=False)
        assert isinstance(reply, dict)
        return reply

    async def extras(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = (await self.status(name))["extras"]
        return found

    async def counts(self, names: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The status extras of several servers, read at once."""
        found = await asyncio.gather(*(self.extras(name) for name in names))
        return dict(zip(names, found, strict=True))

    # ---- holding the mesh still --------------------------------------------------------------

    def pause(self, *names: str) -> None:
        for name in names:
            assert self.launcher.kill(name, signal.SIGSTOP), f"{name} is not running"

    def proceed(self, *names: str) -> None:
        for name in names:
            self.launcher.kill(name, signal.SIGCONT)

    def proceed_all(self) -> None:
        self.proceed(*self.launcher.names)

    async def crash(self, ready_timeout_s: float = RESTART_S) -> None:
        """SIGKILL every server and start fresh processes on the same ports (all healthy)."""
        await asyncio.to_thread(self.launcher.restart_all, ready_timeout_s)

    def start(self, work: Awaitable[T]) -> asyncio.Task[T]:
        """``work`` in the background; ``cancel_all`` stops it if the test ends before it does."""

        async def run() -> T:
            return await work

        task = asyncio.create_task(run())
        self._tasks.append(task)
        return task

    async def cancel_all(self) -> None:
        """Cancel every background task still running (those of a failed test) and wait for them."""
        pending = [task for task in self._tasks if not task.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- the data plane ----------------------------------------------------------------------

    def dispatch(
        self, env: str, rows: Mapping[RolloutIdentity, dict[str, Any]]
    ) -> dict[RolloutIdentity, asyncio.Task[Any]]:
        """``POST /ng-rollout/<key>/run`` of each row in the background (a controller's dispatch)."""
        url = self.launcher.url_of(env) + "/run"
        return {identity: self.start(self.client.request(
            "POST", url, json=row, identity=identity, check=False, timeout_s=RUN_TIMEOUT_S))
            for identity, row in rows.items()}

    async def admit_calls(
        self, env: str, rows: Mapping[RolloutIdentity, dict[str, Any]]
    ) -> dict[RolloutIdentity, asyncio.Task[Any]]:
        """Dispatch with the worker paused; wait until each rollout's next model call is admitted."""
        before = (await self.extras(MODEL))["active_calls"]
        self.pause(WORKER)
        tasks = self.dispatch(env, rows)
        wanted = before + len(rows)
        await until(lambda: self.extras(MODEL), lambda m: m["active_calls"] == wanted,
                    f"{wanted} model calls admitted at the paused worker")
        assert not any(task.done() for task in tasks.values()), "a rollout ended with the worker paused"
        return tasks

    async def deliver_one_call(self, agent: str, gate_id: str) -> None:
        """Every admitted model call (worker paused) delivered; each rollout's next call admitted.

        The rollouts must each make a tool call and a further model call after this reply (every
        quickstart row does). On return the worker is paused again.
        """
        start = await self.counts([MODEL, agent])
        calls = start[MODEL]["active_calls"]
        async with self.coordinator() as coordinator:
            deadline = time.time() + WAIT_S
            prepared = await coordinator.prepare(gate_id, deadline_ts=deadline)
            assert prepared.prepared, prepared.to_json()
            self.proceed(WORKER)
            await until(lambda: self.extras(MODEL), lambda m: m["held_responses"] == calls,
                        f"{calls} replies held by the policy model")
            self.pause(WORKER)
            await coordinator.resume(gate_id, deadline_ts=deadline)

        def moved_on(now: dict[str, dict[str, Any]]) -> bool:
            model, tools = now[MODEL], now[agent]["tool_calls"] - start[agent]["tool_calls"]
            delivered = model["rows"] - start[MODEL]["rows"]
            return (delivered, tools, model["active_calls"], model["held_responses"]) == (calls, calls, calls, 0)

        await until(lambda: self.counts([MODEL, agent]), moved_on,
                    f"{calls} replies delivered, {calls} tool calls made, {calls} next calls admitted")

    async def assert_idle(self, rollout_ids: Sequence[str]) -> None:
        """Forget ``rollout_ids``; then no participant holds anything or waits for anything."""
        async with self.coordinator() as coordinator:
            await coordinator.forget(list(rollout_ids), deadline_ts=time.time() + WAIT_S)
            statuses = await coordinator.status()
        assert holding(statuses) == [], holding(statuses)


HELD = {
    "environment": ("episodes", "installed"),
    "agent": ("sessions", "running"),
    "model": ("active_calls", "held_responses", "ledgers"),
    "resources": ("sessions", "in_flight_requests"),
}


def holding(statuses: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What the participants still hold, wait for or fence ("" for none): ``name: what`` each."""
    found = []
    for name, status in statuses.items():
        extras = status["extras"]
        what = [f"{key}={extras[key]}" for key in HELD[status["kind"]] if extras[key]]
        what += [f"{key}={status[key]}" for key in ("retired_rollouts", "waiting_requests") if status[key]]
        if status["phase"] != "idle":
            what.append(f"phase={status['phase']}")
        found += [f"{name}: {', '.join(what)}"] if what else []
    return found
