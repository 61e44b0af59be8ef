"""The participant core in process: jobs that outlive requests, the lease on a fake clock,
admission, fencing memory, failures of the disk, corrupted checkpoints, and the off switch."""

from __future__ import annotations

import asyncio
import errno
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import fastapi.routing
import httpx
import orjson
import pytest

from nemo_gym_ckpt.checkpoint import incremental
from nemo_gym_ckpt.checkpoint.adapter import ExportItem
from nemo_gym_ckpt.checkpoint.models import (
    CommitRequest,
    ControlRequest,
    ForgetRequest,
    RestoreRequest,
    RetireRequest,
)
from nemo_gym_ckpt.checkpoint.mount import mount_checkpointing
from nemo_gym_ckpt.checkpoint.participant import READINESS_GRACE_S, REMEMBERED_IDS, Participant
from nemo_gym_ckpt.checkpoint.records import Scope
from nemo_gym_ckpt.checkpoint.router import CONTROL_PREFIX
from nemo_gym_ckpt.checkpoint.store import CheckpointStore
from nemo_gym_ckpt.config import CheckpointConfig, MeshConfig
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.errors import (
    CheckpointConflict,
    DeadlineExceeded,
    InvalidPhase,
    RestartInScope,
    RolloutIdRequired,
    StaleAttempt,
    StaleCheckpoint,
)
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.server import create_app
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.conformance import expect_error
from nemo_gym_ckpt.testing.crashfs import CrashFS
from nemo_gym_ckpt.testing.minimal import SessionsAdapter, create_minimal_server
from tests.support.loop_turns import TurnCounter

from .conftest import FAKE_CLOCK_START, GRACE_S, TOKEN, ServerFactory, client_of, until

pytestmark = pytest.mark.unit

WAIT_S = 10.0


class GatedAdapter(SessionsAdapter):
    """Sessions whose export waits at a gate: the test decides when a commit's export goes on."""

    def __init__(self) -> None:
        super().__init__()
        self.exports = 0
        self.started = asyncio.Event()
        self.gate = asyncio.Event()
        self.retire_gate = asyncio.Event()
        self.retire_gate.set()

    async def export(self, scope: Scope | None) -> AsyncIterator[ExportItem]:
        self.exports += 1
        self.started.set()
        await self.gate.wait()
        async for item in super().export(scope):
            yield item

    async def retire(self, episodes: Any) -> None:
        await self.retire_gate.wait()
        await super().retire(episodes)


@pytest.fixture
def gated(root: Path, clock: FakeClock) -> Participant:
    adapter = GatedAdapter()
    participant = Participant(
        kind="agent",
        instance="a1",
        adapter=adapter,
        store=CheckpointStore(root),
        lease_grace_s=GRACE_S,
        clock=clock,
    )
    adapter.participant = participant
    adapter.put(RolloutIdentity("r1"), {"turn": 1})
    adapter.put(RolloutIdentity("r2", 1), {"turn": 4})
    return participant


def adapter_of(participant: Participant) -> GatedAdapter:
    assert isinstance(participant.adapter, GatedAdapter)
    return participant.adapter


def control(clock: FakeClock, cid: str, seconds: float = 30.0) -> ControlRequest:
    return ControlRequest(checkpoint_id=cid, deadline_ts=clock.now() + seconds)


def commit_request(
    clock: FakeClock, cid: str, directory: Path, seconds: float = 30.0, **extra: Any
) -> CommitRequest:
    return CommitRequest(
        checkpoint_id=cid, deadline_ts=clock.now() + seconds, checkpoint_dir=str(directory), **extra
    )


async def committed(participant: Participant, clock: FakeClock, directory: Path) -> None:
    """Checkpoint ``c1`` prepared and committed into ``directory`` (the export let go), not resumed."""
    adapter_of(participant).gate.set()
    await participant.prepare(control(clock, "c1"))
    await participant.commit(commit_request(clock, "c1", directory))


def manifests(root: Path) -> list[Path]:
    return sorted(root.rglob("manifest.json"))


# ---- one export and one write per checkpoint id ----------------------------------------------------


async def test_a_retried_commit_awaits_the_same_work(
    gated: Participant, clock: FakeClock, root: Path
) -> None:
    adapter = adapter_of(gated)
    await gated.prepare(control(clock, "c1"))
    first = asyncio.create_task(gated.commit(commit_request(clock, "c1", root / "ck")))
    await asyncio.wait_for(adapter.started.wait(), WAIT_S)
    second = asyncio.create_task(gated.commit(commit_request(clock, "c1", root / "ck", seconds=60)))
    with pytest.raises(CheckpointConflict):
        await gated.commit(commit_request(clock, "c1", root / "other"))
    adapter.gate.set()
    replies = await asyncio.wait_for(asyncio.gather(first, second), WAIT_S)
    assert replies[0] == replies[1] and replies[0]["episode_ids"] == ["r1", "r2-a1"]
    assert adapter.exports == 1
    assert len(list((root / "ck").rglob("records-*.jsonl"))) == 1
    assert gated.phase == "committed"


