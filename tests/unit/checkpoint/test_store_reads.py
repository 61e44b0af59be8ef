"""The store's reading path: only regular files, every read bounded before it happens, ``root`` optional.

A FIFO, a socket or a directory put where a manifest or records file belongs is refused at once
(a FIFO used to block the restore's thread for ever); a records file longer than its manifest
allows, a line over the record bound and lines past the manifest's count are refused with at most
the bound in memory (a 3 GiB line without a newline used to be read whole). Without a root, any
absolute ``checkpoint_dir`` is accepted and a relative one is not.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any, BinaryIO

import orjson
import pytest

from nemo_gym_ckpt.checkpoint.fileops import FileOps, NotRegularFile
from nemo_gym_ckpt.checkpoint.records import Record
from nemo_gym_ckpt.checkpoint.store import MANIFEST_NAME, CheckpointStore, Manifest, StopSignal
from nemo_gym_ckpt.errors import InvalidCheckpointState, InvalidRequest
from nemo_gym_ckpt.identity import RolloutIdentity

pytestmark = pytest.mark.unit

KIND, INSTANCE = "resources", "s1"
BOUND = 4096
RECORDS = [Record.from_data({"episode_id": {"rollout_id": f"r{n}", "attempt": 0}, "n": n}) for n in range(3)]
SCOPE = frozenset(RolloutIdentity(f"r{n}") for n in range(3))


class CountingOps(FileOps):
    """Real file operations that count every byte a read hands back."""

    def __init__(self) -> None:
        self.read_bytes = 0

    def open_read(self, path: Path) -> BinaryIO:
        return _Counting(super().open_read(path), self)


class _Counting:
    def __init__(self, file: BinaryIO, ops: CountingOps) -> None:
        self._file, self._ops = file, ops

    def _counted(self, data: bytes) -> bytes:
        self._ops.read_bytes += len(data)
        return data

    def read(self, size: int = -1) -> bytes:
        return self._counted(self._file.read(size))

    def readline(self, size: int = -1) -> bytes:
        return self._counted(self._file.readline(size))

    def fileno(self) -> int:
        return self._file.fileno()

    def __iter__(self) -> Any:
        return iter(self.readline, b"")

    def __enter__(self) -> _Counting:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def committed(store: CheckpointStore, directory: Path) -> tuple[Manifest, Path]:
    writer = store.open_writer(directory, KIND, INSTANCE, StopSignal())
    writer.write_lines([record.raw for record in RECORDS])
    manifest = writer.finish(KIND, INSTANCE, "c1")
    where = store.instance_dir(directory, KIND, INSTANCE)
    return manifest, where


def replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def read_in_a_thread(store: CheckpointStore, directory: Path) -> BaseException | None:
    """``store.read`` in a thread; a FIFO that blocks it is released after 5 s (so a regression fails
    the test instead of hanging it) and reported as such."""
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            store.read(directory, KIND, INSTANCE, SCOPE)
        except InvalidCheckpointState as error:
            outcome.append(error)
        else:
            outcome.append(None)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(5.0)
    if thread.is_alive():
        for fifo in directory.rglob("*"):
            if fifo.is_fifo():
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer: the open returns
        thread.join(5.0)
        raise AssertionError("the read blocked on a FIFO")
    return outcome[0]


@pytest.mark.parametrize("which", ["manifest", "records"])
def test_a_fifo_in_place_of_a_checkpoint_file_is_refused_at_once(root: Path, which: str) -> None:
    store = CheckpointStore(root)
    manifest, where = committed(store, root / "ck")
    replace_with_fifo(where / (MANIFEST_NAME if which == "manifest" else manifest.records_file))
    error = read_in_a_thread(store, root / "ck")
    assert isinstance(error, InvalidCheckpointState) and "not a regular file (a FIFO)" in error.detail


def test_a_socket_or_a_directory_is_refused_too(root: Path) -> None:
    store = CheckpointStore(root)
    manifest, where = committed(store, root / "ck")
    records = where / manifest.records_file
    records.unlink()
    records.mkdir()
    with pytest.raises(InvalidCheckpointState, match="regular file"):
        store.read(root / "ck", KIND, INSTANCE, SCOPE)
    records.rmdir()
    listener = socket.socket(socket.AF_UNIX)
    short = Path(tempfile.mkdtemp(prefix="ngc")) / "s"  # AF_UNIX paths are short; rename it into place
    try:
        listener.bind(str(short))
        short.rename(records)
        with pytest.raises(InvalidCheckpointState, match="cannot read records"):  # ENXIO: never opened
            store.read(root / "ck", KIND, INSTANCE, SCOPE)
    finally:
        listener.close()
        short.parent.rmdir()
    records.unlink()
    records.mkdir()
    with pytest.raises(NotRegularFile):
        FileOps().open_read(records)


def test_a_records_file_longer_than_its_manifest_allows_is_refused_before_it_is_read(root: Path) -> None:
    ops = CountingOps()
    store = CheckpointStore(root, ops, max_record_bytes=BOUND)
    manifest, where = committed(store, root / "ck")
    with (where / manifest.records_file).open("ab") as file:
        file.truncate(manifest.record_count * (BOUND + 1) + 1)  # sparse: nothing written
    ops.read_bytes = 0
    with pytest.raises(InvalidCheckpointState, match="more than 3 records of at most 4096 bytes"):
        store.read(root / "ck", KIND, INSTANCE, SCOPE)
    assert ops.read_bytes < 64 * 1024, "the records were read before the size was checked"  # the manifest only


def test_a_line_over_the_bound_is_refused_with_at_most_the_bound_read(root: Path) -> None:
    ops = CountingOps()
    store = CheckpointStore(root, ops, max_record_bytes=BOUND)
    directory = root / "ck"
    writer = store.open_writer(directory, KIND, INSTANCE, StopSignal())
    huge = {"episode_id": {"rollout_id": "r0", "attempt": 0}, "pad": "x" * (BOUND * 2)}
    writer.write_lines([orjson.dumps(huge), *(record.raw for record in RECORDS[1:])])
    writer.finish(KIND, INSTANCE, "c1")
    ops.read_bytes = 0
    with pytest.raises(InvalidCheckpointState, match="line 1 is longer than the bound of 4096 bytes"):
        store.read(directory, KIND, INSTANCE, SCOPE)
    assert ops.read_bytes <= MANIFEST_BYTES_AT_MOST + BOUND + 2


MANIFEST_BYTES_AT_MOST = 1024


def test_a_line_without_a_newline_is_never_read_whole(root: Path) -> None:
    ops = CountingOps()
    store = CheckpointStore(root, ops, max_record_bytes=BOUND)
    manifest, where = committed(store, root / "ck")
    records = where / manifest.records_file
    records.write_bytes(b"x" * (BOUND * 2))  # one "record" without its newline, within the size bound
    ops.read_bytes = 0
    with pytest.raises(InvalidCheckpointState, match="longer than the bound"):
        store.read(root / "ck", KIND, INSTANCE, SCOPE)
    assert ops.read_bytes <= MANIFEST_BYTES_AT_MOST + BOUND + 2


def test_lines_past_the_manifest_count_are_not_read(root: Path) -> None:
    ops = CountingOps()
    store = CheckpointStore(root, ops, max_record_bytes=BOUND)
    manifest, where = committed(store, root / "ck")
    records = where / manifest.records_file
    body = records.read_bytes()
    records.write_bytes(body + b'{"episode_id": {"rollout_id": "extra", "attempt": 0}}\n')
    with pytest.raises(InvalidCheckpointState, match="goes on past the 3 lines"):
        store.read(root / "ck", KIND, INSTANCE, SCOPE)


def test_within_the_bounds_everything_reads_back(root: Path) -> None:
    store = CheckpointStore(root, max_record_bytes=BOUND)
    committed(store, root / "ck")
    read = store.read(root / "ck", KIND, INSTANCE, SCOPE)
    assert [record.raw for record in read.records] == [record.raw for record in RECORDS]


def test_without_a_root_any_absolute_directory_is_accepted(tmp_path: Path) -> None:
    store = CheckpointStore(None)
    directory = tmp_path / "anywhere" / "ck"
    assert store.locate(str(directory)) == directory.resolve()
    committed(store, directory)
    assert len(store.read(directory, KIND, INSTANCE, SCOPE).records) == 3
    for bad in ("relative/ck", f"{tmp_path}/a/../b", ""):
        with pytest.raises(InvalidRequest):
            store.locate(bad)
