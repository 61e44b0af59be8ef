"""The durability steps of a commit (docs/protocol.md section 6, step 4): the files fsynced at once,
and no name, directory fsync or link before the fsyncs it depends on have returned."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path

import pytest

from nemo_gym_ckpt.checkpoint.fileops import FileOps
from nemo_gym_ckpt.checkpoint.store import MANIFEST_NAME, CheckpointStore, RecordWriter, StopSignal
from nemo_gym_ckpt.errors import Unavailable

pytestmark = pytest.mark.unit

LINES = [b'{"episode_id":{"rollout_id":"r1","attempt":0}}', b'{"episode_id":{"rollout_id":"r2","attempt":0}}']
SLOW_S = 0.05


class OrderOps(FileOps):
    """Real operations, logged in the order they returned (from any thread); the fsync of a file whose
    name starts with one of ``slow`` returns ``SLOW_S`` late, that of ``failing`` fails (ENOSPC), and
    with ``together`` every fsync waits for the others of its step (a barrier of that many)."""

    def __init__(self, slow: tuple[str, ...] = (), failing: str | None = None, together: int = 0) -> None:
        self.log: list[tuple[str, str]] = []
        self.names: dict[int, str] = {}
        self.slow, self.failing = slow, failing
        self.barrier = threading.Barrier(together, timeout=2) if together else None
        self._lock = threading.Lock()

    def _note(self, op: str, name: str) -> None:
        with self._lock:
            self.log.append((op, name))

    def open_new(self, path: Path) -> int:
        fd = super().open_new(path)
        self.names[fd] = path.name
        return fd

    def fsync(self, fd: int) -> None:
        name = self.names[fd]
        if self.barrier is not None:
            self.barrier.wait()  # breaks (BrokenBarrierError) unless all of them are in fsync at once
        if self.failing is not None and name.startswith(self.failing):
            raise OSError(errno.ENOSPC, "No space left on device")
        if name.startswith(self.slow):
            time.sleep(SLOW_S)
        super().fsync(fd)
        self._note("fsynced", name)

    def rename(self, src: Path, dst: Path) -> None:
        super().rename(src, dst)
        self._note("renamed", src.name)

    def fsync_dir(self, path: Path) -> None:
        super().fsync_dir(path)
        self._note("fsync_dir", path.name)

    def link(self, src: Path, dst: Path) -> None:
        super().link(src, dst)
        self._note("linked", src.name)


def commit(ops: FileOps, root: Path) -> RecordWriter:
    """One commit with a third file handed over (as the policy model's sidecar is), and its writer."""
    writer = CheckpointStore(root, ops).open_writer(root / "ck", "model", "m1", StopSignal())
    if isinstance(ops, OrderOps):
        ops.log.clear()  # the directories' creation, each fsynced in its parent: not the commit's steps
    try:
        temp = writer.directory / ".extra-0123456789abcdef.tmp"
        writer.sync_with_records(ops.write_new_unsynced(temp, [b"extra\n"]), temp, writer.directory / "extra-file")
        writer.write_lines(LINES)
        writer.finish("model", "m1", "c1")
    except BaseException:
        writer.abort()
        raise
    return writer


def test_the_files_of_a_commit_are_fsynced_at_once(root: Path) -> None:
    """The extra file, the records and the manifest's temporary file: three fsyncs in flight together
    (each waits for the other two; one after another, the first would wait in vain)."""
    ops = OrderOps(together=3)
    writer = commit(ops, root)
    assert (writer.directory / MANIFEST_NAME).exists()
    assert [op for op, _ in ops.log[:3]] == ["fsynced"] * 3


def test_no_name_directory_fsync_or_link_comes_before_the_fsyncs_it_depends_on(root: Path) -> None:
    """Each file fsynced (the call returned) before it is renamed; the directory fsynced after every
    rename and before the link; the directory fsynced again after the link. The records' and the
    manifest's fsyncs run in threads and return late: nothing may go on before they have."""
    ops = OrderOps(slow=(".records", ".manifest"))
    writer = commit(ops, root)
    log = ops.log
    step = log.index(("fsync_dir", "m1"))
    fsynced = {name for op, name in log if op == "fsynced"}
    assert {name.split("-")[0] for name in fsynced} == {".extra", ".records", ".manifest"}
    for number, (op, name) in enumerate(log):
        if op == "renamed":
            assert ("fsynced", name) in log[:number], f"{name} renamed before its fsync returned: {log}"
    assert all(op in ("fsynced", "renamed") for op, _ in log[:step]), log  # every file's step ends here
    assert [op for op, _ in log[step:]] == ["fsync_dir", "linked", "fsync_dir"], log
    assert [name.split("-")[0] for op, name in log if op == "renamed"] == [".extra", ".records"]
    assert sorted(path.name.split("-")[0] for path in writer.directory.iterdir()) == [
        "extra", MANIFEST_NAME, "records"]


def test_a_failed_fsync_waits_for_the_others_and_names_its_file(root: Path) -> None:
    """``fsync_all`` returns (raising) only once the slow fsync beside the failed one returned."""
    ops = OrderOps(slow=(".b",), failing=".a")
    files = [(ops.open_new(root / name), name) for name in (".a", ".b")]
    with pytest.raises(OSError) as raised:
        ops.fsync_all(files)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == ".a"
    assert ops.log == [("fsynced", ".b")]  # already returned when the failure was raised
    for fd, _ in files:
        ops.close(fd)


def test_a_commit_whose_fsync_fails_renames_nothing_and_leaves_no_temporary_file(root: Path) -> None:
    ops = OrderOps(slow=(".manifest",), failing=".records")
    with pytest.raises(Unavailable) as raised:
        commit(ops, root)
    assert "ENOSPC" in raised.value.detail and "records-" in raised.value.detail  # the file it failed at
    # the others (the manifest's late) returned first; nothing renamed, no directory fsynced
    assert sorted((op, name.split("-")[0]) for op, name in ops.log) == [("fsynced", ".extra"),
                                                                        ("fsynced", ".manifest")]
    assert list((root / "ck" / "gym" / "model" / "m1").iterdir()) == []
