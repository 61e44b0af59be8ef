"""Incremental commits (docs/protocol.md section 6.1): runs of unchanged records are spans into hard-linked
earlier records files, records that changed a little are patches of their base line; every directory
reads alone, the base is never modified, pruning never breaks, and a span or a patch that does not hold
what it claims is refused before anything is installed."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any, BinaryIO, cast

import orjson
import pytest

from nemo_gym_ckpt.checkpoint import incremental as incremental_module
from nemo_gym_ckpt.checkpoint import patches as patches_module
from nemo_gym_ckpt.checkpoint.fileops import FileOps
from nemo_gym_ckpt.checkpoint.incremental import REFERENCE_KEY, BaseIndex, IndexBuilder, refuse_reserved
from nemo_gym_ckpt.checkpoint.patches import patch_between
from nemo_gym_ckpt.checkpoint.pipeline import ExportPipeline
from nemo_gym_ckpt.checkpoint.records import PATCH_KEY, Record
from nemo_gym_ckpt.checkpoint.store import CheckpointStore, Manifest, StopSignal
from nemo_gym_ckpt.checkpoint.telemetry import Telemetry
from nemo_gym_ckpt.errors import InternalError, InvalidCheckpointState
from nemo_gym_ckpt.identity import RolloutIdentity

pytestmark = pytest.mark.unit


def record(rollout: str, **state: object) -> Record:
    return Record.from_data({"episode_id": {"rollout_id": rollout, "attempt": 0}, "state": state})


def commit(store: CheckpointStore, directory: Path, records: list[Record], *, incremental: bool = True) -> Manifest:
    writer = store.open_writer(directory, "agent", "a1", StopSignal(), incremental=incremental)
    writer.write_records(records)
    return writer.finish("agent", "a1", directory.name)


def where(directory: Path) -> Path:
    return directory / "gym" / "agent" / "a1"


def lines(directory: Path, manifest: Manifest) -> list[dict[str, object]]:
    return [orjson.loads(line) for line in (where(directory) / manifest.records_file).read_bytes().splitlines()]


def written_bytes(directory: Path, earlier: list[Path]) -> int:
    """Bytes of the files in ``directory`` that are not hard links of a file of an ``earlier`` one."""
    seen = {(p.stat().st_dev, p.stat().st_ino) for d in earlier for p in where(d).iterdir()}
    return sum(p.stat().st_size for p in where(directory).iterdir() if (p.stat().st_dev, p.stat().st_ino) not in seen)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(where(directory).iterdir())}


EVERYONE = frozenset(RolloutIdentity(f"r{n}") for n in range(20))


def test_unchanged_records_are_referenced_and_read_back_exactly(root: Path) -> None:
    records = [record(f"r{n}", text="x" * 2000, n=n) for n in range(20)]
    store = CheckpointStore(root)
    first = commit(store, root / "c1", records)
    before = snapshot(root / "c1")
    moved = [record("r3", text="moved"), *records[:3], *records[4:]]  # r3 moved, the rest did not
    second = commit(store, root / "c2", moved)

    spans = [line for line in lines(root / "c2", second) if REFERENCE_KEY in line]
    assert [span["lines"] for span in spans] == [3, 16] and second.record_count == 3  # r3 inline, two runs
    linked = where(root / "c2") / first.records_file
    assert linked.stat().st_ino == (where(root / "c1") / first.records_file).stat().st_ino
    assert written_bytes(root / "c2", [root / "c1"]) < 0.1 * written_bytes(root / "c1", [])
    assert snapshot(root / "c1") == before  # the base is never modified

    shutil.rmtree(root / "c1")  # pruning the base never breaks a kept checkpoint
    read = CheckpointStore(root).read(root / "c2", "agent", "a1", EVERYONE)
    assert sorted(r.raw for r in read.records) == sorted(r.raw for r in moved)


def test_a_commit_leaves_its_index_to_be_made_after_it_and_the_next_commit_sees_it_whole(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[str] = []
    finish_in_steps = IndexBuilder.finish_in_steps

    def counted(builder: IndexBuilder, records_file: str, size: int) -> Generator[None, None, BaseIndex]:
        made.append(records_file)
        return finish_in_steps(builder, records_file, size)

    monkeypatch.setattr(IndexBuilder, "finish_in_steps", counted)
    records = [record(f"r{n}", text="x" * 300, n=n) for n in range(20)]
    store = CheckpointStore(root)
    first = commit(store, root / "c1", records)
    assert made == [] and store.unsettled  # the commit made no index: its per-record work comes later
    store.settle()
    assert made == [first.records_file] and not store.unsettled
    assert store.base is not None and len(store.base.lines) == 20 and len(store.base.episodes) == 20
    second = commit(store, root / "c2", records)  # references all of the first: the index was whole
    assert [span["lines"] for span in lines(root / "c2", second)] == [20] and store.unsettled
    third = commit(store, root / "c3", records)  # not settled in between: the next commit makes it
    assert [span["lines"] for span in lines(root / "c3", third)] == [20] and len(made) == 2


def test_an_index_made_in_steps_is_the_one_made_at_once_and_never_replaces_a_newer_one(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of ``INDEX_STEP`` records (here 3); a commit that needs the index while the steps are
    midway makes it itself, and the steps, once done, keep nothing (the newer commit's index waits)."""
    monkeypatch.setattr(incremental_module, "INDEX_STEP", 3)
    records = [record(f"r{n}", text="x" * 300, n=n) for n in range(20)]
    at_once, stepped = CheckpointStore(root / "a"), CheckpointStore(root / "b")
    commit(at_once, root / "a" / "c1", records)
    commit(stepped, root / "b" / "c1", records)
    at_once.settle()
    assert len(list(stepped.settle_steps())) == 6 and not stepped.unsettled  # 20 records, 3 a step
    assert at_once.base is not None and stepped.base is not None
    assert stepped.base.lines == at_once.base.lines and stepped.base.episodes == at_once.base.episodes
    commit(stepped, root / "b" / "c2", records)
    midway = stepped.settle_steps()
    next(midway)
    third = commit(stepped, root / "b" / "c3", records)  # made c2's index itself, then left its own
    assert [span["lines"] for span in lines(root / "b" / "c3", third)] == [20] and stepped.unsettled
    assert list(midway) == [None] * 5 and stepped.unsettled  # c2's steps ended: c3's index still waits
    stepped.settle()
    assert stepped.base is not None and {at.records_file for at in stepped.base.lines.values()} == {
        next(iter(at_once.base.lines.values())).records_file}


