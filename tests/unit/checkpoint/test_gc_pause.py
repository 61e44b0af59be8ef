"""Automatic garbage collection is off while a checkpoint is open in a server process (gc_pause)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from nemo_gym_ckpt.checkpoint.gc_pause import CollectionHold, pause_collection_during_checkpoints

pytestmark = pytest.mark.unit


@pytest.fixture
def active() -> Iterator[None]:
    assert gc.isenabled()
    pause_collection_during_checkpoints()
    try:
        yield
    finally:
        pause_collection_during_checkpoints(False)
        gc.enable()


def test_off_from_the_first_hold_to_the_last_release(active: None) -> None:
    first, second = CollectionHold(), CollectionHold()
    first.hold()
    first.hold()  # idempotent: still one holder
    second.hold()
    assert not gc.isenabled()
    first.release()
    first.release()
    assert not gc.isenabled(), "another participant still holds it"
    second.release()
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off(active: None) -> None:
    gc.disable()
    hold = CollectionHold()
    hold.hold()
    hold.release()
    assert not gc.isenabled()


def test_a_process_that_did_not_ask_keeps_collecting() -> None:
    hold = CollectionHold()
    hold.hold()
    assert gc.isenabled()
    hold.release()
    assert gc.isenabled()
