"""The store: records then manifest, digests, the hard-link commit point, scope, confinement."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from pathlib import Path

import orjson
import pytest

from nemo_gym_ckpt.checkpoint.fileops import WRITE_SLICE, FileOps
from nemo_gym_ckpt.checkpoint.records import Record
from nemo_gym_ckpt.checkpoint.store import (
    CHUNK_BYTES,
    MANIFEST_NAME,
    CheckpointStore,
    Manifest,
    StopSignal,
    WriteStopped,
)
from nemo_gym_ckpt.errors import (
    CheckpointConflict,
    InternalError,
    InvalidCheckpointState,
    InvalidRequest,
    PayloadTooLarge,
    Unavailable,
)
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.testing.crashfs import CrashFS

pytestmark = pytest.mark.unit


def record(rollout: str, attempt: int = 0, **state: object) -> Record:
    return Record.from_data({"episode_id": {"rollout_id": rollout, "attempt": attempt}, "state": state})


RECORDS = [record("r1", n=1), record("r2", 3, text='naïve "quoted" \n line'), record("r3", n=3)]


def write(
    store: CheckpointStore,
    directory: Path,
    records: list[Record],
    *,
    cid: str = "c1",
    kind: str = "resources",
    instance: str = "s1",
) -> Manifest:
    writer = store.open_writer(directory, kind, instance, StopSignal())
    for start in range(0, len(records), 2):
        writer.write_lines([r.raw for r in records[start : start + 2]])
    return writer.finish(kind, instance, cid)


def everything(records: list[Record]) -> frozenset[RolloutIdentity]:
    return frozenset(r.episode for r in records)


@pytest.fixture
def store(root: Path) -> CheckpointStore:
    return CheckpointStore(root)


def test_records_then_manifest_exactly_as_the_protocol_says(store: CheckpointStore, root: Path) -> None:
    manifest = write(store, root / "ck", RECORDS)
    where = root / "ck" / "gym" / "resources" / "s1"
    content = b"".join(r.raw + b"\n" for r in RECORDS)
    digest = hashlib.sha256(content).hexdigest()
    assert sorted(p.name for p in where.iterdir()) == sorted([MANIFEST_NAME, f"records-{digest}.jsonl"])
    assert (where / f"records-{digest}.jsonl").read_bytes() == content
    assert orjson.loads((where / MANIFEST_NAME).read_bytes()) == {
        "schema_version": 1,
        "kind": "resources",
        "instance": "s1",
        "checkpoint_id": "c1",
        "records_file": f"records-{digest}.jsonl",
        "records_sha256": digest,
        "record_count": 3,
    }
    assert manifest.to_json() == orjson.loads((where / MANIFEST_NAME).read_bytes())
    assert (where / MANIFEST_NAME).stat().st_nlink == 1  # the temporary link is gone


def test_read_keeps_the_scope_and_the_exact_bytes(store: CheckpointStore, root: Path) -> None:
    write(store, root / "ck", RECORDS)
    scope = frozenset({RolloutIdentity("r2", 3), RolloutIdentity("r3", 1), RolloutIdentity("absent")})
    read = store.read(root / "ck", "resources", "s1", scope)
    assert [r.raw for r in read.records] == [RECORDS[1].raw]
    assert read.records[0].data == RECORDS[1].data
    assert read.manifest.checkpoint_id == "c1"
    assert store.read(root / "ck", "resources", "s1", frozenset()).records == []


def test_an_identical_second_writer_gets_the_existing_manifest(store: CheckpointStore, root: Path) -> None:
    first = write(store, root / "ck", RECORDS)
    assert write(store, root / "ck", RECORDS) == first


def test_a_different_second_writer_is_refused_and_changes_nothing(store: CheckpointStore, root: Path) -> None:
    write(store, root / "ck", RECORDS)
    manifest_path = root / "ck" / "gym" / "resources" / "s1" / MANIFEST_NAME
    before = manifest_path.read_bytes()
    with pytest.raises(CheckpointConflict):
        write(store, root / "ck", RECORDS[:1], cid="c2")
    assert manifest_path.read_bytes() == before
    assert [r.raw for r in store.read(root / "ck", "resources", "s1", everything(RECORDS)).records] == [
        r.raw for r in RECORDS
    ]


def test_of_two_racing_writers_exactly_one_wins(store: CheckpointStore, root: Path) -> None:
    barrier = threading.Barrier(2, timeout=10)
    outcomes: list[object] = []

    def race(records: list[Record], cid: str) -> None:
        writer = store.open_writer(root / "ck", "resources", "s1", StopSignal())
        writer.write_lines([r.raw for r in records])
        barrier.wait()
        try:
            outcomes.append(writer.finish("resources", "s1", cid))
        except CheckpointConflict as error:
            outcomes.append(error)
            writer.abort()

    threads = [
        threading.Thread(target=race, args=(RECORDS, "a")),
        threading.Thread(target=race, args=(RECORDS[:2], "b")),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    winners = [o for o in outcomes if isinstance(o, Manifest)]
    assert len(winners) == 1 and len(outcomes) == 2
    assert store.read(root / "ck", "resources", "s1", frozenset()).manifest == winners[0]


def test_a_stopped_write_never_gets_a_manifest(store: CheckpointStore, root: Path) -> None:
    stop = StopSignal()
    writer = store.open_writer(root / "ck", "resources", "s1", stop)
    writer.write_lines([RECORDS[0].raw])
    assert stop.stop() is True
    with pytest.raises(WriteStopped):
        writer.finish("resources", "s1", "c1")
    writer.abort()
    where = root / "ck" / "gym" / "resources" / "s1"
    assert list(where.iterdir()) == []


def test_a_stop_after_the_commit_point_is_too_late(store: CheckpointStore, root: Path) -> None:
    stop = StopSignal()
    writer = store.open_writer(root / "ck", "resources", "s1", stop)
    writer.finish("resources", "s1", "c1")
    assert stop.stop() is False
    assert store.read(root / "ck", "resources", "s1", frozenset()).manifest.record_count == 0


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_failing_disk_is_a_clear_error_and_leaves_no_temporary_file(root: Path, code: int) -> None:
    for index in range(_count_operations(root)):
        ops = CrashFS(fail_at=index, fail_errno=code)
        store, directory = CheckpointStore(root, ops), root / f"fail-{code}-{index}"
        try:
            _write_and_abort_on_error(store, directory)
        except Unavailable as error:
            assert errno.errorcode[code] in error.detail and "must not be published" in error.detail
        else:  # only removing the temporary manifest link may fail without failing the commit
            assert ops.calls[index] == "unlink", ops.calls[index]
        leftovers = [p.name for p in directory.rglob("*") if p.is_file()]
        assert [name for name in leftovers if name.endswith(".tmp")] == (
            [] if ops.calls[index] != "unlink" else [n for n in leftovers if n.startswith(".manifest")]
        )
        if MANIFEST_NAME in leftovers:  # failed after the commit point: the records are complete
            assert index > ops.calls.index("link")
            assert len(store.read(directory, "resources", "s1", everything(RECORDS)).records) == len(RECORDS)
        else:
            with pytest.raises(InvalidCheckpointState):
                store.read(directory, "resources", "s1", frozenset())


def test_the_write_creates_no_file_its_temporary_files_are_made_when_the_writer_opens(root: Path) -> None:
    """The writer opens beside the capture (``pipeline``): the records' and the manifest's temporary
    files are made then, and the write itself (records, seal, link) creates none."""
    ops = CrashFS()
    writer = CheckpointStore(root, ops).open_writer(root / "ck", "resources", "s1", StopSignal())
    opened = len(ops.calls)
    writer.write_records(RECORDS)
    manifest = writer.finish("resources", "s1", "c1")
    assert ops.calls[:opened].count("open") == 2 and "open" not in ops.calls[opened:]
    assert Manifest.parse((writer.directory / MANIFEST_NAME).read_bytes()) == manifest
    assert sorted(path.name for path in writer.directory.iterdir()) == [MANIFEST_NAME, manifest.records_file]


def test_a_writer_aborted_before_it_wrote_leaves_no_temporary_file(store: CheckpointStore, root: Path) -> None:
    writer = store.open_writer(root / "ck", "resources", "s1", StopSignal())
    writer.abort()
    assert list(writer.directory.iterdir()) == []


def _write_and_abort_on_error(store: CheckpointStore, directory: Path) -> None:
    writer = store.open_writer(directory, "resources", "s1", StopSignal())
    try:
        writer.write_lines([r.raw for r in RECORDS])
        writer.finish("resources", "s1", "c1")
    except Unavailable:
        writer.abort()
        raise


def _count_operations(root: Path) -> int:
    ops = CrashFS()
    _write_and_abort_on_error(CheckpointStore(root, ops), root / "count")
    assert "link" in ops.calls and ops.calls.count("fsync_dir") >= 2
    return len(ops.calls)


def test_token_arrays_never_go_into_records() -> None:
    with pytest.raises(InternalError):
        Record.from_data(
            {"episode_id": {"rollout_id": "r", "attempt": 0}, "call": {"prompt_token_ids": [1, 2]}}
        )
    ok = Record.from_data({"episode_id": {"rollout_id": "r", "attempt": 0}, "note": '"prompt_token_ids": []'})
    assert Record.from_raw(ok.raw).data == ok.data
    with pytest.raises(InvalidCheckpointState):
        Record.from_raw(b'{"episode_id":{"rollout_id":"r","attempt":0},"logprobs":[0.5]}')


@pytest.mark.parametrize(
    "data",
    [
        {},
        {"episode_id": "r"},
        {"episode_id": {"rollout_id": "r"}},
        {"episode_id": {"rollout_id": "r", "attempt": "0"}},
        {"episode_id": {"rollout_id": "r", "attempt": True}},
        {"episode_id": {"rollout_id": "/bad", "attempt": 0}},
    ],
)
def test_an_export_without_a_valid_episode_id_is_a_bug(data: dict[str, object]) -> None:
    with pytest.raises(InternalError):
        Record.from_data(data)


@pytest.mark.parametrize("directory", ["../x", "a/../../x", "/etc", "", "x\x00y", "."])
def test_checkpoint_dir_must_resolve_inside_the_root(store: CheckpointStore, directory: str) -> None:
    with pytest.raises(InvalidRequest):
        store.locate(directory)


def test_paths_resolve_as_paths_do_and_symlink_escapes_are_refused(
    store: CheckpointStore, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert store.locate(str(root / "a")) == (root / "a").resolve()
    monkeypatch.chdir(root)
    assert store.locate("a/b") == (root / "a" / "b").resolve()  # relative to the working directory
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidRequest):
        store.locate("a/b")
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    with pytest.raises(InvalidRequest):
        store.locate(str(root / "link" / "ck"))
    (root / "ck" / "gym").mkdir(parents=True)
    (root / "ck" / "gym" / "resources").symlink_to(outside)
    ck = store.locate(str(root / "ck"))
    with pytest.raises(InvalidRequest):
        store.open_writer(ck, "resources", "s1", StopSignal())
    with pytest.raises(InvalidRequest):
        store.read(ck, "resources", "s1", frozenset())
    assert list(outside.iterdir()) == []




@pytest.mark.parametrize("where", ["checkpoint_dir", "instance directory"])
def test_a_symlink_loop_is_a_clear_error_not_a_crash(store: CheckpointStore, root: Path, where: str) -> None:
    if where == "checkpoint_dir":
        (root / "loop").symlink_to(root / "loop")
        with pytest.raises(InvalidRequest, match="cannot be resolved"):
            store.locate(str(root / "loop" / "ck"))
        return
    (root / "ck" / "gym" / "resources").mkdir(parents=True)
    (root / "ck" / "gym" / "resources" / "s1").symlink_to(root / "ck" / "gym" / "resources" / "s1")
    ck = store.locate(str(root / "ck"))
    with pytest.raises(InvalidRequest, match="cannot be resolved"):
        store.open_writer(ck, "resources", "s1", StopSignal())
    with pytest.raises(InvalidRequest, match="cannot be resolved"):
        store.read(ck, "resources", "s1", frozenset())


def test_a_record_over_the_stores_bound_is_refused_at_the_commit_not_at_the_restore(root: Path) -> None:
    store = CheckpointStore(root, max_record_bytes=1024)
    records = [record("r1", text="x" * 100), record("r2", text="x" * 1100)]
    writer = store.open_writer(root / "ck", "resources", "s1", StopSignal())
    with pytest.raises(PayloadTooLarge, match=r"r2 is 1\d+ bytes, over the store's max_record_bytes of 1024"):
        writer.write_records(records)
    writer.abort()
    assert list((root / "ck" / "gym" / "resources" / "s1").iterdir()) == []
    writer = store.open_writer(root / "ck", "resources", "s1", StopSignal())
    writer.write_records(records[:1])  # at the bound or under it: written
    writer.finish("resources", "s1", "c1")
    assert store.read(root / "ck", "resources", "s1", everything(records)).records == records[:1]


@pytest.fixture
def write_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every ``os.write`` system call made while the test runs (the real call is made)."""
    calls: list[int] = []
    real_write = os.write

    def counted(fd: int, data: bytes | memoryview) -> int:
        calls.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", counted)
    return calls