def test_a_full_commit_references_nothing_and_is_todays_layout(root: Path) -> None:
    records = [record(f"r{n}", n=n) for n in range(5)]
    store = CheckpointStore(root)
    first = commit(store, root / "c1", records)
    full = commit(store, root / "c2", records, incremental=False)
    assert full.records_sha256 == first.records_sha256
    assert sorted(p.name for p in where(root / "c2").iterdir()) == sorted(["manifest.json", full.records_file])


def test_a_commit_of_no_records_is_an_empty_file_full_or_incremental(root: Path) -> None:
    store = CheckpointStore(root)
    commit(store, root / "c0", [record("r1")])
    for label, incremental in (("c1", False), ("c2", True)):
        manifest = commit(store, root / label, [], incremental=incremental)
        assert manifest.record_count == 0 and (where(root / label) / manifest.records_file).read_bytes() == b""
        assert CheckpointStore(root).read(root / label, "agent", "a1", EVERYONE).records == []


def test_a_base_file_mostly_out_of_use_is_not_linked(root: Path) -> None:
    store = CheckpointStore(root)
    commit(store, root / "c1", [record(f"r{n}", text="y" * 1000) for n in range(10)])
    kept = [record("r0", text="y" * 1000), *(record(f"r{n}", text="new") for n in range(1, 10))]
    second = commit(store, root / "c2", kept)  # r0 alone is under half of c1's file: written again
    assert not any(REFERENCE_KEY in line for line in lines(root / "c2", second))
    assert sorted(p.name for p in where(root / "c2").iterdir()) == sorted(["manifest.json", second.records_file])


