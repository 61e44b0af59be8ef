"""The collector's checkpoint directory on real files: publish order, LATEST, retention, refusal."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

from nemo_gym_ckpt.collect import published as files
from nemo_gym_ckpt.collect.published import (
    CheckpointRefused,
    CollectionManifest,
    RunIdentity,
    check_same_run,
    config_digest,
    find_latest,
    input_digest,
    is_checkpoint_id,
    load_published,
    new_checkpoint_id,
    prune,
    publish,
    read_dispatched,
    write_atomic,
)

pytestmark = pytest.mark.unit

IDENTITY = RunIdentity("c" * 64, "i" * 64, 1)
T0 = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


def checkpoint_id(seconds: int) -> str:
    return new_checkpoint_id(T0 + timedelta(seconds=seconds))


def participant_manifests(directory: Path, checkpoint: str) -> dict[str, str]:
    """Participant manifests as a commit leaves them (the content is the participants' business)."""
    paths = {"env": "gym/environment/env/manifest.json", "model": "gym/model/model/manifest.json"}
    for path in paths.values():
        (directory / checkpoint / path).parent.mkdir(parents=True, exist_ok=True)
        (directory / checkpoint / path).write_bytes(b"{}")
    return paths


def manifest(directory: Path, checkpoint: str, *, identity: RunIdentity = IDENTITY) -> CollectionManifest:
    return CollectionManifest(
        checkpoint_id=checkpoint, run_id=identity.run_id, created_at="2026-01-02T03:04:05.678Z",
        continued=["0-0", "3-0-a1"], restarted=["4-0"], rows_done=7, config_digest=identity.config_digest,
        input_digest=identity.input_digest, num_repeats=identity.num_repeats,
        manifests=participant_manifests(directory, checkpoint),
    )


def test_ids_are_sortable_in_time_and_valid_checkpoint_ids() -> None:
    first, second = checkpoint_id(0), checkpoint_id(1)
    assert first.startswith("ckpt-20260102T030405678901Z-") and len(first.rsplit("-", 1)[1]) == 8
    assert first < second and is_checkpoint_id(first)
    assert not is_checkpoint_id("ckpt-latest") and not is_checkpoint_id("restore-1-abcd")
    assert new_checkpoint_id() != new_checkpoint_id()


def test_publish_writes_collection_json_then_latest(tmp_path: Path) -> None:
    cid = checkpoint_id(0)
    published = manifest(tmp_path, cid)
    publish(tmp_path, published)
    assert (tmp_path / "LATEST").read_text() == cid + "\n"
    written = orjson.loads((tmp_path / cid / "collection.json").read_bytes())
    assert {"checkpoint_id", "run_id", "created_at", "continued", "restarted", "rows_done"} <= set(written)
    assert written["continued"] == ["0-0", "3-0-a1"] and written["rows_done"] == 7
    assert find_latest(tmp_path) == published
    assert not [p for p in tmp_path.rglob("*.tmp")]  # no temporary file left behind


def test_a_checkpoint_missing_a_participant_manifest_is_not_published(tmp_path: Path) -> None:
    cid = checkpoint_id(0)
    incomplete = manifest(tmp_path, cid)
    (tmp_path / cid / incomplete.manifests["model"]).unlink()
    with pytest.raises(CheckpointRefused, match="no manifest for model"):
        publish(tmp_path, incomplete)
    assert not (tmp_path / cid / "collection.json").exists() and not (tmp_path / "LATEST").exists()
    assert find_latest(tmp_path) is None


def test_latest_pointer_wins_and_unpublished_directories_are_ignored(tmp_path: Path) -> None:
    old, new, newest = checkpoint_id(0), checkpoint_id(1), checkpoint_id(2)
    publish(tmp_path, manifest(tmp_path, old))
    publish(tmp_path, manifest(tmp_path, new))
    participant_manifests(tmp_path, newest)  # committed, crashed before collection.json
    (tmp_path / checkpoint_id(3)).mkdir()  # an empty directory
    (tmp_path / "notes").mkdir()
    assert find_latest(tmp_path).checkpoint_id == new  # type: ignore[union-attr]
    assert load_published(tmp_path / newest) is None
    write_atomic(tmp_path / "LATEST", old.encode() + b"\n")
    assert find_latest(tmp_path).checkpoint_id == old  # type: ignore[union-attr]


def test_a_dangling_latest_falls_back_to_the_newest_published(tmp_path: Path) -> None:
    old, new = checkpoint_id(0), checkpoint_id(1)
    publish(tmp_path, manifest(tmp_path, old))
    publish(tmp_path, manifest(tmp_path, new))
    write_atomic(tmp_path / "LATEST", checkpoint_id(9).encode())
    assert find_latest(tmp_path).checkpoint_id == new  # type: ignore[union-attr]
    (tmp_path / new / "gym/model/model/manifest.json").unlink()  # a participant manifest gone
    assert find_latest(tmp_path).checkpoint_id == old  # type: ignore[union-attr]


def test_retention_keeps_the_two_newest_published_and_deletes_only_after_publishing(tmp_path: Path) -> None:
    ids = [checkpoint_id(n) for n in range(4)]
    publish(tmp_path, manifest(tmp_path, ids[0]))
    participant_manifests(tmp_path, ids[1])  # an abandoned commit between two published ones
    publish(tmp_path, manifest(tmp_path, ids[2]))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [ids[0], ids[1], ids[2]]
    later = checkpoint_id(10)
    participant_manifests(tmp_path, later)  # newer than anything published: never touched
    publish(tmp_path, manifest(tmp_path, ids[3]))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [ids[2], ids[3], later]
    assert prune(tmp_path) == []


def test_prune_deletes_nothing_with_fewer_published_than_kept(tmp_path: Path) -> None:
    participant_manifests(tmp_path, checkpoint_id(0))
    publish(tmp_path, manifest(tmp_path, checkpoint_id(1)))
    assert prune(tmp_path) == [] and len(list(tmp_path.iterdir())) == 3


def test_a_checkpoint_of_another_config_or_input_is_refused(tmp_path: Path) -> None:
    cid = checkpoint_id(0)
    publish(tmp_path, manifest(tmp_path, cid))
    taken = find_latest(tmp_path)
    assert taken is not None
    check_same_run(taken, IDENTITY, tmp_path)
    with pytest.raises(CheckpointRefused, match="another config"):
        check_same_run(taken, RunIdentity("d" * 64, IDENTITY.input_digest, 1), tmp_path)
    with pytest.raises(CheckpointRefused, match="other task rows"):
        check_same_run(taken, RunIdentity(IDENTITY.config_digest, "j" * 64, 1), tmp_path)
    with pytest.raises(CheckpointRefused, match="--num-repeats 1"):
        check_same_run(taken, RunIdentity(IDENTITY.config_digest, IDENTITY.input_digest, 2), tmp_path)


def test_config_digest_ignores_ports_tokens_and_the_checkpoint_block() -> None:
    raw: dict[str, Any] = {
           "head_server": {"port": 1}, "checkpoint": {"enabled": True, "control_auth_token": "a"},
           "env": {"environment_servers": {"x": {"port": 5, "datasets": [{"name": "d"}]}}},
           "model": {"responses_api_models": {"y": {"api_key": "k", "temperature": 0.0}}}}
    moved: dict[str, Any] = {"head_server": {"port": 2}, "checkpoint": {"enabled": False},
             "env": {"environment_servers": {"x": {"port": 6, "datasets": [{"name": "d"}]}}},
             "model": {"responses_api_models": {"y": {"api_key": "other", "temperature": 0.0}}}}
    assert config_digest(raw) == config_digest(moved)
    moved["model"]["responses_api_models"]["y"]["temperature"] = 1.0
    assert config_digest(raw) != config_digest(moved)
    assert input_digest([{"a": 1, "b": 2}]) == input_digest([{"b": 2, "a": 1}]) != input_digest([{"a": 2}])


def test_a_corrupt_collection_manifest_is_refused_with_its_path(tmp_path: Path) -> None:
    cid = checkpoint_id(0)
    publish(tmp_path, manifest(tmp_path, cid))
    (tmp_path / cid / "collection.json").write_bytes(b'{"checkpoint_id": ')
    with pytest.raises(CheckpointRefused, match=r"collection\.json is not a collection manifest"):
        find_latest(tmp_path)


WRONG_TYPES = [
    ("rows_done", "7"), ("rows_done", -1), ("rows_done", True), ("num_repeats", 0), ("continued", "0-0"),
    ("continued", [1]), ("manifests", "gym"), ("manifests", {"env": 3}), ("manifests", {"env": "../../x"}),
    ("manifests", {"env": "/etc/passwd"}), ("staging_keys", {"model": "k"}), ("stats", []),
    ("checkpoint_id", None), ("unknown", 1), ("schema_version", "1"),
]


@pytest.mark.parametrize(("field", "value"), WRONG_TYPES)
def test_a_wrong_type_anywhere_in_collection_json_is_one_line(tmp_path: Path, field: str, value: Any) -> None:
    cid = checkpoint_id(0)
    publish(tmp_path, manifest(tmp_path, cid))
    path = tmp_path / cid / "collection.json"
    path.write_bytes(orjson.dumps({**orjson.loads(path.read_bytes()), field: value}))
    with pytest.raises(CheckpointRefused) as refused:
        find_latest(tmp_path)
    message = str(refused.value)
    assert str(path) in message and "\n" not in message
    assert field in message or "schema_version" in message


@pytest.mark.parametrize(("field", "value"), [*WRONG_TYPES, ("whole", None)])
def test_pruning_never_crashes_on_a_damaged_older_checkpoint(tmp_path: Path, field: str, value: Any) -> None:
    old = checkpoint_id(0)
    publish(tmp_path, manifest(tmp_path, old))
    path = tmp_path / old / "collection.json"
    damaged = b"[1, 2]" if field == "whole" else orjson.dumps({**orjson.loads(path.read_bytes()), field: value})
    path.write_bytes(damaged)
    newer = [manifest(tmp_path, checkpoint_id(second)) for second in (1, 2)]
    for published in newer:
        publish(tmp_path, published)
    assert not (tmp_path / old).exists()  # older than the two newest published: deleted, not read again
    assert find_latest(tmp_path) == newer[-1]


def test_an_unreadable_collection_json_is_refused_and_prune_goes_on(tmp_path: Path) -> None:
    old = checkpoint_id(0)
    publish(tmp_path, manifest(tmp_path, old))
    (tmp_path / old / "collection.json").unlink()
    (tmp_path / old / "collection.json").mkdir()
    with pytest.raises(CheckpointRefused, match="cannot read"):
        find_latest(tmp_path)
    for second in (1, 2):
        publish(tmp_path, manifest(tmp_path, checkpoint_id(second)))
    assert not (tmp_path / old).exists()


def test_dispatch_log_answers_the_highest_attempt_and_skips_a_torn_line(tmp_path: Path) -> None:
    log = tmp_path / files.DISPATCH_LOG
    log.write_bytes(b'{"rollout_id":"0-0","attempt":0}\n{"rollout_id":"0-0","attempt":2}\n'
                    b'{"rollout_id":"1-0","attempt":0}\n{"rollout_id":"2-0","att')
    assert read_dispatched(tmp_path) == {"0-0": 2, "1-0": 0}
    assert read_dispatched(tmp_path / "absent") == {}


def test_write_atomic_replaces_whole_files(tmp_path: Path) -> None:
    target = tmp_path / "LATEST"
    write_atomic(target, b"one\n")
    inode = os.stat(target).st_ino
    write_atomic(target, b"two\n")
    assert target.read_bytes() == b"two\n" and os.stat(target).st_ino != inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST"]


def test_prune_never_deletes_what_latest_names_when_the_clock_stepped_back(tmp_path: Path) -> None:
    first, second = checkpoint_id(10), checkpoint_id(20)
    publish(tmp_path, manifest(tmp_path, first))
    publish(tmp_path, manifest(tmp_path, second))
    stepped_back = checkpoint_id(5)  # the clock stepped back: the newest sorts first by name
    publish(tmp_path, manifest(tmp_path, stepped_back))
    assert (tmp_path / "LATEST").read_text().strip() == stepped_back
    assert find_latest(tmp_path).checkpoint_id == stepped_back  # type: ignore[union-attr]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [stepped_back, second]
    assert prune(tmp_path) == [] and (tmp_path / stepped_back).is_dir()


@pytest.mark.parametrize("damage", ["binary", "text", "directory", "fifo"])
def test_a_damaged_latest_pointer_is_refused_in_one_line(tmp_path: Path, damage: str) -> None:
    publish(tmp_path, manifest(tmp_path, checkpoint_id(0)))
    latest = tmp_path / "LATEST"
    latest.unlink()
    if damage == "binary":
        latest.write_bytes(b"\xff\xfeckpt-\x00\x81 garbage")
    elif damage == "text":
        latest.write_bytes(b"not a checkpoint\n")
    elif damage == "directory":
        latest.mkdir()
    else:
        os.mkfifo(latest)  # read blocking, this would wait for a writer forever
    with pytest.raises(CheckpointRefused, match=f"{latest}"):
        find_latest(tmp_path)


def test_a_checkpoint_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(CheckpointRefused, match="is not a directory"):
        find_latest(tmp_path / "file")


def test_a_fifo_where_collection_json_belongs_is_refused_and_prune_goes_on(tmp_path: Path) -> None:
    abandoned = checkpoint_id(0)
    (tmp_path / abandoned).mkdir()
    os.mkfifo(tmp_path / abandoned / "collection.json")  # read blocking, this would wait forever
    with pytest.raises(CheckpointRefused, match="not a regular file"):
        load_published(tmp_path / abandoned)
    first, second = checkpoint_id(1), checkpoint_id(2)
    publish(tmp_path, manifest(tmp_path, first))
    publish(tmp_path, manifest(tmp_path, second))  # prunes: looks at every directory
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [first, second]


def test_a_damaged_complete_line_in_the_dispatch_log_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "dispatched.jsonl").write_bytes(b'{"rollout_id": "0-0", "attempt": 0}\n{"rollout_id": "1-0", "att\n')
    with pytest.raises(CheckpointRefused, match=r"dispatched.jsonl, line 2: not a JSON object"):
        read_dispatched(tmp_path)
