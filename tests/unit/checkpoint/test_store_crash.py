"""Crash points of the write path: before and after every write, fsync, rename and link.

At each point the process dies (``SimulatedCrash``: no clean-up runs). Two views of what is left
are checked: the files as they are (the process died, the machine did not), and only what was made
durable (the machine lost power: unsynced data and unsynced directory entries are dropped). In
both, either there is no checkpoint (no manifest) or a complete one; never a manifest whose records
are missing, short or different.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_gym_ckpt.checkpoint.records import Record
from nemo_gym_ckpt.checkpoint.store import MANIFEST_NAME, CheckpointStore, StopSignal
from nemo_gym_ckpt.errors import InvalidCheckpointState
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.testing.crashfs import CrashFS, SimulatedCrash

pytestmark = pytest.mark.unit

RECORDS = [
    Record.from_data(
        {"episode_id": {"rollout_id": f"r{n}", "attempt": 0}, "state": {"n": n, "pad": "x" * 50}}
    )
    for n in range(5)
]
SCOPE = frozenset(r.episode for r in RECORDS)


def commit(ops: CrashFS, root: Path, directory: Path) -> None:
    writer = CheckpointStore(root, ops).open_writer(directory, "agent", "a1", StopSignal())
    writer.write_lines([r.raw for r in RECORDS[:2]])
    writer.write_lines([r.raw for r in RECORDS[2:]])
    writer.finish("agent", "a1", "c1")


def outcome(root: Path, directory: Path) -> str:
    """``none`` (no manifest), ``complete`` (every record, exactly), or ``torn`` (anything else)."""
    where = directory / "gym" / "agent" / "a1"
    if not (where / MANIFEST_NAME).exists():
        return "none"
    try:
        read = CheckpointStore(root).read(directory, "agent", "a1", SCOPE)
    except InvalidCheckpointState:
        return "torn"
    return "complete" if [r.raw for r in read.records] == [r.raw for r in RECORDS] else "torn"


def after_power_loss(ops: CrashFS, root: Path, directory: Path, view: Path, entries: str = "durable") -> str:
    """The outcome in a durable view: data as fsynced, entries as fsync_dir'ed (or all of them)."""
    ops.materialize(root, view, entries=entries)
    return outcome(view, view / directory.name)


def crash_points(root: Path) -> list[str]:
    ops = CrashFS()
    commit(ops, root, root / "dry-run")
    return ops.calls


def test_the_write_path_has_the_expected_operations(root: Path) -> None:
    calls = crash_points(root)
    for name in ("write", "fsync", "rename", "link", "fsync_dir", "open", "close", "mkdir"):
        assert name in calls
    assert calls.index("fsync") < calls.index("rename") < calls.index("link") < len(calls) - 1
    assert calls[-1] == "fsync_dir"


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
def test_every_crash_point_leaves_no_checkpoint_or_a_complete_one(
    root: Path, tmp_path: Path, after: bool
) -> None:
    seen: dict[str, set[str]] = {"live": set(), "durable": set()}
    for index, name in enumerate(crash_points(root)):
        ops = CrashFS(crash_at=index, after=after)
        directory = root / f"crash-{index}"
        with pytest.raises(SimulatedCrash):
            commit(ops, root, directory)
        live = outcome(root, directory)
        durable = after_power_loss(ops, root, directory, tmp_path / f"view-{index}")
        writeback = after_power_loss(ops, root, directory, tmp_path / f"writeback-{index}", "live")
        assert "torn" not in (live, durable, writeback), (
            f"torn checkpoint at a crash {'after' if after else 'before'} {name} (#{index}): "
            f"{live=} {durable=} {writeback=}"
        )
        seen["live"].add(live)
        seen["durable"].add(durable)
    assert "none" in seen["durable"]
    if after:  # a crash after the last directory fsync keeps the checkpoint, even through a power loss
        assert "complete" in seen["durable"] and "complete" in seen["live"]


def test_the_model_catches_a_store_that_forgets_to_fsync(root: Path, tmp_path: Path) -> None:
    """The crash model can fail: without the records fsync, a power loss tears the checkpoint."""
    outcomes = []
    for index in range(len(crash_points(root))):
        ops = CrashFS(crash_at=index, after=True, skip_fsync=True)
        directory = root / f"lazy-{index}"
        with pytest.raises(SimulatedCrash):
            commit(ops, root, directory)
        outcomes.append(after_power_loss(ops, root, directory, tmp_path / f"view-{index}"))
    assert "torn" in outcomes


def test_the_scope_of_the_read_does_not_matter_for_integrity(root: Path) -> None:
    commit(CrashFS(), root, root / "ok")
    read = CheckpointStore(root).read(root / "ok", "agent", "a1", frozenset({RolloutIdentity("r3")}))
    assert [r.episode for r in read.records] == [RolloutIdentity("r3")]