def test_a_base_file_a_third_in_use_is_linked(root: Path) -> None:
    store = CheckpointStore(root)
    first = commit(store, root / "c1", [record(f"r{n}", text="y" * 1000) for n in range(9)])
    kept = [*(record(f"r{n}", text="y" * 1000) for n in range(3)), *(record(f"r{n}", text="new") for n in range(3, 9))]
    second = commit(store, root / "c2", kept)  # a third of c1's file still in use: referenced, not written again
    assert next(line.get("lines") for line in lines(root / "c2", second)) == 3
    assert (where(root / "c2") / first.records_file).exists()


def test_a_restored_checkpoint_is_the_base_and_stays_untouched(root: Path) -> None:
    records = [record(f"r{n}", n=n, text="z" * 500) for n in range(20)]
    commit(CheckpointStore(root), root / "c1", records)
    before = snapshot(root / "c1")
    fresh = CheckpointStore(root)
    read = fresh.read(root / "c1", "agent", "a1", EVERYONE)
    second = commit(fresh, root / "c2", list(read.records))
    assert [line["lines"] for line in lines(root / "c2", second)] == [20]  # one span stands for them all
    assert snapshot(root / "c1") == before
    again = CheckpointStore(root).read(root / "c2", "agent", "a1", EVERYONE)
    assert [r.raw for r in again.records] == [r.raw for r in records]


def test_a_reference_that_does_not_match_is_refused(root: Path) -> None:
    records = [record(f"r{n}", n=n, text="w" * 500) for n in range(4)]
    store = CheckpointStore(root)
    base = commit(store, root / "c1", records)
    second = commit(store, root / "c2", records)
    linked = where(root / "c2") / base.records_file
    content = linked.read_bytes().replace(b'"n":2', b'"n":7')
    linked.unlink()
    linked.write_bytes(content)  # the linked file no longer holds r2's bytes
    with pytest.raises(InvalidCheckpointState, match="do not hash to the span's digest"):
        CheckpointStore(root).read(root / "c2", "agent", "a1", EVERYONE)
    assert second.record_count == 1  # one span


def test_a_base_file_that_is_a_symlink_now_is_not_linked_and_the_commit_reads_back(
    root: Path, tmp_path: Path
) -> None:
    records = [record(f"r{n}", n=n, text="s" * 500) for n in range(8)]
    store = CheckpointStore(root)
    base = commit(store, root / "c1", records)
    original = where(root / "c1") / base.records_file
    outside = tmp_path / "outside.jsonl"
    outside.write_bytes(original.read_bytes())  # the same bytes and size, elsewhere
    original.unlink()
    original.symlink_to(outside)
    second = commit(store, root / "c2", [*records[:7], record("r7", n=-1)])
    assert not (where(root / "c2") / base.records_file).is_symlink()
    assert not (where(root / "c2") / base.records_file).exists() and second.record_count == 8  # all inline
    read = CheckpointStore(root).read(root / "c2", "agent", "a1", EVERYONE)
    assert [r.raw for r in read.records] == [r.raw for r in [*records[:7], record("r7", n=-1)]]


def test_a_link_to_a_base_file_that_is_not_the_size_it_was_is_removed(root: Path) -> None:
    (root / "base").mkdir()
    (root / "new").mkdir()
    (root / "base" / "kept").write_bytes(b"0123456789")
    (root / "base" / "shrunk").write_bytes(b"01234")
    sizes = {"kept": 10, "shrunk": 10}
    linked = incremental_module.link_files(FileOps(), root / "base", sizes, sizes, root / "new")
    assert linked == {"kept"} and sorted(p.name for p in (root / "new").iterdir()) == ["kept"]


