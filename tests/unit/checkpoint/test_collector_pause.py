"""The garbage collector held off while a checkpoint is open: the pause's own rules (holders, a
collector the application turned off, the time bound), a participant that holds it from its first
prepare to its close (resume, lease expiry, shutdown), a worker of a multi-worker server that follows
its coordinator's gate, and the checkpoint block's switch."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_gym_ckpt.checkpoint.collector_pause import PROCESS_COLLECTOR, CollectorPause
from nemo_gym_ckpt.checkpoint.follower import FollowerParticipant
from nemo_gym_ckpt.checkpoint.models import ControlRequest
from nemo_gym_ckpt.checkpoint.mount import mount_checkpointing
from nemo_gym_ckpt.checkpoint.participant import Participant
from nemo_gym_ckpt.checkpoint.store import CheckpointStore
from nemo_gym_ckpt.config import CheckpointConfig
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.server import create_app
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.minimal import SessionsAdapter

from .conftest import GRACE_S, TOKEN

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def collector_on() -> Iterator[None]:
    """Each test starts with the collector on, and leaves it on whatever it asserted."""
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def participant_with(collector: CollectorPause, root: Path, clock: FakeClock) -> Participant:
    adapter = SessionsAdapter()
    participant = Participant(kind="agent", instance="a1", adapter=adapter, store=CheckpointStore(root),
                              lease_grace_s=GRACE_S, clock=clock, collector=collector)
    adapter.participant = participant
    adapter.put(RolloutIdentity("r1"), {"turn": 1})
    return participant


def control(clock: FakeClock, cid: str, seconds: float = 10.0) -> ControlRequest:
    return ControlRequest(checkpoint_id=cid, deadline_ts=clock.now() + seconds)


def test_off_while_any_holder_holds_it_and_back_on_after_the_last() -> None:
    pause, first, second = CollectorPause(), object(), object()
    pause.hold(first)
    pause.hold(second)
    pause.hold(first)  # again: still one holder
    assert not gc.isenabled()
    pause.release(first)
    assert not gc.isenabled()
    pause.release(second)
    pause.release(second)  # idempotent
    assert gc.isenabled()
    assert pause.status() == {"collector_paused": False, "pauses": 1, "timed_out": 0}


def test_a_collector_the_application_turned_off_stays_off() -> None:
    gc.disable()
    pause, holder = CollectorPause(), object()
    pause.hold(holder)
    pause.release(holder)
    assert not gc.isenabled()


def test_the_collector_comes_back_after_the_bound_with_the_holder_still_holding() -> None:
    pause, holder = CollectorPause(max_off_s=0.05), object()
    pause.hold(holder)
    deadline = time.monotonic() + 10.0
    while not gc.isenabled() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gc.isenabled()
    assert pause.status() == {"collector_paused": False, "pauses": 1, "timed_out": 1}
    pause.release(holder)  # the late release changes nothing
    assert gc.isenabled()
    with pytest.raises(ValueError):
        CollectorPause(max_off_s=0)


def test_holding_starts_no_thread_after_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    pause, holder = CollectorPause(), object()
    pause.hold(holder)
    pause.release(holder)
    started: list[threading.Thread] = []
    start = threading.Thread.start

    def counted(thread: threading.Thread) -> None:
        started.append(thread)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", counted)
    for _ in range(3):  # one watchdog for the process's life: nothing started per checkpoint
        pause.hold(holder)
        assert not gc.isenabled()
        pause.release(holder)
    assert gc.isenabled() and started == []


async def test_a_participant_holds_it_from_its_first_prepare_to_the_resume(root: Path, clock: FakeClock) -> None:
    pause = CollectorPause()
    participant = participant_with(pause, root, clock)
    await participant.prepare(control(clock, "c1"))
    assert not gc.isenabled()
    await participant.prepare(control(clock, "c1"))  # a retry
    await participant.resume(control(clock, "c1"))
    assert gc.isenabled()
    assert pause.counts["pauses"] == 1


async def test_the_lease_expiry_and_the_shutdown_give_it_back(root: Path, clock: FakeClock) -> None:
    pause = CollectorPause()
    participant = participant_with(pause, root, clock)
    await participant.prepare(control(clock, "c1"))
    clock.advance(10 + GRACE_S)
    assert participant.status()["phase"] == "idle"
    assert gc.isenabled()
    await participant.prepare(control(clock, "c2"))
    assert not gc.isenabled()
    await participant.aclose()
    assert gc.isenabled()


def test_a_worker_follows_its_coordinators_gate(root: Path, clock: FakeClock) -> None:
    pause = CollectorPause()
    worker = FollowerParticipant(kind="agent", instance="a1", adapter=SessionsAdapter(), store=CheckpointStore(root),
                                 lease_grace_s=GRACE_S, clock=clock, collector=pause)
    worker.follow({"checkpoint_id": "c1", "lease_expires_at": clock.now() + 30, "phase": "preparing"})
    assert not gc.isenabled()
    worker.follow({"checkpoint_id": "c1", "lease_expires_at": clock.now() + 60, "phase": "prepared"})
    assert not gc.isenabled()
    worker.follow({"checkpoint_id": None})
    assert gc.isenabled()


def test_the_checkpoint_block_turns_it_on_by_default_and_off_on_request() -> None:
    def mounted(**settings: object) -> Participant:
        config = CheckpointConfig(enabled=True, control_auth_token=TOKEN, **settings)
        participant = mount_checkpointing(create_app("t"), config, SessionsAdapter(), kind="agent",
                                          instance="a1")
        assert participant is not None
        return participant

    assert mounted().collector is PROCESS_COLLECTOR
    assert mounted(pause_garbage_collection=False).collector is None
