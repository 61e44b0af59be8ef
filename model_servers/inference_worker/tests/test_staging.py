"""The staging store on a real directory: one file per batch, durability order, failures, bounds,
keep, restart scan, and what ``load`` checks."""

from __future__ import annotations

import errno
import hashlib
import math
import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from model_servers.inference_worker.staging import (
    StagedPrefix,
    StagedSampling,
    StagingStore,
    batch_content,
    token_digest,
)
from model_servers.inference_worker.tests.cut_helpers import batch_files, batch_of
from nemo_gym_ckpt.checkpoint.fileops import FileOps
from nemo_gym_ckpt.errors import InvalidCheckpointState
from nemo_gym_ckpt.testing.crashfs import CrashFS, SimulatedCrash

pytestmark = pytest.mark.unit

SAMPLING = StagedSampling(max_tokens=32, seed=1, temperature=1.0, top_p=1.0, stop=(), stop_token_ids=(),
                          ignore_eos=False, skip_special_tokens=True)
OWNER = ("policy_model", "c1")


def prefix(call: str = "mc_a", tokens: int = 4, checkpoint: str = "c1", **changes: Any) -> StagedPrefix:
    ids = tuple(range(10, 10 + tokens))
    fields: dict[str, Any] = {
        "checkpoint_id": checkpoint, "server_name": "policy_model", "ticket_id": "tk-1",
        "source_call_id": call,
        "rollout_id": "r1", "attempt": 0, "parent_call_id": None, "previous_length": 0,
        "cut_kind": "active_prefix", "finish_reason": None, "last_step_finish": None,
        "prompt_digest": "a" * 64, "prompt_length": 3, "sampling": SAMPLING, "policy_version": 0,
        "prefix_token_count": tokens, "prefix_digest": token_digest(ids), "token_ids": ids,
        "logprobs": tuple(-0.5 for _ in ids), "created_at": 1.0,
    }
    return StagedPrefix(**{**fields, **changes})


def key_of(staged: StagedPrefix) -> str:
    return f"{staged.source_call_id}.{hashlib.sha256(staged.encode()).hexdigest()}"