def test_two_names_of_one_base_file_are_refused(root: Path) -> None:
    records = [record(f"r{n}", n=n, text="h" * 500) for n in range(8)]
    store = CheckpointStore(root)
    base = commit(store, root / "c1", records)
    commit(store, root / "c2", [*records[:4], record("r4", n=-1), *records[5:]])
    other = "records-" + "0" * 64 + ".jsonl"
    os.link(where(root / "c2") / base.records_file, where(root / "c2") / other)

    def second_name(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:  # the same bytes again, under it
        return [*lines, *({**line, "records_file": other} for line in lines if REFERENCE_KEY in line)]

    forge(root / "c2", second_name)
    with pytest.raises(InvalidCheckpointState, match="are one file"):
        CheckpointStore(root).read(root / "c2", "agent", "a1", EVERYONE)


class _FailingReads(FileOps):
    """Reads of ``failing`` fail with EIO once they have started."""

    def __init__(self, failing: str) -> None:
        self.failing = failing

    def open_read(self, path: Path) -> BinaryIO:
        file = super().open_read(path)
        return cast("BinaryIO", _Failing(file)) if path.name == self.failing else file


class _Failing:
    def __init__(self, file: BinaryIO) -> None:
        self.file = file

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)

    def __enter__(self) -> _Failing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()

    def readline(self, limit: int = -1) -> bytes:
        raise OSError(errno.EIO, os.strerror(errno.EIO))


def test_a_base_file_that_fails_to_read_is_a_clear_error(root: Path) -> None:
    records = [record(f"r{n}", n=n, text="e" * 500) for n in range(8)]
    store = CheckpointStore(root)
    base = commit(store, root / "c1", records)
    commit(store, root / "c2", [*records[:4], record("r4", n=-1), *records[5:]])
    reader = CheckpointStore(root, _FailingReads(base.records_file))
    with pytest.raises(InvalidCheckpointState, match=r"cannot read the records file .*Input/output error"):
        reader.read(root / "c2", "agent", "a1", EVERYONE)


async def test_an_adapter_record_may_not_look_like_a_reference(root: Path) -> None:
    class Adapter:
        async def export(self, scope: object):  # type: ignore[no-untyped-def]
            yield {"episode_id": {"rollout_id": "r1", "attempt": 0}, REFERENCE_KEY: {}}

    writer = CheckpointStore(root).open_writer(root / "c1", "agent", "a1", StopSignal())
    pipeline = ExportPipeline(Adapter(), None, Telemetry("agent", "a1"), "c1")  # type: ignore[arg-type]
    with pytest.raises(InternalError, match="mark a reference"):
        await pipeline.run(lambda: writer, "agent", "a1")


def test_a_run_of_small_records_is_one_line(root: Path) -> None:
    records = [record(f"r{n}", n=n) for n in range(1000)]  # each shorter than a span line
    store = CheckpointStore(root)
    commit(store, root / "c1", records)
    moved = [*records[:500], record("r500", n=-1), *records[501:]]
    second = commit(store, root / "c2", moved)
    assert second.record_count == 3 and written_bytes(root / "c2", [root / "c1"]) < 1000
    assert [r.raw for r in CheckpointStore(root).read(root / "c2", "agent", "a1", everyone(1000)).records] == [
        r.raw for r in moved]


def test_a_restore_keeps_the_records_of_a_span_in_its_scope(root: Path) -> None:
    records = [record(f"r{n}", n=n, text="v" * 300) for n in range(20)]
    store = CheckpointStore(root)
    commit(store, root / "c1", records)
    commit(store, root / "c2", records)
    scope = frozenset(RolloutIdentity(f"r{n}") for n in (0, 7, 19))
    fresh = CheckpointStore(root)
    read = fresh.read(root / "c2", "agent", "a1", scope)
    assert [r.raw for r in read.records] == [records[n].raw for n in (0, 7, 19)]
    third = commit(fresh, root / "c3", list(read.records))  # what was read is the next base, at its offsets
    assert [r.raw for r in CheckpointStore(root).read(root / "c3", "agent", "a1", scope).records] == [
        records[n].raw for n in (0, 7, 19)]
    assert third.record_count == 3