def test_a_large_write_goes_to_the_kernel_in_slices(root: Path, write_calls: list[int]) -> None:
    data = os.urandom(2 * WRITE_SLICE + 17)
    ops, path = FileOps(), root / "big"
    fd = ops.open_new(path)
    try:
        ops.write(fd, data)
    finally:
        ops.close(fd)
    assert write_calls == [WRITE_SLICE, WRITE_SLICE, 17]
    assert path.read_bytes() == data


def test_records_are_joined_hashed_and_written_a_chunk_at_a_time(root: Path, write_calls: list[int]) -> None:
    store = CheckpointStore(root)
    records = [record(f"r{n}", text="x" * 2000) for n in range(2000)]
    longest = max(len(r.raw) for r in records) + 1
    writer = store.open_writer(root / "ck", "resources", "s1", StopSignal())
    writer.write_records(records)
    manifest = writer.finish("resources", "s1", "c1")
    records_calls = write_calls[:-1]  # the last one is the manifest's
    assert CHUNK_BYTES <= WRITE_SLICE  # one system call, in the CPU's cache from join to hash
    assert len(records_calls) >= sum(len(r.raw) + 1 for r in records) // (CHUNK_BYTES + longest) >= 3
    assert max(records_calls) <= CHUNK_BYTES + longest
    content = (writer.directory / manifest.records_file).read_bytes()
    assert content == b"".join(r.raw + b"\n" for r in records)
    assert hashlib.sha256(content).hexdigest() == manifest.records_sha256