class RecordingOps(FileOps):
    """Real file operations, recorded by name; ``fail`` names one operation that raises ENOSPC."""

    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def _do(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail:
            raise OSError(errno.ENOSPC, "No space left on device")

    def open_new(self, path: Path) -> int:
        self._do("open_new")
        return super().open_new(path)

    def write(self, fd: int, data: bytes | memoryview) -> None:
        self._do("write")
        super().write(fd, data)

    def fsync(self, fd: int) -> None:
        self._do("fsync")
        super().fsync(fd)

    def rename(self, src: Path, dst: Path) -> None:
        self._do("rename")
        super().rename(src, dst)

    def fsync_dir(self, path: Path) -> None:
        self._do("fsync_dir")
        super().fsync_dir(path)


def store(root: Path, ops: FileOps | None = None, files: int = 100, size: int = 1 << 20) -> StagingStore:
    staging = StagingStore(root, max_files=files, max_bytes=size, ops=ops)
    staging.open()
    return staging


def one(staging: StagingStore, staged: StagedPrefix) -> str:
    [key] = staging.stage([staged])
    assert key is not None
    return key


def age(root: Path, keys: list[str]) -> None:
    """File times are coarse: make the batches' ages distinct, in this order."""
    for rank, key in enumerate(keys):
        os.utime(batch_of(root, key), ns=(10**18 + rank, 10**18 + rank))


def test_a_batch_is_one_file_one_fsync_one_rename_and_one_directory_fsync(tmp_path: Path) -> None:
    ops = RecordingOps()
    prefixes = [prefix("mc_a"), prefix("mc_b", tokens=7), prefix("mc_c")]
    keys = store(tmp_path, ops).stage(prefixes)
    assert ops.calls == ["open_new", "write", "fsync", "rename", "fsync_dir"]
    assert keys == [key_of(p) for p in prefixes]
    [batch] = batch_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [batch.name]
    lines = batch.read_bytes().split(b"\n")
    assert orjson.loads(lines[0]) == {"format": "generation-cut-batch/1", "keys": keys}
    assert lines[1:] == [p.encode() for p in prefixes] + [b""]


def test_open_creates_the_directory_durably(tmp_path: Path) -> None:
    ops = RecordingOps()
    staging = store(tmp_path / "a" / "b", ops)
    assert staging.directory.is_dir() and ops.calls == ["fsync_dir", "fsync_dir"]


def test_load_round_trips_and_nan_logprobs_are_null(tmp_path: Path) -> None:
    staging = store(tmp_path)
    first, second = staging.stage([prefix(logprobs=(-0.25, math.nan, -1.0, -2.0)), prefix("mc_b", tokens=2)])
    assert first is not None and second is not None
    loaded = staging.load(first)
    assert loaded.logprobs == (-0.25, None, -1.0, -2.0) and loaded.token_ids == (10, 11, 12, 13)
    assert staging.load(second).token_ids == (10, 11)


@pytest.mark.parametrize("failing", ["open_new", "write", "fsync", "rename"])
def test_a_failed_file_write_refuses_the_batch_and_leaves_no_temporary(tmp_path: Path, failing: str) -> None:
    ops = RecordingOps(fail=failing)
    staging = store(tmp_path, ops)
    assert staging.stage([prefix("mc_a"), prefix("mc_b")]) == [None, None]
    assert list(tmp_path.iterdir()) == [] and staging.stats()["files"] == 0


def test_a_failed_directory_fsync_refuses_the_whole_batch(tmp_path: Path) -> None:
    staging = store(tmp_path, RecordingOps(fail="fsync_dir"))
    assert staging.stage([prefix("mc_a"), prefix("mc_b")]) == [None, None]
    assert list(tmp_path.iterdir()) == [] and staging.stats()["files"] == 0


def test_a_batch_must_be_one_cut_request(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one cut request"):
        store(tmp_path).stage([prefix("mc_a"), prefix("mc_b", checkpoint="c2")])


def test_bounds_drop_the_oldest_unkept_file_first_then_the_oldest_kept(tmp_path: Path) -> None:
    staging = store(tmp_path, files=3)
    first, second, third = (one(staging, prefix(f"mc_{n}")) for n in (1, 2, 3))
    staging.keep(OWNER, [first, second, third])
    fourth = one(staging, prefix("mc_4", checkpoint="c2"))  # evicts the oldest kept: nothing else
    assert staging.keys() == [second, third, fourth]
    fifth = one(staging, prefix("mc_5", checkpoint="c2"))  # evicts the unkept fourth first
    assert staging.keys() == [second, third, fifth]
    names = [batch_of(tmp_path, k).name for k in (second, third, fifth)]
    marks = [batch_of(tmp_path, k).with_suffix(".kept").name for k in (second, third)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names + marks)  # the first one's mark went too


def test_a_batch_never_evicts_itself_and_refuses_what_cannot_fit(tmp_path: Path) -> None:
    small, big = prefix("mc_1"), prefix("mc_2", tokens=400)
    two = len(batch_content([key_of(small), key_of(small)], [small.encode(), small.encode()]))
    staging = store(tmp_path, files=10, size=two + 40)
    one(staging, prefix("mc_0"))
    keys = staging.stage([small, big, prefix("mc_3"), prefix("mc_4")])
    assert keys[0] and keys[1] is None and keys[2] and keys[3] is None  # the big one and the last refused
    assert staging.keys() == [keys[0], keys[2]]  # the older file made room for them
    assert staging.stats() == {"files": 1, "bytes": batch_files(tmp_path)[0].stat().st_size, "prefixes": 2,
                               "kept": 0}
    huge = store(tmp_path / "huge", size=len(small.encode()))
    assert huge.stage([small]) == [None] and list((tmp_path / "huge").iterdir()) == []


def test_keep_drops_the_owner_s_other_prefixes_and_reports_missing_keys(tmp_path: Path) -> None:
    staging = store(tmp_path)
    a, b = staging.stage([prefix("mc_a"), prefix("mc_b")])
    c, d = (one(staging, prefix(call)) for call in ("mc_c", "mc_d"))  # two more cuts of c1 (retries)
    other = one(staging, prefix("mc_e", checkpoint="c2"))
    assert a and b
    result = staging.keep(OWNER, [a, d, "mc_z." + "1" * 64])
    assert result.kept == [a, d] and result.deleted == [b, c] and result.missing == ["mc_z." + "1" * 64]
    assert staging.keys() == [a, d, other] and staging.stats()["kept"] == 2 and staging.stats()["files"] == 3
    with pytest.raises(InvalidCheckpointState, match="not found"):
        staging.load(b)  # still in a's file, but no longer served
    assert staging.load(a).source_call_id == "mc_a" and not any(c in f.read_text() for f in batch_files(tmp_path))
    assert staging.discard([other, "mc_q." + "2" * 64]) == [other] and staging.keys() == [a, d]
    assert len(batch_files(tmp_path)) == 2


class ScanBeforeUnlink(FileOps):
    """Before a staging file is deleted, a load of an unknown key makes the store scan the directory."""

    def __init__(self) -> None:
        self.staging: StagingStore | None = None
        self.scans = 0

    def unlink(self, path: Path) -> None:
        if self.staging is not None and path.suffix == ".jsonl":
            self.scans += 1
            with pytest.raises(InvalidCheckpointState, match="not found"):
                self.staging.load("mc_z." + "3" * 64)
        super().unlink(path)


def test_a_file_being_deleted_is_not_indexed_again_by_a_scan(tmp_path: Path) -> None:
    ops = ScanBeforeUnlink()
    staging = ops.staging = store(tmp_path, ops)
    dropped = one(staging, prefix("mc_a"))
    kept = one(staging, prefix("mc_b", checkpoint="c2"))
    staging.keep(OWNER, [])
    assert ops.scans == 1 and staging.keys() == [kept] and staging.stats()["files"] == 1
    with pytest.raises(InvalidCheckpointState, match="not found"):
        staging.load(dropped)


def test_open_removes_temporaries_and_indexes_the_files_by_age(tmp_path: Path) -> None:
    first = store(tmp_path)
    keys = [one(first, prefix(f"mc_{n}")) for n in (3, 1, 2)]
    age(tmp_path, keys)
    (tmp_path / ".stg-feed.tmp").write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("not staging")
    second = store(tmp_path)
    assert second.keys() == keys and not (tmp_path / ".stg-feed.tmp").exists()
    assert (tmp_path / "notes.txt").exists() and second.stats()["kept"] == 0


def test_kept_marks_survive_a_restart_and_keep_their_place_in_the_eviction_order(tmp_path: Path) -> None:
    ops = RecordingOps()
    first = store(tmp_path, ops)
    old, kept, loose = (one(first, prefix(f"mc_{n}", checkpoint=f"c{n}")) for n in (1, 2, 3))
    ops.calls.clear()
    first.keep(("policy_model", "c2"), [kept])
    assert ops.calls == ["open_new"]  # one empty mark file, no fsync (it only orders eviction)
    first.keep(("policy_model", "c2"), [kept])
    assert ops.calls == ["open_new"]  # marked once
    age(tmp_path, [old, kept, loose])
    (tmp_path / f"cut-{'9' * 32}.kept").write_bytes(b"")  # a mark whose batch is gone
    second = store(tmp_path, files=3)
    assert second.keys() == [old, kept, loose] and second.stats()["kept"] == 1
    assert not (tmp_path / f"cut-{'9' * 32}.kept").exists()
    one(second, prefix("mc_4"))
    one(second, prefix("mc_5"))  # room for two: the unmarked ones go, oldest first
    left = second.keys()
    assert kept in left and old not in left and loose not in left
    assert batch_of(tmp_path, kept).with_suffix(".kept").exists() and len(batch_files(tmp_path)) == 3


def test_after_a_restart_every_prefix_of_a_file_is_served_again(tmp_path: Path) -> None:
    first = store(tmp_path)
    a, b = first.stage([prefix("mc_a"), prefix("mc_b")])
    assert a and b
    first.keep(OWNER, [a])
    assert store(tmp_path).keys() == [a, b]  # which checkpoint kept what is not on disk


def write_batch(root: Path, keys: list[str], lines: list[bytes], name: str = "e" * 32) -> None:
    (root / f"cut-{name}.jsonl").write_bytes(batch_content(keys, lines))


@pytest.mark.parametrize("content", [b"not json", b'{"schema_version": 1}', b"{}"])
def test_a_malformed_line_under_its_true_digest_is_refused(tmp_path: Path, content: bytes) -> None:
    key = f"mc_a.{hashlib.sha256(content).hexdigest()}"
    write_batch(tmp_path, [key], [content])
    with pytest.raises(InvalidCheckpointState, match="malformed"):
        store(tmp_path).load(key)


def test_a_line_is_checked_against_the_key_whatever_the_header_claims(tmp_path: Path) -> None:
    a, b = prefix("mc_a"), prefix("mc_b")
    write_batch(tmp_path, [key_of(b), key_of(a)], [a.encode(), b.encode()])  # the header swapped
    staging = store(tmp_path)
    for staged in (a, b):
        with pytest.raises(InvalidCheckpointState, match="does not match its key's digest"):
            staging.load(key_of(staged))


def test_a_file_written_after_open_is_found_and_a_truncated_one_is_refused(tmp_path: Path) -> None:
    staging = store(tmp_path)
    staged = prefix("mc_a")
    write_batch(tmp_path, [key_of(staged)], [staged.encode()])
    assert staging.load(key_of(staged)) == staged
    path = batch_of(tmp_path, key_of(staged))
    path.write_bytes(path.read_bytes()[:-1])  # the last line without its newline
    with pytest.raises(InvalidCheckpointState, match="does not match its key's digest"):
        staging.load(key_of(staged))
    path.unlink()
    with pytest.raises(InvalidCheckpointState, match="not found"):
        staging.load(key_of(staged))


def test_an_unreadable_header_serves_nothing_but_counts_and_goes_first(tmp_path: Path) -> None:
    (tmp_path / f"cut-{'d' * 32}.jsonl").write_bytes(b"garbage\n")
    staging = store(tmp_path, files=1)
    assert staging.stats() == {"files": 1, "bytes": 8, "prefixes": 0, "kept": 0}
    key = one(staging, prefix("mc_a"))
    assert staging.keys() == [key] and batch_files(tmp_path) == [batch_of(tmp_path, key)]


def test_keys_must_be_staging_keys_and_name_their_call(tmp_path: Path) -> None:
    staged = prefix("mc_a")
    digest = key_of(staged).split(".")[1]
    write_batch(tmp_path, [f"mc_b.{digest}"], [staged.encode()])
    staging = store(tmp_path)
    with pytest.raises(InvalidCheckpointState, match="holds call mc_a"):
        staging.load(f"mc_b.{digest}")
    for bad in ("../escape", "mc_a", f"mc_a.{digest}/x"):
        with pytest.raises(InvalidCheckpointState, match="not a staging key"):
            staging.load(bad)


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
def test_every_crash_point_of_a_stage_leaves_no_batch_or_a_whole_one(tmp_path: Path, after: bool) -> None:
    """A stage writes its batch through ``FileOps.write_durable``: crashing at any of its operations
    leaves no batch file, or one that a fresh store opens and serves whole (live and durable views)."""
    batch = [prefix("mc_a"), prefix("mc_b", tokens=6)]
    dry = CrashFS()
    dry_store = StagingStore(tmp_path / "dry", max_files=8, max_bytes=1 << 20, ops=dry)
    dry_store.open()
    began = len(dry.calls)
    assert all(dry_store.stage(batch))
    for index in range(began, len(dry.calls)):
        directory = tmp_path / f"crash-{index}"
        ops = CrashFS(crash_at=index, after=after)
        store = StagingStore(directory, max_files=8, max_bytes=1 << 20, ops=ops)
        store.open()
        with pytest.raises(SimulatedCrash):
            store.stage(batch)
        for view in (directory, tmp_path / f"view-{index}"):
            if view != directory:
                ops.materialize(directory, view)
            reopened = StagingStore(view, max_files=8, max_bytes=1 << 20)
            reopened.open()
            assert len(batch_files(view)) in (0, 1)
            assert sorted(reopened.keys()) in ([], sorted(key_of(p) for p in batch))
