"""The commit's pipeline: the writer opens in a thread while the capture runs, and nothing it opened
outlives a failure."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_ckpt.checkpoint.pipeline import ExportPipeline
from nemo_gym_ckpt.checkpoint.records import Scope
from nemo_gym_ckpt.checkpoint.store import CheckpointStore, RecordWriter, StopSignal
from nemo_gym_ckpt.checkpoint.telemetry import Telemetry
from nemo_gym_ckpt.errors import Unavailable

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
