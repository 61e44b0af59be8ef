"""Full garbage collections on a schedule: no automatic full collection while scheduled, one every
interval from the thread, none while a checkpoint holds the collector (tried again once it lets go),
Python's thresholds given back by the last user, and an app that schedules them from its start to its
shutdown when the checkpoint block asks (the default) and not when it sets ``null``."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator

import pytest

from nemo_gym_ckpt.checkpoint.collector_pause import CollectorPause
from nemo_gym_ckpt.checkpoint.collector_schedule import NEVER, PROCESS_FULL_COLLECTIONS, FullCollections
from nemo_gym_ckpt.checkpoint.mount import mount_checkpointing
from nemo_gym_ckpt.config import CheckpointConfig
from nemo_gym_ckpt.server import create_app
from nemo_gym_ckpt.testing.minimal import SessionsAdapter

from .conftest import TOKEN

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def python_thresholds() -> Iterator[None]:
    """Each test starts and ends with the collector on and the process's own thresholds."""
    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    gc.enable()
    yield
    gc.set_threshold(*thresholds)
    (gc.enable if enabled else gc.disable)()


def full_collections_while(work: Callable[[], None]) -> int:
    """How many full collections Python ran during ``work``."""
    before = gc.get_stats()[2]["collections"]
    work()
    return int(gc.get_stats()[2]["collections"] - before)


def promote_many_objects() -> None:
    """What a busy server does: objects that live long enough to reach the oldest generation."""
    kept = []
    for _ in range(60):
        kept.append([[] for _ in range(5_000)])
        gc.collect(1)  # survivors of a middle collection move to the oldest generation
    kept.clear()


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_scheduled_means_no_automatic_full_collection() -> None:
    gc.set_threshold(700, 10, 10)
    assert full_collections_while(promote_many_objects) > 0  # Python's own schedule collects
    schedule = FullCollections(CollectorPause())
    schedule.start(3600.0)
    try:
        assert gc.get_threshold() == (700, 10, NEVER)
        assert full_collections_while(promote_many_objects) == 0
    finally:
        schedule.stop()
    assert gc.get_threshold() == (700, 10, 10)


def test_the_thread_collects_every_interval() -> None:
    schedule = FullCollections(CollectorPause())
    schedule.start(0.05)
    try:
        assert wait_for(lambda: schedule.counts["full_collections"] >= 2)
        assert schedule.status()["scheduled"] and schedule.status()["last_full_collection_ms"] is not None
    finally:
        schedule.stop()
    assert not schedule.running


def test_none_while_a_checkpoint_holds_the_collector_and_one_once_it_lets_go() -> None:
    pause, holder = CollectorPause(), object()
    schedule = FullCollections(pause)
    pause.hold(holder)
    try:
        assert not schedule.collect_now()
        schedule.start(0.05)
        assert wait_for(lambda: schedule.counts["put_off"] >= 2)
        assert schedule.counts["full_collections"] == 0
        pause.release(holder)
        assert wait_for(lambda: schedule.counts["full_collections"] >= 1)
    finally:
        pause.release(holder)
        schedule.stop()


def test_a_collector_the_application_turned_off_is_left_alone() -> None:
    schedule = FullCollections(CollectorPause())
    gc.disable()
    assert full_collections_while(lambda: schedule.collect_now()) == 0
    assert schedule.counts == {"full_collections": 0, "put_off": 1}


def test_the_last_user_gives_the_thresholds_back() -> None:
    gc.set_threshold(700, 10, 10)
    schedule = FullCollections(CollectorPause())
    schedule.start(60.0)
    schedule.start(30.0)
    assert schedule.status()["interval_s"] == 30.0
    schedule.stop()
    assert schedule.running and gc.get_threshold() == (700, 10, NEVER)
    schedule.stop()
    schedule.stop()  # one stop too many changes nothing
    assert not schedule.running and gc.get_threshold() == (700, 10, 10)
    with pytest.raises(ValueError):
        schedule.start(0)


@pytest.mark.parametrize("interval", [300.0, None])
async def test_an_app_schedules_them_from_its_start_to_its_shutdown(interval: float | None) -> None:
    config = CheckpointConfig(enabled=True, control_auth_token=TOKEN, full_collection_interval_seconds=interval)
    app = create_app("t")
    assert mount_checkpointing(app, config, SessionsAdapter(), kind="agent", instance="a1") is not None
    assert not PROCESS_FULL_COLLECTIONS.running
    async with app.router.lifespan_context(app):
        assert PROCESS_FULL_COLLECTIONS.running is (interval is not None)
    assert not PROCESS_FULL_COLLECTIONS.running


def test_the_interval_is_bounded() -> None:
    assert CheckpointConfig().full_collection_interval_seconds == 300.0
    for bad in (0, -1, 86_401):
        with pytest.raises(ValueError):
            CheckpointConfig(full_collection_interval_seconds=bad)