async def test_status_tells_what_the_last_commit_wrote_and_how_long_it_took(
    gated: Participant, clock: FakeClock, root: Path
) -> None:
    assert gated.status()["last_commit"] is None
    await committed(gated, clock, root / "ck")
    last = gated.status()["last_commit"]
    [records] = (root / "ck").rglob("records-*.jsonl")
    assert (last["checkpoint_id"], last["records"], last["bytes"]) == ("c1", 2, records.stat().st_size)
    assert last["capture_ms"] >= 0 and last["write_ms"] > 0
    assert 0 < last["write_cpu_ms"] <= last["write_ms"] + 1  # one clock per thread, its own rounding
    assert 0 <= last["sync_ms"] <= last["write_ms"]  # the fsyncs of the write are inside it


async def test_the_index_of_a_commit_is_made_after_resume_not_inside_the_pause(
    gated: Participant, clock: FakeClock, root: Path
) -> None:
    await committed(gated, clock, root / "ck")
    assert gated.store.unsettled  # committed, still paused: the per-record index is not made yet
    await gated.resume(control(clock, "c1"))
    assert await gated.wait_idle(WAIT_S)
    assert not gated.store.unsettled and gated.store.base is not None
    assert len(gated.store.base.episodes) == 2


async def test_the_index_is_made_on_the_loop_in_steps_with_others_run_between(
    gated: Participant, clock: FakeClock, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No other thread makes it (one that holds the interpreter's lock while the scheduler leaves it
    waiting stalls the loop): each step (here one record) runs in the loop's thread, and the loop
    runs other tasks between two steps."""
    monkeypatch.setattr(incremental, "INDEX_STEP", 1)
    log: list[tuple[str, bool]] = []
    settle_steps = gated.store.settle_steps

    def watched() -> Iterator[None]:
        for step in settle_steps():
            log.append(("step", threading.current_thread() is threading.main_thread()))
            yield step

    async def ticking() -> None:
        while True:
            log.append(("tick", True))
            await asyncio.sleep(0)

    monkeypatch.setattr(gated.store, "settle_steps", watched)
    await committed(gated, clock, root / "ck")
    ticker = asyncio.create_task(ticking())
    await gated.resume(control(clock, "c1"))
    assert await gated.wait_idle(WAIT_S)
    ticker.cancel()
    steps = [number for number, (what, _) in enumerate(log) if what == "step"]
    assert len(steps) == 2 and all(on_loop for what, on_loop in log if what == "step")
    assert any(what == "tick" for what, _ in log[steps[0] + 1:steps[1]])
    assert not gated.store.unsettled and gated.store.base is not None and len(gated.store.base.episodes) == 2


async def test_the_work_outlives_the_deadline_of_the_request_that_started_it(
    gated: Participant, clock: FakeClock, root: Path
) -> None:
    adapter = adapter_of(gated)
    await gated.prepare(control(clock, "c1"))
    first = asyncio.create_task(gated.commit(commit_request(clock, "c1", root / "ck", seconds=5)))
    await asyncio.wait_for(adapter.started.wait(), WAIT_S)
    clock.advance(6)
    with pytest.raises(DeadlineExceeded, match="same call again"):
        await asyncio.wait_for(first, WAIT_S)
    retry = asyncio.create_task(gated.commit(commit_request(clock, "c1", root / "ck", seconds=5)))
    adapter.gate.set()
    reply = await asyncio.wait_for(retry, WAIT_S)
    assert reply["manifest"]["record_count"] == 2 and adapter.exports == 1


async def test_a_checkpoint_resumed_before_its_write_finished_never_gets_a_manifest(
    gated: Participant, clock: FakeClock, root: Path
) -> None:
    adapter = adapter_of(gated)
    await gated.prepare(control(clock, "c1"))
    pending = asyncio.create_task(gated.commit(commit_request(clock, "c1", root / "ck")))
    await asyncio.wait_for(adapter.started.wait(), WAIT_S)
    assert (await gated.resume(control(clock, "c1")))["idempotent"] is False
    adapter.gate.set()
    with pytest.raises(StaleCheckpoint):
        await asyncio.wait_for(pending, WAIT_S)
    assert await gated.wait_idle(WAIT_S)
    assert manifests(root) == [] and not list(root.rglob("*.tmp"))
    with pytest.raises(StaleCheckpoint):
        await gated.commit(commit_request(clock, "c1", root / "ck"))
    assert gated.phase == "idle"


async def test_a_resume_racing_the_commit_point_orders_cleanly(root: Path, clock: FakeClock) -> None:
    """The writer is held in its thread just before the manifest link while the resume arrives."""
    adapter = SessionsAdapter()
    gate = GateFS("rename")
    participant = Participant(
        kind="agent",
        instance="a1",
        adapter=adapter,
        store=CheckpointStore(root, gate),
        lease_grace_s=GRACE_S,
        clock=clock,
    )
    adapter.put(RolloutIdentity("r1"), {"x": 1})
    await participant.prepare(control(clock, "c1"))
    pending = asyncio.create_task(participant.commit(commit_request(clock, "c1", root / "ck")))
    assert await asyncio.to_thread(gate.reached.wait, WAIT_S)
    await participant.resume(control(clock, "c1"))
    gate.release.set()
    with pytest.raises(StaleCheckpoint):
        await asyncio.wait_for(pending, WAIT_S)
    assert await participant.wait_idle(WAIT_S)
    assert manifests(root) == []


class GateFS(CrashFS):
    """Holds the writer thread before one operation until the test releases it."""

    def __init__(self, operation: str) -> None:
        super().__init__()
        import threading

        self.operation = operation
        self.reached = threading.Event()
        self.release = threading.Event()

    def rename(self, src: Path, dst: Path) -> None:
        if self.operation == "rename":
            self.reached.set()
            assert self.release.wait(WAIT_S)
        super().rename(src, dst)


# ---- the lease and admission -----------------------------------------------------------------------


async def test_lease_expiry_resumes_releases_waiters_and_fences(gated: Participant, clock: FakeClock) -> None:
    await gated.prepare(control(clock, "c1", seconds=10))
    waiting = asyncio.create_task(gated.admit(RolloutIdentity("new")))
    await until(lambda: gated.status()["waiting_requests"] == 1)
    clock.advance(10 + GRACE_S - 1)
    assert gated.status()["phase"] == "prepared" and not waiting.done()
    clock.advance(1)
    await asyncio.wait_for(waiting, WAIT_S)
    assert gated.phase == "idle" and gated.checkpoint_id is None
    with pytest.raises(StaleCheckpoint):
        await gated.prepare(control(clock, "c1"))


async def test_every_control_call_for_the_open_id_renews_the_lease(
    gated: Participant, clock: FakeClock
) -> None:
    await gated.prepare(control(clock, "c1", seconds=10))
    await gated.prepare(control(clock, "c1", seconds=100))  # a retry returns the stored reply and renews
    assert gated.status()["lease_expires_at"] == clock.now() + 100 + GRACE_S
    clock.advance(10 + GRACE_S + 1)
    assert gated.status()["phase"] == "prepared"
    reply = await gated.renew(control(clock, "c1", seconds=5))
    assert reply["lease_expires_at"] == clock.now() + 5 + GRACE_S
    clock.advance(5 + GRACE_S)
    assert gated.status()["phase"] == "idle"


async def test_data_plane_admission(gated: Participant, clock: FakeClock) -> None:
    with pytest.raises(RolloutIdRequired):
        await gated.admit(None)
    await gated.admit(RolloutIdentity("r"))
    await gated.retire(
        RetireRequest(
            checkpoint_id="h", deadline_ts=clock.now() + 5, episode_ids=[{"rollout_id": "r", "attempt": 1}]
        )
    )
    with pytest.raises(StaleAttempt):
        await gated.admit(RolloutIdentity("r", 1))
    await gated.admit(RolloutIdentity("r", 2))
    await gated.prepare(control(clock, "c1"))
    waiting = asyncio.create_task(gated.admit(RolloutIdentity("q", 0)))
    with pytest.raises(DeadlineExceeded):
        await gated.admit(RolloutIdentity("q", 1), deadline_ts=clock.now())
    retired_while_waiting = asyncio.create_task(gated.admit(RolloutIdentity("r", 2)))
    await until(lambda: gated.status()["waiting_requests"] == 2)
    await gated.resume(control(clock, "c1"))
    await asyncio.wait_for(waiting, WAIT_S)
    await asyncio.wait_for(retired_while_waiting, WAIT_S)


async def test_readiness_changes_do_not_wake_the_requests_that_wait_for_resume(
    gated: Participant, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every episode that parks tells the prepare that readiness changed; the requests already
    waiting for resume must sleep on through it (woken each time, N parked requests cost O(N^2))."""
    waits = 0
    sleep_until = clock.sleep_until

    async def counted(ts: float) -> None:
        nonlocal waits
        waits += 1
        await sleep_until(ts)

    monkeypatch.setattr(clock, "sleep_until", counted)
    await gated.prepare(control(clock, "c1"))
    waiting = [asyncio.create_task(gated.admit(RolloutIdentity(f"w{i}"))) for i in range(20)]
    await until(lambda: gated.status()["waiting_requests"] == 20)
    for _ in range(5):  # let each one's timer start
        await asyncio.sleep(0)
    settled = waits
    for _ in range(50):
        gated.notify_changed()
        await asyncio.sleep(0)
    assert waits == settled, f"{waits - settled} wake-ups of waiting requests for 50 readiness changes"
    await gated.resume(control(clock, "c1"))
    await asyncio.wait_for(asyncio.gather(*waiting), WAIT_S)


async def test_a_retired_attempt_waiting_for_resume_is_refused_at_once(
    gated: Participant, clock: FakeClock, root: Path
) -> None:
    await committed(gated, clock, root / "ck")
    await gated.resume(control(clock, "c1"))
    fresh = Participant(
        kind="agent",
        instance="a1",
        adapter=SessionsAdapter(),
        store=CheckpointStore(root),
        lease_grace_s=GRACE_S,
        clock=clock,
    )
    await fresh.restore(
        RestoreRequest(
            checkpoint_id="r1",
            deadline_ts=clock.now() + 30,
            checkpoint_dir=str(root / "ck"),
            episode_ids=[{"rollout_id": "r1"}],
        )
    )
    waiting = asyncio.create_task(fresh.admit(RolloutIdentity("r1", 1)))
    other = asyncio.create_task(fresh.admit(RolloutIdentity("r2", 2)))
    await until(lambda: fresh.status()["waiting_requests"] == 2)
    await fresh.retire(
        RetireRequest(
            checkpoint_id="r1", deadline_ts=clock.now() + 5, episode_ids=[{"rollout_id": "r1", "attempt": 1}]
        )
    )
    with pytest.raises(StaleAttempt):
        await asyncio.wait_for(waiting, WAIT_S)
    assert not other.done()
    await fresh.resume(control(clock, "r1"))
    await asyncio.wait_for(other, WAIT_S)
    assert fresh.phase == "idle"


async def test_prepare_waits_for_readiness_within_its_deadline(gated: Participant, clock: FakeClock) -> None:
    adapter = adapter_of(gated)
    adapter.set_busy(RolloutIdentity("r1"), True)
    pending = asyncio.create_task(gated.prepare(control(clock, "c1", seconds=3)))
    await until(lambda: gated.status()["report"] is not None)
    clock.advance(3)
    reply = await asyncio.wait_for(pending, WAIT_S)
    assert reply == {
        "phase": "preparing",
        "report": {
            "ready": False,
            "blockers": ["r1"],
            "blocker_count": 1,
            "counts": {"sessions": 2},
            "restarts": [],
        },
    }
    retry = asyncio.create_task(gated.prepare(control(clock, "c1", seconds=3)))
    adapter.set_busy(RolloutIdentity("r1"), False)
    assert (await asyncio.wait_for(retry, WAIT_S))["phase"] == "prepared"


async def test_a_prepare_waiting_when_the_checkpoint_is_resumed_stops(
    gated: Participant, clock: FakeClock
) -> None:
    adapter_of(gated).set_busy(RolloutIdentity("r1"), True)
    pending = asyncio.create_task(gated.prepare(control(clock, "c1")))
    await until(lambda: gated.status()["report"] is not None)
    await gated.resume(control(clock, "c1"))
    with pytest.raises(StaleCheckpoint):
        await asyncio.wait_for(pending, WAIT_S)


class WindowAdapter(GatedAdapter):
    """Records the pause window the participant reports (``PauseWindow``)."""

    def __init__(self) -> None:
        super().__init__()
        self.window: list[tuple[str, str, float | None]] = []

    def paused(self, checkpoint_id: str, until_ts: float) -> None:
        self.window.append(("paused", checkpoint_id, until_ts))

    def resumed(self, checkpoint_id: str) -> None:
        self.window.append(("resumed", checkpoint_id, None))


async def test_the_pause_window_opens_once_ready_and_closes_at_the_resume_or_the_lease(
    root: Path, clock: FakeClock
) -> None:
    adapter = WindowAdapter()
    participant = Participant(kind="agent", instance="a1", adapter=adapter, store=CheckpointStore(root),
                              lease_grace_s=GRACE_S, clock=clock)
    adapter.participant = participant
    adapter.put(RolloutIdentity("r1"), {"turn": 1})
    adapter.set_busy(RolloutIdentity("r1"), True)
    pending = asyncio.create_task(participant.prepare(control(clock, "c1", seconds=10)))
    await until(lambda: participant.status()["report"] is not None)
    assert adapter.window == []  # not ready: the work is not parked, nothing is paused
    adapter.set_busy(RolloutIdentity("r1"), False)
    await asyncio.wait_for(pending, WAIT_S)
    await participant.prepare(control(clock, "c1", seconds=10))  # a retry opens no second window
    await participant.resume(control(clock, "c1"))
    await participant.resume(control(clock, "c1"))
    await participant.prepare(control(clock, "c2", seconds=10))
    clock.advance(10 + GRACE_S)
    assert participant.status()["phase"] == "idle"
    expiry = FAKE_CLOCK_START + 10 + GRACE_S
    assert adapter.window == [("paused", "c1", expiry), ("resumed", "c1", None),
                              ("paused", "c2", clock.now()), ("resumed", "c2", None)]


async def test_the_blockers_listed_are_capped_but_restarts_are_not(
    gated: Participant, clock: FakeClock
) -> None:
    adapter = adapter_of(gated)
    for n in range(150):
        adapter.put(RolloutIdentity(f"busy{n}"), {}).busy = True
        adapter.put(RolloutIdentity(f"restart{n}"), {}, restart=True)
    pending = asyncio.create_task(gated.prepare(control(clock, "c1", seconds=1)))
    await until(lambda: gated.status()["report"] is not None)
    clock.advance(1)
    report = (await asyncio.wait_for(pending, WAIT_S))["report"]
    assert (
        len(report["blockers"]) == 100 and report["blocker_count"] == 150 and len(report["restarts"]) == 150
    )


async def test_commit_needs_a_ready_participant_and_no_restart_in_scope(
    gated: Participant, clock: FakeClock, root: Path
) -> None:
    adapter = adapter_of(gated)
    adapter.gate.set()
    adapter.put(RolloutIdentity("rs"), {}, restart=True)
    await gated.prepare(control(clock, "c1"))
    with pytest.raises(RestartInScope, match="restart") as refused:
        await gated.commit(commit_request(clock, "c1", root / "ck", episode_ids=[{"rollout_id": "rs"}]))
    assert (refused.value.code, refused.value.status) == ("restart_in_scope", 409)
    await gated.resume(control(clock, "c1"))
    await gated.prepare(control(clock, "c2"))
    adapter.set_busy(RolloutIdentity("r1"), True)
    with pytest.raises(InvalidPhase, match="ready"):
        await gated.commit(commit_request(clock, "c2", root / "ck2"))
    with pytest.raises(InvalidPhase):  # a stored failure: one write per checkpoint id
        await gated.commit(commit_request(clock, "c2", root / "ck2"))
    await gated.resume(control(clock, "c2"))


async def test_the_last_64_resumed_ids_are_remembered(gated: Participant, clock: FakeClock) -> None:
    for n in range(REMEMBERED_IDS + 1):
        await gated.resume(control(clock, f"old{n}"))
    with pytest.raises(StaleCheckpoint):
        await gated.prepare(control(clock, "old1"))
    assert (await gated.prepare(control(clock, "old0")))["phase"] == "prepared"


async def test_retire_waits_for_the_work_to_end_within_the_deadline(
    gated: Participant, clock: FakeClock
) -> None:
    adapter = adapter_of(gated)
    adapter.retire_gate.clear()
    request = RetireRequest(
        checkpoint_id="h", deadline_ts=clock.now() + 5, episode_ids=[{"rollout_id": "r1"}]
    )
    pending = asyncio.create_task(gated.retire(request))
    await until(lambda: gated.status()["retired_rollouts"] == 1)
    with pytest.raises(StaleAttempt):  # fenced before the work has ended
        await gated.admit(RolloutIdentity("r1"))
    clock.advance(5)
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(pending, WAIT_S)
    adapter.retire_gate.set()
    assert await gated.retire(request.model_copy(update={"deadline_ts": clock.now() + 5})) == {
        "retired": ["r1"]
    }
    assert "r1" not in adapter.sessions


class SlowInstall(SessionsAdapter):
    """Installs at a gate, checking first that it holds nothing (as the resources adapter does)."""

    def __init__(self) -> None:
        super().__init__()
        self.installs = 0
        self.gate = asyncio.Event()

    async def install(self, records: Any, scope: Scope) -> None:
        assert not self.sessions
        self.installs += 1
        await self.gate.wait()
        await super().install(records, scope)


async def restoring(root: Path, clock: FakeClock, cid: str) -> tuple[Participant, SlowInstall, asyncio.Task[Any]]:
    """A fresh participant restoring ``c1`` (of ``r1`` and ``r2``) under ``cid``, its install at the gate."""
    source = SessionsAdapter()
    writer = Participant(kind="agent", instance="a1", adapter=source, store=CheckpointStore(root),
                         lease_grace_s=GRACE_S, clock=clock)
    source.participant = writer
    source.put(RolloutIdentity("r1"), {"turn": 1})
    source.put(RolloutIdentity("r2"), {"turn": 2})
    await writer.prepare(control(clock, "c1"))
    await writer.commit(commit_request(clock, "c1", root / "ck"))
    await writer.aclose()
    adapter = SlowInstall()
    participant = Participant(kind="agent", instance="a1", adapter=adapter, store=CheckpointStore(root),
                              lease_grace_s=GRACE_S, clock=clock)
    adapter.participant = participant
    task = asyncio.create_task(participant.restore(restore_request(clock, cid, root / "ck", ["r1", "r2"])))
    await until(lambda: adapter.installs == 1)
    return participant, adapter, task


def restore_request(clock: FakeClock, cid: str, directory: Path, rollouts: list[str]) -> RestoreRequest:
    return RestoreRequest(checkpoint_id=cid, deadline_ts=clock.now() + 30, checkpoint_dir=str(directory),
                          episode_ids=[{"rollout_id": rollout} for rollout in rollouts])


async def test_a_restore_still_installing_after_a_resume_keeps_a_second_one_out(root: Path, clock: FakeClock) -> None:
    participant, adapter, first = await restoring(root, clock, "ra")
    await participant.resume(control(clock, "ra"))  # the install goes on to its end
    with pytest.raises(InvalidPhase, match="fresh process"):
        await participant.restore(restore_request(clock, "rb", root / "ck", ["r1", "r2"]))
    adapter.gate.set()
    assert (await asyncio.wait_for(first, WAIT_S))["restored"] == ["r1-a1", "r2-a1"]
    assert adapter.installs == 1
    await participant.aclose()


async def test_a_retire_during_a_restore_frees_what_the_install_puts_back(root: Path, clock: FakeClock) -> None:
    participant, adapter, restore = await restoring(root, clock, "rc")
    retire = asyncio.create_task(participant.retire(RetireRequest(
        checkpoint_id="rc", deadline_ts=clock.now() + 30, episode_ids=[{"rollout_id": "r1", "attempt": 1}])))
    await asyncio.sleep(0.05)
    assert not retire.done()  # it waits for the install
    adapter.gate.set()
    assert (await asyncio.wait_for(retire, WAIT_S)) == {"retired": ["r1-a1"]}
    await asyncio.wait_for(restore, WAIT_S)
    assert sorted(adapter.sessions) == ["r2-a1"]
    await participant.aclose()


class GatedReadStore(CheckpointStore):
    """A store whose reads wait at a gate (a big checkpoint read on a loaded machine)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate, self.reading = threading.Event(), threading.Event()

    def read(self, *args: Any, **kwargs: Any) -> Any:
        self.reading.set()
        assert self.gate.wait(WAIT_S)
        return super().read(*args, **kwargs)


async def reading(root: Path, clock: FakeClock, rollouts: list[str]) -> tuple[Participant, SessionsAdapter,
                                                                            GatedReadStore, asyncio.Task[Any]]:
    """A fresh participant restoring ``rollouts`` from ``c1``, its read at the gate."""
    source = SessionsAdapter()
    writer = Participant(kind="agent", instance="a1", adapter=source, store=CheckpointStore(root),
                         lease_grace_s=GRACE_S, clock=clock)
    source.participant = writer
    for turn, rollout in enumerate(rollouts):
        source.put(RolloutIdentity(rollout), {"turn": turn})
    await writer.prepare(control(clock, "c1"))
    await writer.commit(commit_request(clock, "c1", root / "ck"))
    await writer.aclose()
    adapter, store = SessionsAdapter(), GatedReadStore(root)
    participant = Participant(kind="agent", instance="a1", adapter=adapter, store=store, lease_grace_s=GRACE_S,
                              clock=clock)
    adapter.participant = participant
    task = asyncio.create_task(participant.restore(restore_request(clock, "rx", root / "ck", rollouts)))
    await until(store.reading.is_set)
    return participant, adapter, store, task


async def test_undoing_a_restore_still_reading_answers_at_once_and_leaves_the_process_fresh(
    root: Path, clock: FakeClock
) -> None:
    participant, adapter, store, restore = await reading(root, clock, ["r1", "r2"])
    retire = participant.retire(RetireRequest(checkpoint_id="rx", deadline_ts=clock.now() + 30,
                                              episode_ids=[{"rollout_id": "r1", "attempt": 1},
                                                           {"rollout_id": "r2", "attempt": 1}]))
    # the coordinator's undo of a restore past its deadline: retire the next attempts, then resume
    assert (await asyncio.wait_for(retire, 1.0)) == {"retired": ["r1-a1", "r2-a1"]}
    await participant.resume(control(clock, "rx"))
    store.gate.set()
    with pytest.raises(StaleCheckpoint, match="resumed"):
        await asyncio.wait_for(restore, WAIT_S)
    assert participant.fresh and adapter.sessions == {}
    await participant.aclose()


async def test_what_is_retired_or_forgotten_while_the_restore_reads_is_not_installed(
    root: Path, clock: FakeClock
) -> None:
    participant, adapter, store, restore = await reading(root, clock, ["r1", "r2", "r3"])
    await asyncio.wait_for(participant.retire(RetireRequest(
        checkpoint_id="rx", deadline_ts=clock.now() + 30, episode_ids=[{"rollout_id": "r1", "attempt": 1}])), 1.0)
    await asyncio.wait_for(participant.forget(ForgetRequest(
        checkpoint_id="rx", deadline_ts=clock.now() + 30, rollout_ids=["r2"])), 1.0)
    store.gate.set()
    assert (await asyncio.wait_for(restore, WAIT_S))["restored"] == ["r3-a1"]
    assert sorted(adapter.sessions) == ["r3-a1"]
    await participant.aclose()


class SlowReadiness(GatedAdapter):
    async def readiness(self) -> Any:
        await self.gate.wait()
        return await super().readiness()


async def test_a_readiness_that_outlasts_the_deadline_answers_preparing_at_the_deadline(
    root: Path, clock: FakeClock
) -> None:
    adapter = SlowReadiness()
    participant = Participant(kind="agent", instance="a1", adapter=adapter, store=CheckpointStore(root),
                              lease_grace_s=GRACE_S, clock=clock)
    adapter.participant = participant
    pending = asyncio.create_task(participant.prepare(control(clock, "c1", seconds=3)))
    await asyncio.sleep(0.05)
    clock.advance(3)
    await asyncio.sleep(0.05)
    assert not pending.done()  # a grace past the deadline, for an adapter that answers with its blockers
    clock.advance(READINESS_GRACE_S)
    assert (await asyncio.wait_for(pending, WAIT_S)) == {"phase": "preparing", "report": None}
    adapter.gate.set()
    assert (await participant.prepare(control(clock, "c1", seconds=3)))["phase"] == "prepared"
    await participant.aclose()


# ---- a failing disk --------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
async def test_a_disk_error_during_commit_is_clear_and_the_participant_stays_resumable(
    make_server: ServerFactory, root: Path, code: int
) -> None:
    ops = CrashFS()
    server = make_server(file_ops=ops)
    server.adapter.put(RolloutIdentity("r1"), {"x": 1})
    async with client_of(server) as client:
        earlier = await cycle(client, "c0", str(root / "earlier"))
        before = snapshot(root / "earlier")
        ops.fail_next, ops.fail_errno = "write", code
        await call(client, "prepare", "c1")
        response = await client.post(
            f"{CONTROL_PREFIX}/commit", json=body("c1", checkpoint_dir=str(root / "later"))
        )
        error = expect_error(response, "unavailable", "commit on a failing disk")
        assert errno.errorcode[code] in error["detail"] and ops.fail_next is None
        assert (await call(client, "status"))["phase"] == "prepared"
        assert (await call(client, "resume", "c1"))["phase"] == "idle"
        assert snapshot(root / "earlier") == before and manifests(root / "later") == []
        again = await cycle(client, "c2", str(root / "again"), incremental=False)  # a full write
        assert again["manifest"]["records_sha256"] == earlier["manifest"]["records_sha256"]


async def test_control_replies_are_rendered_once_by_orjson_not_by_the_framework(
    make_server: ServerFactory, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit reply lists every episode of its scope (4,096 in the scale bench): the route hands
    back the JSON response itself, so FastAPI never validates and re-serializes the reply."""

    def refuse(**_: Any) -> Any:
        raise AssertionError("FastAPI serialized a control reply")

    monkeypatch.setattr(fastapi.routing, "serialize_response", refuse)
    server = make_server()
    server.adapter.put(RolloutIdentity("r1"), {"x": 1})
    async with client_of(server) as client:
        committed = await cycle(client, "c1", str(root / "ck"))
        assert committed["episode_ids"] == ["r1"] and (await call(client, "status"))["phase"] == "idle"


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


def body(cid: str, seconds: float = 30.0, **extra: Any) -> dict[str, Any]:
    """A control body with a deadline ahead of the fixtures' fake clock (which stays at its start here)."""
    return {"checkpoint_id": cid, "deadline_ts": FAKE_CLOCK_START + seconds, **extra}


async def call(client: httpx.AsyncClient, op: str, cid: str = "", **extra: Any) -> dict[str, Any]:
    if op == "status":
        response = await client.get(f"{CONTROL_PREFIX}/status")
    else:
        response = await client.post(f"{CONTROL_PREFIX}/{op}", json=body(cid, **extra))
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


async def cycle(client: httpx.AsyncClient, cid: str, directory: str, **commit: Any) -> dict[str, Any]:
    await call(client, "prepare", cid)
    committed = await call(client, "commit", cid, checkpoint_dir=directory, **commit)
    await call(client, "resume", cid)
    return committed


# ---- corrupted checkpoints -------------------------------------------------------------------------


def _flip_a_byte(where: Path, records: Path) -> None:
    content = bytearray(records.read_bytes())
    content[len(content) // 2] ^= 0x01
    records.write_bytes(bytes(content))


def _edit_manifest(**fields: Any) -> Callable[[Path, Path], None]:
    def edit(where: Path, records: Path) -> None:
        manifest = orjson.loads((where / "manifest.json").read_bytes())
        manifest.update(fields)
        (where / "manifest.json").write_bytes(orjson.dumps(manifest))

    return edit


def _name_another_file(where: Path, records: Path) -> None:
    other = where / ("records-" + "0" * 64 + ".jsonl")
    other.write_bytes(b'{"episode_id":{"rollout_id":"r1","attempt":0},"state":{"evil":true}}\n')
    _edit_manifest(records_file=other.name)(where, records)


def _symlinked_records(where: Path, records: Path) -> None:
    elsewhere = where.parent / "copy.jsonl"
    shutil.move(records, elsewhere)
    records.symlink_to(elsewhere)


CORRUPTIONS: dict[str, Callable[[Path, Path], None]] = {
    "flipped byte": _flip_a_byte,
    "truncated by a byte": lambda where, records: records.write_bytes(records.read_bytes()[:-1]),
    "a record missing": lambda where, records: records.write_bytes(
        b"".join(records.read_bytes().splitlines(keepends=True)[:-1])
    ),
    "records file missing": lambda where, records: records.unlink(),
    "manifest missing": lambda where, records: (where / "manifest.json").unlink(),
    "manifest not json": lambda where, records: (where / "manifest.json").write_bytes(b"{"),
    "wrong kind": _edit_manifest(kind="model"),
    "wrong instance": _edit_manifest(instance="someone-else"),
    "wrong schema": _edit_manifest(schema_version=2),
    "wrong count": _edit_manifest(record_count=3),
    "an extra field": _edit_manifest(extra=1),
    "manifest names another file": _name_another_file,
    "manifest names a path": _edit_manifest(records_file="../../../records.jsonl"),
    "records file is a symlink": _symlinked_records,
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
async def test_a_corrupted_checkpoint_is_refused_and_nothing_is_installed(
    make_server: ServerFactory, root: Path, corruption: str
) -> None:
    source = make_server()
    source.adapter.put(RolloutIdentity("r1"), {"x": 1})
    source.adapter.put(RolloutIdentity("r2"), {"x": 2})
    async with client_of(source) as client:
        committed = await cycle(client, "c1", str(root / "ck"))
    shutil.copytree(root / "ck", root / "pristine")
    where = root / "ck" / "gym" / "resources" / "sessions"
    CORRUPTIONS[corruption](where, where / committed["manifest"]["records_file"])
    fresh = make_server()
    scope = [{"rollout_id": "r1"}, {"rollout_id": "r2"}]
    async with client_of(fresh) as client:
        response = await client.post(
            f"{CONTROL_PREFIX}/restore", json=body("bad", checkpoint_dir=str(root / "ck"), episode_ids=scope)
        )
        expect_error(response, "invalid_checkpoint_state", corruption)
        assert fresh.adapter.sessions == {}
        await call(client, "resume", "bad")
        restored = await call(
            client, "restore", "good", checkpoint_dir=str(root / "pristine"), episode_ids=scope
        )
        assert restored["restored"] == ["r1-a1", "r2-a1"]


async def test_a_checkpoint_dir_outside_the_root_is_an_invalid_request(make_server: ServerFactory) -> None:
    server = make_server()
    async with client_of(server) as client:
        for directory in ("../elsewhere", "/", "relative-to-the-working-directory"):
            response = await client.post(
                f"{CONTROL_PREFIX}/restore", json=body("r", checkpoint_dir=directory, episode_ids=[])
            )
            expect_error(response, "invalid_request", directory)
        assert server.adapter.sessions == {} and (await call(client, "status"))["phase"] == "idle"


# ---- off by default --------------------------------------------------------------------------------


async def test_without_the_block_nothing_is_mounted(config: CheckpointConfig) -> None:
    off = create_minimal_server("plain", CheckpointConfig())
    assert off.participant is None
    assert not [route for route in off.app.routes if "ng-control" in getattr(route, "path", "")]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(off.app), base_url="http://plain") as client:
        response = await client.get(f"{CONTROL_PREFIX}/status", headers={"authorization": f"Bearer {TOKEN}"})
        expect_error(response, "not_found", "status with checkpointing off")
        response = await client.post("/ng-rollout/r1/session", json={"state": {"a": 1}})
        assert response.status_code == 200
    mesh = MeshConfig(head_server=None, checkpoint=CheckpointConfig(), instances={}, raw={})  # type: ignore[arg-type]
    app = create_app("ctx")
    assert (
        mount_checkpointing(
            app,
            ServerContext(name="ctx", settings=None, mesh=mesh),
            SessionsAdapter(),  # type: ignore[arg-type]
            kind="agent",
        )
        is None
    )
    on = mount_checkpointing(create_app("on"), config, SessionsAdapter(), kind="agent", instance="on")
    assert isinstance(on, Participant)
    await on.aclose()


def test_participant_arguments_are_checked(root: Path) -> None:
    store = CheckpointStore(root)
    for kind, instance, grace in (("judge", "a", 1.0), ("agent", "../a", 1.0), ("agent", "a", 0.0)):
        with pytest.raises(ValueError):
            Participant(
                kind=kind, instance=instance, adapter=SessionsAdapter(), store=store, lease_grace_s=grace
            )


async def test_a_prepare_with_nothing_in_flight_answers_in_the_turn_it_was_asked(root: Path) -> None:
    """On a busy server each turn of the event loop is every callback ready when it began: a prepare
    whose readiness is known at once must not wait for any turn (it waited three)."""
    adapter = SessionsAdapter()
    participant = Participant(kind="agent", instance="a1", adapter=adapter, store=CheckpointStore(root),
                              lease_grace_s=GRACE_S)
    adapter.participant = participant
    adapter.put(RolloutIdentity("r1"), {"turn": 1})
    counter = TurnCounter()
    reply = await participant.prepare(ControlRequest(checkpoint_id="c1", deadline_ts=time.time() + 10))
    assert (counter.stop(), reply["phase"]) == (0, "prepared")
    await participant.resume(ControlRequest(checkpoint_id="c1", deadline_ts=time.time() + 10))
    await participant.aclose()


class _TurnNotingAdapter(SessionsAdapter):
    """Notes the turn of the loop in which a commit's work ended (``committed`` is its last step)."""

    counter: TurnCounter | None = None
    ended_at_turn: int | None = None

    async def committed(self, scope: Scope | None) -> dict[str, Any]:
        assert self.counter is not None
        self.ended_at_turn = self.counter.turns
        return dict(await super().committed(scope))


async def test_a_commits_reply_reaches_its_caller_one_turn_after_its_work_ends(root: Path) -> None:
    """The job's task settles its callers' futures in its last step: through a done callback of the
    task (``asyncio.shield``) the reply came two turns of a busy loop after the work, not one."""
    adapter = _TurnNotingAdapter()
    participant = Participant(kind="agent", instance="a1", adapter=adapter, store=CheckpointStore(root),
                              lease_grace_s=GRACE_S)
    adapter.participant = participant
    adapter.put(RolloutIdentity("r1"), {"turn": 1})
    deadline = time.time() + 10
    await participant.prepare(ControlRequest(checkpoint_id="c1", deadline_ts=deadline))
    adapter.counter = TurnCounter()
    reply = await participant.commit(CommitRequest(checkpoint_id="c1", deadline_ts=deadline,
                                                   checkpoint_dir=str(root / "c1")))
    turns = adapter.counter.stop()
    assert adapter.ended_at_turn is not None and reply["phase"] == "committed"
    assert turns - adapter.ended_at_turn == 1
    await participant.resume(ControlRequest(checkpoint_id="c1", deadline_ts=deadline))
    await participant.aclose()
