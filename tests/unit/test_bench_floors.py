"""The disk floors of the scale bench (``bench/floors.py``): what they write, and that they leave nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_gym_ckpt.bench import floors
from nemo_gym_ckpt.checkpoint.store import RecordWriter

pytestmark = pytest.mark.unit


def test_writes_at_once_commits_every_participant_together_through_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    finished: list[tuple[str, int]] = []
    finish = RecordWriter.finish

    def noted(writer: RecordWriter, kind: str, instance: str, checkpoint_id: str) -> object:
        manifest = finish(writer, kind, instance, checkpoint_id)
        finished.append((instance, writer.bytes))
        return manifest

    monkeypatch.setattr(RecordWriter, "finish", noted)
    speed = floors.writes_at_once(tmp_path, {"agent": 300_000, "model": 120_000, "resources": 5_000})
    assert speed > 0
    assert sorted(finished) == [("agent", 300_000), ("model", 120_000), ("resources", 5_000)]
    assert list(tmp_path.iterdir()) == []  # its directory removed


def test_the_sequential_floor_writes_at_least_a_mib_and_leaves_nothing(tmp_path: Path) -> None:
    assert floors.sequential_floor(tmp_path, 10) > 0 and list(tmp_path.iterdir()) == []
