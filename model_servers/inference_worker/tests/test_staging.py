"""The staging store on a real directory: durability order, failures, bounds, keep, restart scan."""

from __future__ import annotations

import errno
import math
import os
from pathlib import Path
from typing import Any

import pytest

from model_servers.inference_worker.staging import StagedPrefix, StagedSampling, StagingStore, token_digest
from nemo_gym_ckpt.checkpoint.fileops import FileOps
from nemo_gym_ckpt.errors import InvalidCheckpointState

pytestmark = pytest.mark.unit

SAMPLING = StagedSampling(max_tokens=32, seed=1, temperature=1.0, top_p=1.0, stop=(), stop_token_ids=(),
                          ignore_eos=False, skip_special_tokens=True)


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

    def write(self, fd: int, data: bytes) -> None:
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


def test_a_batch_is_fsynced_renamed_then_made_durable_by_one_directory_fsync(tmp_path: Path) -> None:
    ops = RecordingOps()
    keys = store(tmp_path, ops).stage([prefix("mc_a"), prefix("mc_b"), prefix("mc_c")])
    writes, renames = ops.calls[:9], ops.calls[9:12]  # the files are written in parallel threads
    assert sorted(writes) == sorted(["open_new", "write", "fsync"] * 3) and renames == ["rename"] * 3
    assert ops.calls[12:] == ["fsync_dir"]
    assert all(key is not None and key.startswith(call + ".")
               for key, call in zip(keys, ("mc_a", "mc_b", "mc_c"), strict=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{key}.json" for key in keys if key)


def test_open_creates_the_directory_durably(tmp_path: Path) -> None:
    ops = RecordingOps()
    staging = store(tmp_path / "a" / "b", ops)
    assert staging.directory.is_dir() and ops.calls == ["fsync_dir", "fsync_dir"]


def test_load_round_trips_and_nan_logprobs_are_null(tmp_path: Path) -> None:
    staging = store(tmp_path)
    [key] = staging.stage([prefix(logprobs=(-0.25, math.nan, -1.0, -2.0))])
    assert key is not None
    loaded = staging.load(key)
    assert loaded.logprobs == (-0.25, None, -1.0, -2.0) and loaded.token_ids == (10, 11, 12, 13)


@pytest.mark.parametrize("failing", ["open_new", "write", "fsync", "rename"])
def test_a_failed_file_write_refuses_that_prefix_and_leaves_no_temporary(
    tmp_path: Path, failing: str
) -> None:
    ops = RecordingOps(fail=failing)
    staging = store(tmp_path, ops)
    assert staging.stage([prefix()]) == [None]
    assert list(tmp_path.iterdir()) == [] and staging.stats()["files"] == 0


def test_a_failed_directory_fsync_refuses_the_whole_batch(tmp_path: Path) -> None:
    staging = store(tmp_path, RecordingOps(fail="fsync_dir"))
    assert staging.stage([prefix("mc_a"), prefix("mc_b")]) == [None, None]
    assert list(tmp_path.iterdir()) == [] and staging.stats()["files"] == 0


def test_bounds_drop_the_oldest_unkept_first_then_the_oldest_kept(tmp_path: Path) -> None:
    staging = store(tmp_path, files=3)
    first, second, third = staging.stage([prefix("mc_1"), prefix("mc_2"), prefix("mc_3")])
    assert first and second and third
    staging.keep(("policy_model", "c1"), [first, second, third])
    [fourth] = staging.stage([prefix("mc_4", checkpoint="c2")])  # evicts the oldest kept: nothing else
    assert fourth and staging.keys() == [second, third, fourth]
    [fifth] = staging.stage([prefix("mc_5", checkpoint="c2")])  # evicts the unkept fourth first
    assert staging.keys() == [second, third, fifth]
    files = [f"{k}.json" for k in (second, third, fifth)] + [f"{k}.kept" for k in (second, third)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)  # the first one's mark went with it


def test_a_batch_never_evicts_its_own_files_and_refuses_what_cannot_fit(tmp_path: Path) -> None:
    size = len(prefix().encode())
    staging = store(tmp_path, files=10, size=2 * size + size // 2)
    keys = staging.stage([prefix("mc_1"), prefix("mc_2"), prefix("mc_3")])
    assert keys[0] and keys[1] and keys[2] is None and staging.stats()["files"] == 2
    huge = store(tmp_path / "huge", size=size // 2)
    assert huge.stage([prefix()]) == [None]


def test_keep_deletes_the_owner_s_other_files_and_reports_missing_keys(tmp_path: Path) -> None:
    staging = store(tmp_path)
    a, b = staging.stage([prefix("mc_a"), prefix("mc_b")])
    [other] = staging.stage([prefix("mc_c", checkpoint="c2")])
    assert a and b and other
    result = staging.keep(("policy_model", "c1"), [a, "mc_z." + "1" * 64])
    assert result.kept == [a] and result.deleted == [b] and result.missing == ["mc_z." + "1" * 64]
    assert staging.keys() == [a, other] and staging.stats()["kept"] == 1
    assert staging.discard([other, "mc_q." + "2" * 64]) == [other] and staging.keys() == [a]


def test_open_removes_temporaries_and_indexes_the_files_by_age(tmp_path: Path) -> None:
    first = store(tmp_path)
    keys = [first.stage([prefix(f"mc_{n}")])[0] for n in (3, 1, 2)]
    for age, key in enumerate(keys):  # file times are coarse: make the ages distinct
        os.utime(tmp_path / f"{key}.json", ns=(10**18 + age, 10**18 + age))
    (tmp_path / ".stg-feed.tmp").write_bytes(b"partial")
    (tmp_path / "notes.txt").write_text("not staging")
    second = store(tmp_path)
    assert second.keys() == keys and not (tmp_path / ".stg-feed.tmp").exists()
    assert (tmp_path / "notes.txt").exists() and second.stats()["kept"] == 0


def test_kept_marks_survive_a_restart_and_keep_their_place_in_the_eviction_order(tmp_path: Path) -> None:
    ops = RecordingOps()
    first = store(tmp_path, ops)
    old, kept, loose = (first.stage([prefix(f"mc_{n}", checkpoint=f"c{n}")])[0] for n in (1, 2, 3))
    assert old and kept and loose
    ops.calls.clear()
    first.keep(("policy_model", "c2"), [kept])
    assert ops.calls == ["open_new"]  # one empty mark file, no fsync (it only orders eviction)
    first.keep(("policy_model", "c2"), [kept])
    assert ops.calls == ["open_new"]  # marked once
    for age, key in enumerate((old, kept, loose)):
        os.utime(tmp_path / f"{key}.json", ns=(10**18 + age, 10**18 + age))
    (tmp_path / f"mc_9.{'9' * 64}.kept").write_bytes(b"")  # a mark whose prefix is gone
    second = store(tmp_path, files=3)
    assert second.keys() == [old, kept, loose] and second.stats()["kept"] == 1
    assert not (tmp_path / f"mc_9.{'9' * 64}.kept").exists()
    second.stage([prefix("mc_4"), prefix("mc_5")])  # room for two: the unmarked ones go, oldest first
    left = second.keys()
    assert kept in left and old not in left and loose not in left
    assert not (tmp_path / f"{old}.json").exists() and (tmp_path / f"{kept}.kept").exists()


@pytest.mark.parametrize("content", [b"not json", b'{"schema_version": 1}', b"{}"])
def test_a_malformed_file_under_its_true_digest_is_refused(tmp_path: Path, content: bytes) -> None:
    import hashlib

    key = f"mc_a.{hashlib.sha256(content).hexdigest()}"
    (tmp_path / f"{key}.json").write_bytes(content)
    with pytest.raises(InvalidCheckpointState, match="malformed"):
        store(tmp_path).load(key)


def test_keys_must_be_staging_keys_and_name_their_call(tmp_path: Path) -> None:
    staging = store(tmp_path)
    [key] = staging.stage([prefix("mc_a")])
    assert key is not None
    digest = key.split(".")[1]
    (tmp_path / f"mc_b.{digest}.json").write_bytes((tmp_path / f"{key}.json").read_bytes())
    with pytest.raises(InvalidCheckpointState, match="holds call mc_a"):
        staging.load(f"mc_b.{digest}")
    for bad in ("../escape", "mc_a", f"mc_a.{digest}/x"):
        with pytest.raises(InvalidCheckpointState, match="not a staging key"):
            staging.load(bad)
