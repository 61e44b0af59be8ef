"""The commit's pipeline: the writer opens in a thread while the capture runs, nothing it opened
outlives a failure, and all of it runs with prompt hand-offs of the interpreter's lock."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest

from nemo_gym_ckpt.checkpoint.pipeline import ExportPipeline
from nemo_gym_ckpt.checkpoint.records import Record, Scope
from nemo_gym_ckpt.checkpoint.store import CheckpointStore, RecordWriter, StopSignal
from nemo_gym_ckpt.checkpoint.switching import COMMIT_SWITCH_INTERVAL_S, prompt_switching
from nemo_gym_ckpt.checkpoint.telemetry import Telemetry
from nemo_gym_ckpt.errors import InternalError, Unavailable
from tests.support.loop_turns import TurnCounter

pytestmark = pytest.mark.unit

WAIT_S = 5.0


class _Adapter:
    """Exports two records; ``started`` is set once the capture runs, ``fail`` makes it raise."""

    def __init__(self, *, fail: bool = False) -> None:
        self.started = threading.Event()
        self.fail = fail

    async def export(self, scope: Scope | None) -> AsyncIterator[dict[str, Any]]:
        self.started.set()
        for rollout in ("r1", "r2"):
            if self.fail:
                raise RuntimeError("the capture broke")
            yield {"episode_id": {"rollout_id": rollout, "attempt": 0}, "n": 1}


def _pipeline(adapter: _Adapter) -> ExportPipeline:
    return ExportPipeline(adapter, None, Telemetry("agent", "a1"), "c1")  # type: ignore[arg-type]


def _leftovers(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.rglob("*.tmp"))


async def test_the_writer_opens_while_the_capture_runs(root: Path) -> None:
    adapter = _Adapter()
    store = CheckpointStore(root)

    def open_writer() -> RecordWriter:
        if not adapter.started.wait(WAIT_S):  # opened before the capture began: the two ran in turn
            raise AssertionError("the writer was opened before the capture started")
        return store.open_writer(root / "c1", "agent", "a1", StopSignal())

    manifest, exported = await _pipeline(adapter).run(open_writer, "agent", "a1")
    assert exported == ["r1", "r2"] and manifest.record_count == 2


async def test_a_failed_capture_aborts_the_writer_it_opened(root: Path) -> None:
    store = CheckpointStore(root)
    opened: list[RecordWriter] = []

    def open_writer() -> RecordWriter:
        writer = store.open_writer(root / "c1", "agent", "a1", StopSignal())
        opened.append(writer)
        return writer

    with pytest.raises(RuntimeError, match="the capture broke"):
        await _pipeline(_Adapter(fail=True)).run(open_writer, "agent", "a1")
    assert len(opened) == 1 and _leftovers(root) == []


async def test_a_failed_open_ends_the_commit_with_its_error(root: Path) -> None:
    def open_writer() -> RecordWriter:
        raise Unavailable("the disk is gone")

    pipeline = _pipeline(_Adapter())
    with pytest.raises(Unavailable, match="the disk is gone"):
        await pipeline.run(open_writer, "agent", "a1")
    assert pipeline.timings == {}


class _SeeingWriter(RecordWriter):
    """A records writer that notes the switch interval its thread runs under."""

    seen: list[float]

    def write_records(self, records: Any) -> None:
        self.seen.append(sys.getswitchinterval())
        super().write_records(records)


async def test_the_open_the_capture_and_the_write_run_with_prompt_switching(root: Path) -> None:
    store = CheckpointStore(root)
    seen: list[float] = []
    before = sys.getswitchinterval()
    assert before > COMMIT_SWITCH_INTERVAL_S  # CPython's default, 5 ms

    def open_writer() -> RecordWriter:
        seen.append(sys.getswitchinterval())
        writer = store.open_writer(root / "c1", "agent", "a1", StopSignal())
        writer.__class__ = _SeeingWriter
        cast("_SeeingWriter", writer).seen = seen
        return writer

    await _pipeline(_Adapter()).run(open_writer, "agent", "a1")
    assert seen == pytest.approx([COMMIT_SWITCH_INTERVAL_S] * 2, rel=0.05)  # opened, then written
    assert sys.getswitchinterval() == before


async def test_a_failed_commit_puts_the_switch_interval_back(root: Path) -> None:
    before = sys.getswitchinterval()

    def open_writer() -> RecordWriter:
        raise Unavailable("the disk is gone")

    with pytest.raises(Unavailable):
        await _pipeline(_Adapter()).run(open_writer, "agent", "a1")
    assert sys.getswitchinterval() == before


def test_overlapping_entries_set_the_interval_once_and_the_last_one_out_puts_it_back() -> None:
    before = sys.getswitchinterval()
    first, second = prompt_switching(), prompt_switching()
    first.__enter__()
    second.__enter__()
    assert sys.getswitchinterval() == pytest.approx(COMMIT_SWITCH_INTERVAL_S, rel=0.05)
    first.__exit__(None, None, None)  # the other commit still writes
    assert sys.getswitchinterval() == pytest.approx(COMMIT_SWITCH_INTERVAL_S, rel=0.05)
    second.__exit__(None, None, None)
    assert sys.getswitchinterval() == before


def test_a_lower_interval_already_set_is_kept() -> None:
    before = sys.getswitchinterval()
    sys.setswitchinterval(COMMIT_SWITCH_INTERVAL_S / 5)
    try:
        with prompt_switching():
            assert sys.getswitchinterval() == pytest.approx(COMMIT_SWITCH_INTERVAL_S / 5, rel=0.05)
        assert sys.getswitchinterval() == pytest.approx(COMMIT_SWITCH_INTERVAL_S / 5, rel=0.05)
    finally:
        sys.setswitchinterval(before)


class _AtOnce:
    """Hands its records over in one list (``ExportAtOnce``); ``batch=None`` declines, so the
    pipeline streams ``export``; ``streamed`` counts how often it did."""

    def __init__(self, batch: list[Record] | None, streamed: list[Record] | None = None) -> None:
        self.batch, self.stream, self.streamed = batch, streamed or [], 0

    def export_at_once(self, scope: Scope | None) -> list[Record] | None:
        return self.batch

    async def export(self, scope: Scope | None) -> AsyncIterator[Record]:
        self.streamed += 1
        for record in self.stream:
            yield record


def _record(rollout: str, **extra: Any) -> Record:
    return Record.from_data({"episode_id": {"rollout_id": rollout, "attempt": 0}, **extra})


async def _capture(adapter: _AtOnce, scope: Scope | None) -> tuple[list[Record], list[str]]:
    pipeline = ExportPipeline(cast(Any, adapter), scope, Telemetry("environment", "e1"), "c1")
    return await pipeline._capture()


async def test_an_adapter_list_is_taken_whole_without_a_stream() -> None:
    batch = [_record("r1"), _record("r2", n=1), _record("r2", n=2)]
    adapter = _AtOnce(batch, streamed=[_record("other")])
    records, exported = await _capture(adapter, frozenset(record.episode for record in batch))
    assert records == batch and exported == ["r1", "r2"] and adapter.streamed == 0


async def test_a_declined_list_falls_back_to_the_stream() -> None:
    adapter = _AtOnce(None, streamed=[_record("r1"), _record("r2")])
    records, exported = await _capture(adapter, None)
    assert exported == ["r1", "r2"] and adapter.streamed == 1 and len(records) == 2


async def test_records_outside_the_scope_are_left_out_of_a_list_too() -> None:
    inside, outside = _record("r1"), _record("r9")
    records, exported = await _capture(_AtOnce([inside, outside]), frozenset({inside.episode}))
    assert records == [inside] and exported == ["r1"]


async def test_a_reference_in_a_list_is_refused_as_in_a_stream() -> None:
    reference = Record.from_raw(b'{"episode_id":{"rollout_id":"r1","attempt":0},"same_as":"x"}')
    with pytest.raises(InternalError, match="mark a reference"):
        await _capture(_AtOnce([_record("r2"), reference]), None)


class _TurnNoting(_Adapter):
    """Hands its two records over whole (``ExportAtOnce``), noting the turn of the loop it was asked in."""

    def __init__(self, counter: TurnCounter) -> None:
        super().__init__()
        self.counter = counter
        self.asked_at_turn: int | None = None

    def export_at_once(self, scope: Scope | None) -> list[Record]:
        self.asked_at_turn = self.counter.turns
        return [Record.from_data({"episode_id": {"rollout_id": rollout, "attempt": 0}, "n": 1})
                for rollout in ("r1", "r2")]


async def test_a_list_handed_over_whole_and_the_writers_thread_start_in_the_turn_the_commit_began(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a busy server a turn of the loop is every callback ready when it began: neither the
    capture nor the thread that opens the writer may wait for one to start."""
    store = CheckpointStore(root)
    loop = asyncio.get_running_loop()
    submitted_at_turn: list[int] = []
    submit = loop.run_in_executor

    def noted_submit(executor: Any, work: Any, *args: Any) -> asyncio.Future[Any]:
        submitted_at_turn.append(counter.turns)
        return submit(executor, work, *args)

    monkeypatch.setattr(loop, "run_in_executor", noted_submit)
    counter = TurnCounter()
    adapter = _TurnNoting(counter)
    manifest, exported = await _pipeline(adapter).run(
        lambda: store.open_writer(root / "c1", "agent", "a1", StopSignal()), "agent", "a1")
    counter.stop()
    assert (adapter.asked_at_turn, submitted_at_turn[0], exported) == (0, 0, ["r1", "r2"])
    assert manifest.record_count == 2


async def test_the_write_is_handed_to_its_thread_before_the_writer_is_open(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write's thread takes the writer from the opening thread: the loop awaits no opening (each
    thread result awaited there is turns of a busy loop later) and the commit's one await is the write."""
    store = CheckpointStore(root)
    loop = asyncio.get_running_loop()
    handed: list[str] = []
    submit = loop.run_in_executor

    def noted_submit(executor: Any, work: Any, *args: Any) -> asyncio.Future[Any]:
        handed.append(getattr(getattr(work, "args", (None,))[0], "__name__", repr(work)))
        return submit(executor, work, *args)

    def open_writer() -> RecordWriter:
        deadline = time.monotonic() + 2.0
        while len(handed) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        seen_while_opening.extend(handed)
        return store.open_writer(root / "c1", "agent", "a1", StopSignal())

    seen_while_opening: list[str] = []
    monkeypatch.setattr(loop, "run_in_executor", noted_submit)
    manifest, _ = await _pipeline(_Adapter()).run(open_writer, "agent", "a1")
    assert len(seen_while_opening) == 2, f"handed to threads while the writer opened: {seen_while_opening}"
    assert manifest.record_count == 2
