"""Every durable whole-file write of the project goes through ``FileOps.write_durable``, and every
crash point of it leaves the old file or the whole new one.

The writers: the collector's published files (``write_atomic``), the policy model's token sidecar
(``write_sidecar``) and ``write_durable`` itself. Each is run a first time and then a second time
with a ``CrashFS`` that dies before or after each operation of the second write; what is left is
read in the live view (the process died) and, where the writer fsyncs its directory, in the durable
view (the machine lost power). The staging store's batches are covered the same way in
``model_servers/inference_worker/tests/test_staging.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest

from model_servers.policy_model.token_sidecar import CallTokens, write_sidecar
from nemo_gym_ckpt.checkpoint.store import StopSignal
from nemo_gym_ckpt.collect.published import write_atomic
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