def test_the_same_bytes_twice_are_referenced_once(root: Path) -> None:
    twice = [record("r1", text="u" * 400), record("r1", text="u" * 400)]
    store = CheckpointStore(root)
    commit(store, root / "c1", twice)
    second = commit(store, root / "c2", twice)
    assert [line.get("lines") for line in lines(root / "c2", second)] == [1, None]  # a span, then inline
    read = CheckpointStore(root).read(root / "c2", "agent", "a1", EVERYONE)
    assert [r.raw for r in read.records] == [r.raw for r in twice]


def forge(directory: Path, edit: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]) -> None:
    """Rewrite the records of ``directory`` through ``edit`` and seal them with a matching manifest."""
    manifest_path = where(directory) / "manifest.json"
    manifest = orjson.loads(manifest_path.read_bytes())
    old = where(directory) / manifest["records_file"]
    edited = edit([orjson.loads(line) for line in old.read_bytes().splitlines()])
    content = b"".join(orjson.dumps(line) + b"\n" for line in edited)
    digest = hashlib.sha256(content).hexdigest()
    old.unlink()
    (where(directory) / f"records-{digest}.jsonl").write_bytes(content)
    manifest.update(records_file=f"records-{digest}.jsonl", records_sha256=digest,
                    record_count=content.count(b"\n"))
    manifest_path.unlink()
    manifest_path.write_bytes(orjson.dumps(manifest))


Edit = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