class WritebackOps(FileOps):
    """Real operations, and the order of the writes, writeback hints and fsyncs they were asked for."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int]] = []
        self.written: dict[int, int] = {}

    def open_new(self, path: Path) -> int:
        fd = super().open_new(path)
        self.written[fd] = 0  # a descriptor number comes again once closed
        self.events.append(("open", fd, 0))
        return fd

    def write(self, fd: int, data: bytes | memoryview) -> None:
        super().write(fd, data)
        self.written[fd] += len(data)
        self.events.append(("write", fd, self.written[fd]))

    def start_writeback(self, fd: int, offset: int, length: int) -> None:
        assert offset + length == self.written[fd]  # the bytes just written, no more
        self.events.append(("writeback", fd, offset))
        super().start_writeback(fd, offset, length)

    def fsync(self, fd: int) -> None:
        self.events.append(("fsync", fd, self.written[fd]))
        super().fsync(fd)


def test_each_chunk_of_records_is_sent_to_the_disk_as_soon_as_it_is_written(root: Path) -> None:
    ops = WritebackOps()
    records = [record(f"r{n}", text="x" * 2000) for n in range(1500)]
    writer = CheckpointStore(root, ops).open_writer(root / "ck", "resources", "s1", StopSignal())
    writer.write_records(records)
    manifest = writer.finish("resources", "s1", "c1")
    size = (writer.directory / manifest.records_file).stat().st_size
    opened = ops.events.index(("open", fd := ops.events[0][1], 0))  # the records file is the first opened
    events = [event for event in ops.events[opened + 1 : ops.events.index(("fsync", fd, size)) + 1]
              if event[1] == fd]  # the manifest's temporary file is written meanwhile too
    writes = [end for op, _, end in events if op == "write"]
    assert len(writes) >= 3 and writes[-1] == size
    expected = [e for end, start in zip(writes, [0, *writes], strict=False)
                for e in (("write", fd, end), ("writeback", fd, start))]
    assert events == [*expected, ("fsync", fd, size)]  # each chunk's hint right after it, before the next


def test_a_refused_writeback_hint_is_no_error(root: Path) -> None:
    fd = FileOps().open_new(root / "f")
    os.close(fd)
    FileOps().start_writeback(fd, 0, 1)  # a closed descriptor: the kernel refuses, nothing raised
