"""Every durable whole-file write of the project goes through ``FileOps.write_durable``, and every
crash point of it leaves the old file or the whole new one.

The writers: the collector's published files (``write_atomic``), the policy model's token sidecar
(``write_sidecar``) and ``write_durable`` itself. Each is run a first time and then a second time
with a ``CrashFS`` that dies before or after each operation of the second write; what is left is
read in the live view (the process died) and, where the writer fsyncs its directory, in the durable
view (the machine lost power). The policy model's whole commit (sidecar, records and manifest,
fsynced together) is crashed at each of its operations too. The staging store's batches are covered the same way in
``model_servers/inference_worker/tests/test_staging.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest

from model_servers.policy_model.line_index import decode_index, index_name
from model_servers.policy_model.token_sidecar import (
    CallTokens,
    SidecarStore,
    lines_digest_of,
    sidecar_name,
    write_sidecar,
)
from nemo_gym_ckpt.checkpoint.store import MANIFEST_NAME, CheckpointStore, StopSignal
from nemo_gym_ckpt.collect.published import write_atomic
from nemo_gym_ckpt.errors import InvalidCheckpointState
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.testing.crashfs import CrashFS, SimulatedCrash

pytestmark = pytest.mark.unit

OLD, NEW = b"old whole file\n" * 40, b"new whole file\n" * 60
Write = Callable[[CrashFS, Path, bytes], None]


def atomic(ops: CrashFS, directory: Path, data: bytes) -> None:
    write_atomic(directory / "target.json", data, ops)


def durable(ops: CrashFS, directory: Path, data: bytes) -> None:
    ops.write_durable(directory / "target.json", data, directory / f".t-{len(ops.calls)}.tmp")


WRITERS: dict[str, Write] = {"write_atomic": atomic, "write_durable": durable}


def run(write: Write, directory: Path, ops: CrashFS) -> bool:
    """Both writes; True if the second one crashed."""
    write(ops, directory, OLD)
    try:
        write(ops, directory, NEW)
    except SimulatedCrash:
        return True
    return False


def crash_points(write: Write, tmp_path: Path) -> range:
    directory, ops = tmp_path / "dry", CrashFS()
    directory.mkdir()
    write(ops, directory, OLD)
    first = len(ops.calls)
    write(ops, directory, NEW)
    return range(first, len(ops.calls))


@pytest.mark.parametrize("name", sorted(WRITERS))
@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
def test_every_crash_point_leaves_the_old_file_or_the_whole_new_one(name: str, after: bool, tmp_path: Path) -> None:
    write = WRITERS[name]
    points = crash_points(write, tmp_path)
    assert len(points) >= 5  # open, write, fsync, close, rename (and the directory fsync)
    seen = set()
    for index in points:
        directory = tmp_path / f"crash-{index}"
        directory.mkdir()
        ops = CrashFS(crash_at=index, after=after)
        assert run(write, directory, ops), f"no crash at #{index}"
        live = (directory / "target.json").read_bytes()
        assert live in (OLD, NEW), f"torn file after a crash at #{index} ({ops.calls[index]})"
        view = tmp_path / f"view-{index}"
        ops.materialize(directory, view)
        assert (view / "target.json").read_bytes() in (OLD, NEW)
        seen.add(live)
    assert seen == {OLD, NEW} if after else OLD in seen


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    for index in crash_points(durable, tmp_path):
        directory = tmp_path / f"fail-{index}"
        directory.mkdir()
        ops = CrashFS(fail_at=index)
        durable(ops, directory, OLD)
        with pytest.raises(OSError):
            durable(ops, directory, NEW)
        assert (directory / "target.json").read_bytes() in (OLD, NEW)
        assert not list(directory.glob(".t-*.tmp"))


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
def test_a_crash_in_a_token_sidecar_write_leaves_no_file_or_a_whole_one(after: bool, tmp_path: Path) -> None:
    lines = [b'{"call_id":"mc_%d","prompt_token_ids":[1],"generation_token_ids":[2],"generation_log_probs":[-0.5]}'
             % n for n in range(50)]
    tokens = [CallTokens(f"mc_{n}", line, hashlib.sha256(line).hexdigest()) for n, line in enumerate(lines)]
    dry = CrashFS()
    (tmp_path / "dry").mkdir()
    write_sidecar(dry, tmp_path / "dry", tokens, StopSignal(), chunk_bytes=2_000)  # three chunks
    whole = 0
    for index in range(len(dry.calls)):
        directory = tmp_path / f"crash-{index}"
        directory.mkdir()
        with pytest.raises(SimulatedCrash):
            write_sidecar(CrashFS(crash_at=index, after=after), directory, tokens, StopSignal(), chunk_bytes=2_000)
        for sidecar in directory.glob("token-lines-*.jsonl"):
            assert sidecar.read_bytes() == b"".join(line + b"\n" for line in lines)
            digests = b"".join(hashlib.sha256(line).digest() for line in lines)
            assert sidecar.name == f"token-lines-{hashlib.sha256(digests).hexdigest()}.jsonl"
            whole += 1
    assert whole == (1 if after else 0)  # only a crash after the rename leaves the file (the last call)


def _policy_commit(ops: CrashFS, root: Path, directory: Path, tokens: list[CallTokens]) -> None:
    """The policy model's commit: its token sidecar and its index, records and manifest, made durable
    together."""
    store = SidecarStore(CheckpointStore(root, ops), lambda: tokens)
    writer = store.open_writer(directory, "model", "policy_model", StopSignal())
    writer.write_lines([RECORD])
    writer.finish("model", "policy_model", "c1")


def _policy_outcome(directory: Path, tokens: list[CallTokens]) -> str:
    """``none`` (no manifest), ``complete`` (the records, the whole sidecar and its index), or ``torn``."""
    where = directory / "gym" / "model" / "policy_model"
    if not (where / MANIFEST_NAME).exists():
        return "none"
    try:
        read = CheckpointStore(directory.parent).read(directory, "model", "policy_model", frozenset({EPISODE}))
    except InvalidCheckpointState:
        return "torn"
    digest = lines_digest_of(line.digest for line in tokens)
    sidecar = where / sidecar_name(digest)
    whole = sidecar.is_file() and sidecar.read_bytes() == b"".join(line.line + b"\n" for line in tokens)
    index = where / index_name(sidecar.name)
    indexed = index.is_file() and decode_index(index.read_bytes(), digest, sidecar.stat().st_size, set()) == []
    return "complete" if whole and indexed and [record.raw for record in read.records] == [RECORD] else "torn"


RECORD = b'{"episode_id":{"rollout_id":"r1","attempt":0},"ledger":[]}'
EPISODE = RolloutIdentity("r1")


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
def test_a_crash_in_the_policy_models_commit_leaves_no_manifest_or_whole_records_and_tokens(
    after: bool, tmp_path: Path
) -> None:
    """The sidecar, records and manifest are written before any of them is fsynced; whatever point
    the process dies at, and whatever a power loss keeps (entries fsynced, or every entry change with
    only fsynced data), a manifest never names a sidecar or records that are not whole."""
    lines = [b'{"call_id":"mc_%d","prompt_token_ids":[1],"generation_token_ids":[2]}' % n for n in range(40)]
    tokens = [CallTokens(f"mc_{n}", line, hashlib.sha256(line).hexdigest()) for n, line in enumerate(lines)]
    dry = CrashFS()
    _policy_commit(dry, tmp_path, tmp_path / "dry", tokens)
    seen = set()
    for index, name in enumerate(dry.calls):
        ops, directory = CrashFS(crash_at=index, after=after), tmp_path / f"crash-{index}"
        with pytest.raises(SimulatedCrash):
            _policy_commit(ops, tmp_path, directory, tokens)
        outcomes = {"live": _policy_outcome(directory, tokens)}
        for entries in ("durable", "live"):
            view = tmp_path / f"view-{entries}-{index}"
            ops.materialize(tmp_path, view, entries=entries)
            outcomes[f"power loss, {entries} entries"] = _policy_outcome(view / directory.name, tokens)
        where = f"{'after' if after else 'before'} {name} (#{index})"
        assert "torn" not in outcomes.values(), f"a crash {where}: {outcomes}"
        seen.update(outcomes.values())
    assert "none" in seen and "complete" in seen  # before the last fsync, the live view has it already