def first_with(key: str, edit: Callable[[dict[str, Any]], None]) -> Edit:
    """An edit of the first line holding ``key`` (a span's or a patch's)."""
    def apply(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
        edit(next(line for line in lines if key in line))
        return lines
    return apply


def first_span(edit: Callable[[dict[str, Any]], None]) -> Callable[[list[dict[str, Any]]], list[dict[str, Any]]]:
    return first_with(REFERENCE_KEY, edit)


def overlapping(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    span = next(line for line in lines if REFERENCE_KEY in line)
    return [*lines, dict(span)]


FORGED = {
    "past the end": (first_span(lambda span: span.update(offset=span["offset"] + 10**6)), "past the end"),
    "overlap": (overlapping, "overlap"),
    "its own file": (first_span(lambda span: span.update(records_file="records-" + "0" * 64 + ".jsonl")),
                     "cannot read the records file"),
    "a count that lies": (first_span(lambda span: span.update(lines=span["lines"] - 1)), "whole lines"),
    "a negative offset": (first_span(lambda span: span.update(offset=-1)), "non-negative"),
    "an extra key": (first_span(lambda span: span.update(note=1)), "a span is"),
    "a bool for a number": (first_span(lambda span: span.update(lines=True)), "non-negative integers"),
    "another episode": (first_span(lambda span: span.update(episode_id={"rollout_id": "r9", "attempt": 0})),
                        "the first of its episode_id"),
    "a path": (first_span(lambda span: span.update(records_file="../" + span["records_file"])), "names another"),
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_a_span_that_does_not_hold_what_it_claims_is_refused(root: Path, case: str) -> None:
    records = [record(f"r{n}", n=n, text="t" * 300) for n in range(8)]
    store = CheckpointStore(root)
    commit(store, root / "c1", records)
    commit(store, root / "c2", [*records[:4], record("r4", n=-1), *records[5:]])
    edit, message = FORGED[case]
    forge(root / "c2", edit)
    with pytest.raises(InvalidCheckpointState, match=message):
        CheckpointStore(root).read(root / "c2", "agent", "a1", EVERYONE)


def everyone(count: int) -> frozenset[RolloutIdentity]:
    return frozenset(RolloutIdentity(f"r{n}") for n in range(count))


# ---- patches ---------------------------------------------------------------------------------------


def grown(rollout: str, turns: int, **extra: object) -> Record:
    """A session's record after ``turns`` turns: each one appends a message, as a conversation grows."""
    messages = [{"role": "user" if n % 2 else "assistant", "content": f"turn {n}: " + "é" * 200} for n in range(turns)]
    return Record.from_data({"episode_id": {"rollout_id": rollout, "attempt": 0},
                             "session": {"messages": messages, "turns": turns, **extra}})


def patches_in(directory: Path, manifest: Manifest) -> list[dict[str, Any]]:
    return [line for line in lines(directory, manifest) if PATCH_KEY in line]


def test_a_record_that_grew_is_a_patch_of_its_base_line(root: Path) -> None:
    records = [grown(f"r{n}", 6) for n in range(10)]
    store = CheckpointStore(root)
    commit(store, root / "c1", records)
    before = snapshot(root / "c1")
    moved = [*records[:3], grown("r3", 7), *records[4:]]  # r3 took one more turn
    second = commit(store, root / "c2", moved)
    [patch] = patches_in(root / "c2", second)
    assert len(orjson.dumps(patch)) < 0.5 * len(moved[3].raw) and patch["episode_id"] == {"rollout_id": "r3",
                                                                                           "attempt": 0}
    assert written_bytes(root / "c2", [root / "c1"]) < 0.15 * written_bytes(root / "c1", [])
    assert snapshot(root / "c1") == before
    shutil.rmtree(root / "c1")  # the patch's base file is linked into c2
    read = CheckpointStore(root).read(root / "c2", "agent", "a1", EVERYONE)
    assert [r.raw for r in read.records] == [r.raw for r in moved]


def test_a_patched_record_is_patched_again_from_the_same_inline_line(root: Path) -> None:
    records = [grown(f"r{n}", 6) for n in range(10)]
    store = CheckpointStore(root)
    first = commit(store, root / "c1", records)
    moved = [grown("r0", 8), *records[1:]]
    commit(store, root / "c2", moved)
    fresh = CheckpointStore(root)  # after a restore too: what was read is the base
    read = fresh.read(root / "c2", "agent", "a1", EVERYONE)
    third = commit(fresh, root / "c3", list(read.records))
    [patch] = patches_in(root / "c3", third)
    assert patch["records_file"] == first.records_file  # one hop: never a patch of a patch
    assert [r.raw for r in CheckpointStore(root).read(root / "c3", "agent", "a1", EVERYONE).records] == [
        r.raw for r in moved]


class NoHashing:
    """Stands for ``hashlib`` where a commit must make no digest: any ``sha256`` is a failure."""

    @staticmethod
    def sha256(data: bytes = b"") -> Any:
        raise AssertionError("a line the base already holds was hashed again")


@pytest.mark.parametrize("base", ["committed", "restored"])
def test_records_that_stayed_as_they_were_are_the_base_commits_span_and_patch_lines_again(
    root: Path, monkeypatch: pytest.MonkeyPatch, base: str
) -> None:
    """A commit of records that did not move since the base costs no search and no hash: each span of
    the same bytes and each patch of the same record from the same line is the base's line again."""
    records = [grown(f"r{n}", 6) for n in range(10)]
    store = CheckpointStore(root)
    commit(store, root / "c1", records)
    moved = [*records[:3], grown("r3", 7), *records[4:]]  # r3 a patch between two spans
    second = commit(store, root / "c2", moved)
    if base == "restored":
        store = CheckpointStore(root)
        moved = list(store.read(root / "c2", "agent", "a1", EVERYONE).records)
    else:
        store.settle()
    monkeypatch.setattr(incremental_module, "hashlib", NoHashing)
    monkeypatch.setattr(patches_module, "hashlib", NoHashing)
    monkeypatch.setattr(incremental_module, "patch_between", lambda *args: pytest.fail("a patch searched again"))
    third = commit(store, root / "c3", moved)
    assert (where(root / "c3") / third.records_file).read_bytes() == (
        where(root / "c2") / second.records_file).read_bytes()
    monkeypatch.undo()
    shutil.rmtree(root / "c1")
    shutil.rmtree(root / "c2")
    assert [r.raw for r in CheckpointStore(root).read(root / "c3", "agent", "a1", EVERYONE).records] == [
        r.raw for r in moved]


def test_records_a_span_stood_for_keep_their_place_in_the_commits_after_it(root: Path) -> None:
    records = [grown(f"r{n}", 6) for n in range(10)]
    store = CheckpointStore(root)
    first = commit(store, root / "c1", records)
    for label in ("c2", "c3"):  # unchanged twice: one span each time, into the first file
        [span] = lines(root / label, commit(store, root / label, records))
        assert span["lines"] == 10 and span["records_file"] == first.records_file and span["offset"] == 0
    moved = [*records[:5], grown("r5", 7), *records[6:]]
    fourth = commit(store, root / "c4", moved)  # patched from the line the first file holds
    [patch] = patches_in(root / "c4", fourth)
    assert patch["records_file"] == first.records_file and len(lines(root / "c4", fourth)) == 3
    for label, expected in (("c3", records), ("c4", moved)):
        read = CheckpointStore(root).read(root / label, "agent", "a1", EVERYONE)
        assert [r.raw for r in read.records] == [r.raw for r in expected]


def test_a_record_that_changed_a_lot_is_written_whole(root: Path) -> None:
    store = CheckpointStore(root)
    commit(store, root / "c1", [grown(f"r{n}", 6) for n in range(10)])
    changed = [grown("r0", 2, note="x" * 2000), *(grown(f"r{n}", 6) for n in range(1, 10))]
    assert patches_in(root / "c2", commit(store, root / "c2", changed)) == []


def test_an_adapter_record_may_not_look_like_a_patch(root: Path) -> None:
    bad = Record.from_data({"episode_id": {"rollout_id": "r1", "attempt": 0}, PATCH_KEY: "x"})
    with pytest.raises(InternalError, match="mark a reference"):
        refuse_reserved(bad)


@pytest.mark.parametrize("key", [REFERENCE_KEY, PATCH_KEY])
def test_a_record_knows_from_its_making_whether_it_is_a_reference(key: str) -> None:
    """The commit checks each record it writes by one attribute, set when the record is made (read
    back, encoded, or made from strings); the pipeline refuses one that is set (above)."""
    plain = {"episode_id": {"rollout_id": "r1", "attempt": 0}, "note": key}
    marked = {**plain, key: "x"}
    assert not Record.from_data(plain).reference and not Record.from_raw(orjson.dumps(plain)).reference
    assert Record.from_data(marked).reference and Record.from_raw(orjson.dumps(marked)).reference
    assert not Record.of_strings(RolloutIdentity("r1"), note=key).reference
    assert Record.of_strings(RolloutIdentity("r1"), **{key: "x"}).reference


def first_patch(edit: Callable[[dict[str, Any]], None]) -> Callable[[list[dict[str, Any]]], list[dict[str, Any]]]:
    return first_with(PATCH_KEY, edit)


def patch_over_a_span(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    span = next(line for line in lines if REFERENCE_KEY in line)
    next(line for line in lines if PATCH_KEY in line).update(offset=span["offset"])
    return lines


FORGED_PATCHES = {
    "another insert": (first_patch(lambda patch: patch.update(insert=patch["insert"] + " ")), "do not hash"),
    "more kept than the line": (first_patch(lambda patch: patch.update(keep_tail=patch["length"])), "keeps"),
    "not at a line's start": (first_patch(lambda patch: patch.update(offset=patch["offset"] + 1)),
                              "whole line|JSON|overlap"),
    "a length that lies": (first_patch(lambda patch: patch.update(length=patch["length"] - 1)), "whole line"),
    "an insert that is not text": (first_patch(lambda patch: patch.update(insert=7)), "insert is a string"),
    "an extra key": (first_patch(lambda patch: patch.update(note=1)), "a patch is"),
    "a negative keep": (first_patch(lambda patch: patch.update(keep_head=-1)), "non-negative"),
    "another episode": (first_patch(lambda patch: patch.update(episode_id={"rollout_id": "r9", "attempt": 0})),
                        "of the patch's episode_id"),
    "over a span's lines": (patch_over_a_span, "overlap"),
    "past the end": (first_patch(lambda patch: patch.update(offset=10**6)), "past the end"),
}


@pytest.mark.parametrize("case", sorted(FORGED_PATCHES))
def test_a_patch_that_does_not_hold_what_it_claims_is_refused(root: Path, case: str) -> None:
    records = [grown(f"r{n}", 6) for n in range(8)]
    store = CheckpointStore(root)
    commit(store, root / "c1", records)
    commit(store, root / "c2", [*records[:4], grown("r4", 7), *records[5:]])
    edit, message = FORGED_PATCHES[case]
    forge(root / "c2", edit)
    with pytest.raises(InvalidCheckpointState, match=message):
        CheckpointStore(root).read(root / "c2", "agent", "a1", EVERYONE)


def test_a_patch_that_would_make_a_record_of_two_lines_is_refused(root: Path) -> None:
    records = [record(f"r{n}", n=n, text="p" * 2000) for n in range(8)]
    store = CheckpointStore(root)
    commit(store, root / "c1", records)
    second = commit(store, root / "c2", [*records[:4], record("r4", n=-1, text="p" * 2000), *records[5:]])
    assert patches_in(root / "c2", second)

    def newline_after_the_insert(patch: dict[str, Any]) -> None:  # JSON whitespace: the record still parses
        at = patch["offset"]
        base = (where(root / "c2") / patch["records_file"]).read_bytes()[at:at + patch["length"] - 1]
        patch["insert"] += "\n"
        raw = base[:patch["keep_head"]] + patch["insert"].encode() + base[len(base) - patch["keep_tail"]:]
        assert orjson.loads(raw)["state"]["n"] == -1
        patch[PATCH_KEY] = hashlib.sha256(raw).hexdigest()

    forge(root / "c2", first_patch(newline_after_the_insert))
    with pytest.raises(InvalidCheckpointState, match="holds no newline"):
        CheckpointStore(root).read(root / "c2", "agent", "a1", EVERYONE)


def _patch_by_byte_steps(new: bytes, old: bytes) -> tuple[int, int] | None:
    """What a patch keeps (head, tail), found one byte at a time: the reference ``patch_between`` is
    checked against (whatever search it does, it must find these)."""
    head = 0
    while head < min(len(new), len(old)) and new[head] == old[head]:
        head += 1
    tail = 0
    while tail < min(len(new), len(old)) - head and new[-1 - tail] == old[-1 - tail]:
        tail += 1
    while head and head < len(new) and new[head] & 0xC0 == 0x80:
        head -= 1
    while tail and len(new) - tail < len(new) and new[len(new) - tail] & 0xC0 == 0x80:
        tail -= 1
    return None if 330 + len(new) - head - tail > 0.5 * len(new) else (head, tail)


def test_a_patch_keeps_what_a_byte_by_byte_comparison_finds() -> None:
    """Random edits (text with multi-byte characters, records short and long, changes at either end,
    in the middle, or none): the bytes a patch keeps, and whether it is worth making, are exactly a
    byte-by-byte comparison's; the patched line rebuilds the record."""
    rng = random.Random(15)
    alphabet = "abcxyz{}\":,0123456789 éß€😀"
    for _ in range(400):
        old = "".join(rng.choice(alphabet) for _ in range(rng.choice((20, 300, 700, 2000)))).encode()
        cut, drop = rng.randrange(len(old) + 1), rng.randrange(40)
        insert = "".join(rng.choice(alphabet) for _ in range(rng.randrange(60))).encode()
        new = (old[:cut] + insert + old[cut + drop:]).decode("utf-8", "replace").encode()
        patch = patch_between(new, old, "records-x.jsonl", 0)
        expected = _patch_by_byte_steps(new, old)
        assert (None if patch is None else (patch.keep_head, patch.keep_tail)) == expected
        if patch is not None:
            assert new == old[:patch.keep_head] + new[patch.keep_head:len(new) - patch.keep_tail] + \
                old[len(old) - patch.keep_tail:]
