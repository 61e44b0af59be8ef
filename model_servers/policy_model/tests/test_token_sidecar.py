"""The token sidecar: written before the records, checked and installed all or nothing at restore,
exported again byte for byte; and a restored call's prompt spliced from its ids (review E10).

In process over the scripted worker, whose generations spell the tool-call tags one id per
character: the same text as a fresh encoding (which merges each tag into one id) but other ids, so
a prompt re-tokenized from text shows.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from itertools import accumulate, pairwise
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from model_servers.inference_worker import default_model_data as data
from model_servers.policy_model.capture_memory import CaptureMemory, LineFile, line_crc
from model_servers.policy_model.chat_format import ChatFormat
from model_servers.policy_model.generation import TokenCapture
from model_servers.policy_model.ids import sha256_of
from model_servers.policy_model.ledger import LedgerBook
from model_servers.policy_model.line_index import IndexedLine, decode_index, encode_index, index_name
from model_servers.policy_model.participant import CAPTURE_TOKENS_PATH
from model_servers.policy_model.tests.policy_harness import TOKEN, serve_policy
from model_servers.policy_model.tests.scripted_worker import Generate, ScriptedWorker
from model_servers.policy_model.token_sidecar import (
    SIDECAR_NAME,
    CallTokens,
    ChunkBuffer,
    SidecarStore,
    TokenedRecord,
    lines_digest_of,
    write_sidecar,
)
from nemo_gym_ckpt.checkpoint.fileops import FileOps
from nemo_gym_ckpt.checkpoint.records import TOKEN_ARRAY_KEYS, Record
from nemo_gym_ckpt.checkpoint.store import CheckpointStore, StopSignal, WriteStopped
from nemo_gym_ckpt.errors import InvalidCheckpointState, Unavailable
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.conformance import Control, ParticipantUnderTest, unique

pytestmark = pytest.mark.unit

CALL = '<tool_call>{"name":"add","arguments":{"a":40,"b":2}}</tool_call>'
TOOLS = [{"type": "function", **tool["function"]} for tool in data.TOOLS]
QUESTION = "What is 40 plus 2?"
R1, R2, R3 = RolloutIdentity("r1"), RolloutIdentity("r2"), RolloutIdentity("r3")
ARRAYS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


@dataclass
class Policy:
    http: httpx.AsyncClient
    control: Control
    worker: ScriptedWorker
    root: Path

    async def respond(self, episode: RolloutIdentity, input_: Any, **extra: Any) -> dict[str, Any]:
        body = {"model": "policy", "input": input_, "tools": TOOLS, **extra}
        reply = await self.http.post(f"/ng-rollout/{episode.capture_key}/v1/responses", json=body)
        assert reply.status_code == 200, reply.text
        result: dict[str, Any] = reply.json()
        return result

    async def commit(self, cid: str, **commit: Any) -> tuple[Path, dict[str, Any]]:
        """Prepare, commit and resume: the participant's directory and the commit reply."""
        assert (await self.control.ok("prepare", checkpoint_id=cid))["report"]["ready"]
        directory = unique(cid)
        committed = await self.control.ok("commit", checkpoint_id=cid, checkpoint_dir=directory, **commit)
        await self.control.ok("resume", checkpoint_id=cid)
        return self.root / directory.removeprefix("@") / "gym" / "model" / "policy_model", committed

    async def restore(self, cid: str, where: Path, episodes: list[RolloutIdentity]) -> httpx.Response:
        body = {"checkpoint_id": cid, "deadline_ts": self.control.deadline(),
                "checkpoint_dir": str(where.parents[2]), "episode_ids": [e.to_json() for e in episodes]}
        return await self.control.send("restore", body)

    async def calls(self, episode: RolloutIdentity) -> list[dict[str, Any]]:
        reply = await self.http.get(f"/ng-rollout/{episode.capture_key}{CAPTURE_TOKENS_PATH}")
        assert reply.status_code == 200, reply.text
        calls: list[dict[str, Any]] = reply.json()["calls"]
        return calls

    async def extras(self) -> dict[str, Any]:
        extras: dict[str, Any] = (await self.control.status())["extras"]
        return extras


@pytest.fixture
def open_policy(fmt: ChatFormat, tokenizer_dir: Path, root: Path) -> Callable[..., Any]:
    @asynccontextmanager
    async def open_(*script: str, **settings: Any) -> AsyncIterator[Policy]:
        worker = ScriptedWorker(fmt).will(*script)
        worker.default = Generate("ok")
        clock = FakeClock(start=1_700_000_000.0)
        async with serve_policy(worker, tokenizer_dir, root=root, clock=clock, **settings) as http:
            pt = ParticipantUnderTest(http, TOKEN, root, now=clock.now, advance_clock=clock.advance)
            yield Policy(http, Control(pt), worker, root)

    return open_


def named_by_lines(content: bytes) -> str:
    """The name the documented rule gives a sidecar: the SHA-256 of its lines' SHA-256 digests."""
    digests = b"".join(hashlib.sha256(line).digest() for line in content.splitlines())
    return f"token-lines-{hashlib.sha256(digests).hexdigest()}.jsonl"


def sidecar_of(where: Path) -> Path:
    [path] = [path for path in where.iterdir() if SIDECAR_NAME.fullmatch(path.name)]
    return path


def index_of(where: Path) -> Path:
    """The index beside the directory's one sidecar."""
    return where / index_name(sidecar_of(where).name)


def stripped(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as a restored agent has them: without the token arrays (records never carry them)."""
    return [{key: value for key, value in item.items() if key not in TOKEN_ARRAY_KEYS} for item in items]


def second_turn(first: dict[str, Any], items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    call = first["output"][-1]
    return [{"role": "user", "content": QUESTION}, *items,
            {"type": "function_call_output", "call_id": call["call_id"], "output": "42"}]


async def first_turns(policy: Policy) -> tuple[dict[str, Any], dict[str, Any]]:
    """r1 asked for token ids (a tool call), r2 did not."""
    first = await policy.respond(R1, QUESTION, return_token_ids=True)
    other = await policy.respond(R2, QUESTION)
    return first, other


# ---- write ---------------------------------------------------------------------------------------


async def test_a_commit_writes_the_delivered_tokens_to_the_sidecar_and_none_to_the_records(
    open_policy: Callable[..., Any],
) -> None:
    async with open_policy(CALL, CALL) as policy:
        first, _ = await first_turns(policy)
        where, committed = await policy.commit("c1")
    [item] = first["output"]
    content = sidecar_of(where).read_bytes()
    assert sidecar_of(where).name == named_by_lines(content)
    [line] = content.splitlines()
    tokens = orjson.loads(line)
    assert tokens == {"call_id": tokens["call_id"], **{name: item[name] for name in ARRAYS}}
    records = (where / committed["manifest"]["records_file"]).read_bytes()
    assert not any(name.encode() in records for name in TOKEN_ARRAY_KEYS)
    rows = {r["episode_id"]["rollout_id"]: r["ledger"] for r in map(orjson.loads, records.splitlines())}
    assert rows["r1"][0]["token_digest"] == hashlib.sha256(line).hexdigest()
    assert rows["r1"][0]["call_id"] == tokens["call_id"]
    assert rows["r2"][0]["token_digest"] is None  # its caller asked for no token ids: nothing kept
    assert sorted(p.name for p in where.iterdir()) == sorted(
        ["manifest.json", committed["manifest"]["records_file"], sidecar_of(where).name, index_of(where).name])


async def test_a_commit_without_token_ids_writes_no_sidecar(open_policy: Callable[..., Any]) -> None:
    async with open_policy() as policy:
        await policy.respond(R2, QUESTION)
        where, committed = await policy.commit("c1")
    assert sorted(p.name for p in where.iterdir()) == sorted(["manifest.json", committed["manifest"]["records_file"]])


async def test_the_last_commit_counts_the_sidecar_it_wrote_and_not_one_it_linked(
    open_policy: Callable[..., Any],
) -> None:
    async with open_policy(CALL, CALL) as policy:
        await first_turns(policy)
        where, committed = await policy.commit("c1")
        first = (await policy.control.status())["last_commit"]
        again, committed_again = await policy.commit("c2")  # incremental: nothing new to write
        second = (await policy.control.status())["last_commit"]
    records = (where / committed["manifest"]["records_file"]).stat().st_size
    assert first["bytes"] == records + sidecar_of(where).stat().st_size + index_of(where).stat().st_size
    assert sidecar_of(again).stat().st_ino == sidecar_of(where).stat().st_ino  # linked
    assert index_of(again).stat().st_ino == index_of(where).stat().st_ino  # its index linked with it
    assert second["bytes"] == (again / committed_again["manifest"]["records_file"]).stat().st_size


class RecordingOps(FileOps):
    """Real file operations, logged; ``fail_fsync_of`` makes the fsync of such a file fail (ENOSPC)."""

    def __init__(self, fail_fsync_of: str | None = None) -> None:
        self.log: list[tuple[str, str]] = []
        self.fail_fsync_of = fail_fsync_of
        self._names: dict[int, str] = {}

    def open_new(self, path: Path) -> int:
        fd = super().open_new(path)
        self._names[fd] = path.name
        return fd

    def write(self, fd: int, data: bytes | memoryview) -> None:
        self.log.append(("write", self._names[fd]))
        super().write(fd, data)

    def fsync(self, fd: int) -> None:
        name = self._names[fd]
        if self.fail_fsync_of is not None and name.startswith(self.fail_fsync_of):
            raise OSError(errno.ENOSPC, "No space left on device")
        self.log.append(("fsync", name))
        super().fsync(fd)

    def rename(self, src: Path, dst: Path) -> None:
        self.log.append(("rename", dst.name))
        super().rename(src, dst)

    def link(self, src: Path, dst: Path) -> None:
        self.log.append(("link", dst.name))
        super().link(src, dst)


def _line(line: bytes) -> CallTokens:
    return CallTokens("mc_1", line, hashlib.sha256(line).hexdigest())


def write(store: SidecarStore, directory: Path) -> None:
    writer = store.open_writer(directory, "model", "policy_model", StopSignal())
    try:
        writer.write_lines([b'{"episode_id":{"rollout_id":"r1","attempt":0},"ledger":[]}'])
        writer.finish("model", "policy_model", "c1")
    except BaseException:
        writer.abort()
        raise


def test_the_sidecar_is_durable_before_the_records_are_renamed(root: Path) -> None:
    ops = RecordingOps()
    store = SidecarStore(CheckpointStore(root, ops), lambda: [_line(b'{"call_id":"mc_1"}')])
    write(store, root / "ck")
    renames = [name for op, name in ops.log if op in ("rename", "link")]
    assert [name.rsplit("-", 1)[0] for name in renames] == ["token-lines", "token-lines", "records", "manifest.json"]
    assert renames[1] == index_name(renames[0])  # the sidecar, then its index
    sidecar_fsync = ops.log.index(("fsync", next(n for o, n in ops.log if n.startswith(".tokens"))))
    assert sidecar_fsync < ops.log.index(("rename", renames[0])) < ops.log.index(("rename", renames[1]))


def test_the_sidecar_records_and_manifest_are_all_written_before_the_first_fsync(root: Path) -> None:
    """So that one journal commit of the file system can carry all of them (``RecordWriter.finish``)."""
    ops = RecordingOps()
    store = SidecarStore(CheckpointStore(root, ops), lambda: [_line(b'{"call_id":"mc_1"}')])
    write(store, root / "ck")
    first_fsync = next(number for number, (op, _) in enumerate(ops.log) if op == "fsync")
    written = {name.rsplit("-", 1)[0] for op, name in ops.log[:first_fsync] if op == "write"}
    assert written == {".tokens", ".tokens-index", ".records", ".manifest"}
    fsynced = [name.rsplit("-", 1)[0] for op, name in ops.log if op == "fsync"]
    assert fsynced == [".tokens", ".tokens-index", ".records", ".manifest"]


def test_a_sidecar_written_after_an_abort_is_not_left_behind(root: Path) -> None:
    """An abort (a resume, from another thread) can land while the sidecar is being written: the
    hand-over then refuses the file, closes it and removes it, as the abort would have."""
    store = SidecarStore(CheckpointStore(root), lambda: [_line(b'{"call_id":"mc_1"}')])
    writer = store.open_writer(root / "ck", "model", "policy_model", StopSignal())
    writer.write_lines([b'{"episode_id":{"rollout_id":"r1","attempt":0},"ledger":[]}'])
    writer.abort()
    with pytest.raises(WriteStopped):
        writer.finish("model", "policy_model", "c1")
    assert list((root / "ck" / "gym" / "model" / "policy_model").iterdir()) == []


def test_a_failed_sidecar_write_fails_the_commit_and_leaves_no_records(root: Path) -> None:
    store = SidecarStore(CheckpointStore(root, RecordingOps(fail_fsync_of=".tokens")), lambda: [_line(b"{}")])
    with pytest.raises(Unavailable, match=r"ENOSPC .* at token-lines-[0-9a-f]{64}\.jsonl; .* not be published"):
        write(store, root / "ck")
    assert list((root / "ck" / "gym" / "model" / "policy_model").iterdir()) == []


# ---- restore -------------------------------------------------------------------------------------


async def test_a_restore_gives_the_tokens_back_and_exports_them_again_byte_for_byte(
    open_policy: Callable[..., Any],
) -> None:
    async with open_policy(CALL, CALL) as policy:
        first, _ = await first_turns(policy)
        where, committed = await policy.commit("c1")
    async with open_policy() as fresh:
        restored = await fresh.restore("back", where, [R1, R2])
        assert restored.status_code == 200, restored.text
        await fresh.control.ok("resume", checkpoint_id="back")
        [call] = await fresh.calls(R1.next_attempt())
        assert {name: call[name] for name in ARRAYS} == {name: first["output"][0][name] for name in ARRAYS}
        assert call["policy_version"] == first["output"][0]["policy_version"] and call["attempt"] == 0
        [other] = await fresh.calls(R2.next_attempt())
        assert set(other) == {"call_id", "attempt", "policy_version"}  # delivered without token ids
        scope = [R1.to_json(), R2.to_json()]
        again, recommitted = await fresh.commit("c2", episode_ids=scope, incremental=False)
        linked, _ = await fresh.commit("c3", episode_ids=scope)
    assert recommitted["manifest"]["records_sha256"] == committed["manifest"]["records_sha256"]
    assert sidecar_of(again).read_bytes() == sidecar_of(where).read_bytes()
    # incremental: nothing changed, so the sidecar of c2 is linked into c3, not written again
    assert sidecar_of(linked).stat().st_ino == sidecar_of(again).stat().st_ino


# ---- the memory bound ------------------------------------------------------------------------------


async def test_durable_token_lines_leave_memory_and_are_read_back_from_the_sidecar(
    open_policy: Callable[..., Any], root: Path
) -> None:
    async with open_policy(CALL) as policy:
        first = await policy.respond(R1, QUESTION, return_token_ids=True)
        assert (await policy.extras())["token_bytes_in_memory"] > 0
        where, _ = await policy.commit("c1")
        assert (await policy.extras())["token_bytes_in_memory"] == 0  # durable: it left memory
        shutil.rmtree(where.parents[2])  # a pruned checkpoint: the descriptor kept it readable
        [call] = await policy.calls(R1)
    assert {name: call[name] for name in ARRAYS} == {name: first["output"][0][name] for name in ARRAYS}


async def test_restored_token_lines_stay_in_the_sidecar_not_in_memory(
    open_policy: Callable[..., Any], root: Path
) -> None:
    async with open_policy(CALL) as policy:
        first = await policy.respond(R1, QUESTION, return_token_ids=True)
        where, _ = await policy.commit("c1")
    store = SidecarStore(CheckpointStore(root), list)
    [record] = store.read(where.parents[2], "model", where.name, frozenset({R1})).records
    assert isinstance(record, TokenedRecord)
    [tokens] = record.tokens.values()
    assert not tokens.in_memory  # read back from the restored-from sidecar when needed
    shutil.rmtree(where.parents[2])  # a pruned checkpoint: the descriptor kept it readable
    assert tokens.generation_token_ids == first["output"][0]["generation_token_ids"]


async def test_past_the_bound_token_lines_spill_and_are_committed_exactly(
    open_policy: Callable[..., Any],
) -> None:
    async with open_policy(CALL, capture_memory_max_bytes=0) as policy:
        first = await policy.respond(R1, QUESTION, return_token_ids=True)
        extras = await policy.extras()
        assert extras["token_bytes_in_memory"] == 0 and extras["token_lines_spilled"] == 1
        [call] = await policy.calls(R1)
        where, _ = await policy.commit("c1")
        assert (await policy.extras())["token_lines_spilled"] == 0  # durable: read from the sidecar
    assert {name: call[name] for name in ARRAYS} == {name: first["output"][0][name] for name in ARRAYS}
    [line] = sidecar_of(where).read_bytes().splitlines()
    assert orjson.loads(line)["generation_token_ids"] == first["output"][0]["generation_token_ids"]


def kept_lines(root: Path, count: int) -> tuple[list[CallTokens], Path]:
    """``count`` token lines kept in one file, one after the other (as a committed sidecar keeps them)."""
    lines = [orjson.dumps({"call_id": f"mc_{n}", "generation_token_ids": list(range(n + 1))}) for n in range(count)]
    path = root / "kept.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    file, offset, crc, kept = LineFile.open(path), 0, 0, []
    for n, line in enumerate(lines):
        tokens = CallTokens(f"mc_{n}", line, hashlib.sha256(line).hexdigest())
        tokens.kept_at(file, offset, crc)  # each CRC going on from the line before's, as a commit keeps them
        offset, crc = offset + len(line) + 1, tokens.crc
        kept.append(tokens)
    return kept, path


def chained_crcs(lines: list[bytes]) -> list[int]:
    """The CRC-32 of each line and its newline, each going on from the one before's, the first from 0."""
    return list(accumulate(lines, lambda crc, line: zlib.crc32(line + b"\n", crc), initial=0))[1:]


def chunk_bytes(buffer: ChunkBuffer, tokens: list[CallTokens], **kwargs: int) -> list[bytes]:
    """Each chunk's bytes, taken before the next chunk is asked for (a chunk is a view of the buffer)."""
    return [bytes(chunk) for chunk in buffer.chunks(tokens, **kwargs)]


def test_token_lines_kept_next_to_each_other_are_read_back_in_one_read_each_run(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept, path = kept_lines(root, 6)
    in_memory = CallTokens("mc_new", b'{"call_id":"mc_new"}', hashlib.sha256(b'{"call_id":"mc_new"}').hexdigest())
    order = [kept[0], kept[1], kept[2], in_memory, kept[3], kept[5], kept[4]]  # runs: 0-2, 3, 5, 4
    reads: list[int] = []
    real_preadv = os.preadv

    def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        reads.append(offset)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    [chunk] = chunk_bytes(ChunkBuffer(), order)
    lines = path.read_bytes().splitlines()
    assert chunk.splitlines() == [*lines[:3], b'{"call_id":"mc_new"}', lines[3], lines[5], lines[4]]
    assert chunk.endswith(b"\n")
    assert len(reads) == 4  # one per run, the line in memory read from nowhere


def counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """``module.name`` counted from now on: the list holds the number of calls."""
    calls, real = [0], getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def counting_sha256(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``hashlib.sha256`` counted from now on: the list holds the number of calls."""
    return counting(monkeypatch, hashlib, "sha256")


def test_kept_lines_are_copied_checked_by_their_crc_not_hashed_again(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines that left memory here carry their CRC-32s, chained: a copy checks those, not SHA-256, and a
    run of them with one CRC over all its bytes, whatever the number of its lines."""
    kept, path = kept_lines(root, 40)
    assert [tokens.crc for tokens in kept] == chained_crcs(path.read_bytes().splitlines())
    hashed, crcs = counting_sha256(monkeypatch), counting(monkeypatch, zlib, "crc32")
    assert b"".join(chunk_bytes(ChunkBuffer(), kept)) == path.read_bytes()
    assert hashed[0] == 0
    assert crcs[0] <= 2  # the run's bytes, then its last newline


def test_lines_leaving_memory_at_a_commit_or_read_whole_at_a_restore_chain_their_crcs(root: Path) -> None:
    """The lines a commit made durable leave memory with their CRCs chained in the order they were
    written; so do the lines a restore reads from a sidecar read whole (no index): a later copy of
    any run of them is one CRC."""
    lines = [orjson.dumps({"call_id": f"mc_{n}", "generation_token_ids": list(range(n + 2))}) for n in range(5)]
    tokens = [CallTokens(f"mc_{n}", line, hashlib.sha256(line).hexdigest()) for n, line in enumerate(lines)]
    records = [Record.from_data({"episode_id": {"rollout_id": f"r{n}", "attempt": 0},
                                 "ledger": [{"call_id": line.call_id, "token_digest": line.digest}]})
               for n, line in enumerate(tokens)]
    store = SidecarStore(CheckpointStore(root), lambda: tokens)
    writer = store.open_writer(root / "ck", "model", "policy_model", StopSignal())
    writer.write_records(records)
    writer.finish("model", "policy_model", "c1")
    assert not any(line.in_memory for line in tokens)
    assert [line.crc for line in tokens] == chained_crcs(lines)
    [sidecar] = [path for path in (root / "ck").rglob("*") if SIDECAR_NAME.fullmatch(path.name)]
    sidecar.with_name(index_name(sidecar.name)).unlink()  # read whole
    wanted = frozenset(RolloutIdentity(f"r{n}") for n in (1, 2, 4))
    read = SidecarStore(CheckpointStore(root), list).read(root / "ck", "model", "policy_model", wanted).records
    found = {call: line for record in read if isinstance(record, TokenedRecord)
             for call, line in record.tokens.items()}
    assert [found[f"mc_{n}"].crc for n in (1, 2)] == chained_crcs(lines[1:3])  # r3 not read: r4 starts again
    assert found["mc_4"].crc == zlib.crc32(lines[4] + b"\n")


def test_a_line_restored_through_the_index_is_copied_by_its_digest_once_then_by_its_crc(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line placed by an index was never read: its CRC is unknown, so a copy checks it against its
    digest, and takes the CRCs of the run it was copied in, chained; a line read alone (and checked
    against its digest) gets its CRC from 0."""
    kept, path = kept_lines(root, 3)
    lines = path.read_bytes().splitlines()
    file = LineFile.open(path)  # one file, lines next to each other: one run

    def placed() -> list[CallTokens]:
        return [CallTokens.kept_in(line.call_id, line.digest, line.size, file, offset) for line, offset in
                zip(kept, (0, kept[0].size + 1, kept[0].size + kept[1].size + 2), strict=True)]

    alone = placed()
    assert alone[1].line == lines[1]  # read: checked by its digest
    assert [tokens.crc for tokens in alone] == [None, zlib.crc32(lines[1] + b"\n"), None]
    run = placed()
    assert [tokens.crc for tokens in run] == [None, None, None]
    hashed = counting_sha256(monkeypatch)
    assert b"".join(chunk_bytes(ChunkBuffer(), run)) == path.read_bytes()
    assert hashed[0] == 3
    assert [tokens.crc for tokens in run] == chained_crcs(lines)
    hashed[0] = 0
    for lines_of in (run, alone):  # ``run`` by the CRCs it took; ``alone``, one CRC of three known, by digests
        assert b"".join(chunk_bytes(ChunkBuffer(), lines_of)) == path.read_bytes()
    assert hashed[0] == 3  # the lines of ``alone``, once: then they chain too
    assert [tokens.crc for tokens in alone] == chained_crcs(lines)
    hashed[0] = 0
    assert b"".join(chunk_bytes(ChunkBuffer(), alone)) == path.read_bytes()
    assert hashed[0] == 0


def test_lines_whose_crcs_do_not_chain_are_checked_each_then_chained(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines next to each other whose CRCs were taken apart (each from 0) are checked chain by chain,
    then chained: the next copy of the same run is one CRC."""
    kept, path = kept_lines(root, 30)
    lines = path.read_bytes().splitlines()
    for tokens, line in zip(kept, lines, strict=True):
        tokens.crc_in, tokens.crc = 0, zlib.crc32(line + b"\n")
    hashed = counting_sha256(monkeypatch)
    assert b"".join(chunk_bytes(ChunkBuffer(), kept)) == path.read_bytes()
    assert hashed[0] == 0
    assert [tokens.crc for tokens in kept] == chained_crcs(lines)
    crcs = counting(monkeypatch, zlib, "crc32")
    assert b"".join(chunk_bytes(ChunkBuffer(), kept)) == path.read_bytes()
    assert crcs[0] <= 2


def test_token_lines_are_copied_a_bounded_chunk_at_a_time_in_one_buffer(root: Path) -> None:
    kept, path = kept_lines(root, 40)
    bound = 200
    buffer = ChunkBuffer()
    chunks = chunk_bytes(buffer, kept, chunk_bytes=bound)
    longest = max(tokens.size for tokens in kept) + 1
    assert len(chunks) > 3
    assert all(len(chunk) < bound + longest for chunk in chunks)
    assert b"".join(chunks) == path.read_bytes()
    held = len(buffer._data)
    assert held < bound + longest  # the largest chunk, held from one write to the next
    assert b"".join(chunk_bytes(buffer, kept, chunk_bytes=bound)) == path.read_bytes()
    assert len(buffer._data) == held


@pytest.mark.parametrize("crcs", ["chained", "each from 0"])
def test_a_damaged_newline_between_kept_lines_is_written_as_a_newline(root: Path, crcs: str) -> None:
    kept, path = kept_lines(root, 5)
    if crcs == "each from 0":  # a chain's CRC does not cover the newline after it
        for tokens, line in zip(kept, path.read_bytes().splitlines(), strict=True):
            tokens.crc_in, tokens.crc = 0, zlib.crc32(line + b"\n")
    content = path.read_bytes()
    damaged = bytearray(content)
    damaged[kept[2].size + kept[0].size + kept[1].size + 2] = ord("x")  # the newline after line 2
    path.write_bytes(bytes(damaged))
    assert b"".join(chunk_bytes(ChunkBuffer(), kept)) == content  # each line checked, newlines as written


def test_a_second_write_while_the_buffer_is_held_gets_a_buffer_of_its_own(root: Path) -> None:
    kept, path = kept_lines(root, 40)
    buffer = ChunkBuffer()
    first = buffer.chunks(kept, chunk_bytes=200)
    view = next(first)
    held = bytes(view)
    second = chunk_bytes(buffer, kept[::-1], chunk_bytes=50)  # smaller chunks, while the first holds it
    assert bytes(view) == held  # not overwritten
    assert b"".join(second).splitlines() == path.read_bytes().splitlines()[::-1]
    assert b"".join([held, *(bytes(chunk) for chunk in first)]) == path.read_bytes()


@pytest.mark.parametrize("damage", ["a changed byte", "cut short"])
def test_a_kept_token_line_that_changed_on_disk_is_refused(root: Path, damage: str) -> None:
    kept, path = kept_lines(root, 5)
    content = bytearray(path.read_bytes())
    if damage == "a changed byte":
        content[content.index(b"mc_2") + 3] ^= 1  # a line in the middle of the run
    else:
        del content[-3:]
    path.write_bytes(bytes(content))
    with pytest.raises(InvalidCheckpointState, match=r"kept in kept\.jsonl"):
        chunk_bytes(ChunkBuffer(), kept)
    (root / "new").mkdir()
    with pytest.raises(InvalidCheckpointState, match=r"kept in kept\.jsonl"):  # found while writing
        write_sidecar(FileOps(), root / "new", kept, StopSignal(), chunk_bytes=40)
    assert list((root / "new").iterdir()) == []  # no sidecar, no temporary file


def test_a_spill_that_cannot_be_written_is_a_clear_error(root: Path) -> None:
    memory = CaptureMemory(0, spill_dir=str(root / "missing"))
    with pytest.raises(Unavailable, match="capture_memory_max_bytes 0"):
        CallTokens.of("mc_1", TokenCapture([1], [2], [-0.5]), memory)


def open_under(directory: Path) -> set[int]:
    """The inodes of the files under ``directory`` this process holds open (deleted ones included)."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        with suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(f"{directory}/"):
                held.add(os.fstat(int(fd)).st_ino)
    return held


def token_line(n: int, ids: int) -> CallTokens:
    line = orjson.dumps({"call_id": f"mc_{n}", "generation_token_ids": list(range(ids))})
    return CallTokens(f"mc_{n}", line, hashlib.sha256(line).hexdigest())


def commit_lines(store: SidecarStore, checkpoint_dir: Path, tokens: list[CallTokens]) -> Path:
    """A commit of ``tokens`` (the lines ``store`` answers), each in a record of its own: the
    participant's directory."""
    records = [Record.from_data({"episode_id": {"rollout_id": f"r_{line.call_id}", "attempt": 0},
                                 "ledger": [{"call_id": line.call_id, "token_digest": line.digest}]})
               for line in tokens]
    writer = store.open_writer(checkpoint_dir, "model", "policy_model", StopSignal())
    writer.write_records(records)
    writer.finish("model", "policy_model", checkpoint_dir.name)
    return writer.directory


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc/self/fd")
def test_lines_a_commit_copies_are_read_from_its_sidecar_and_the_earlier_file_is_closed(root: Path) -> None:
    """One rollout living across commits, a call per commit, beside short ones: its earlier lines are
    each time in a sidecar under a quarter in use, so copied, not linked. Once the commit is durable
    they are read from the new sidecar, and the earlier one (pruned) is closed: the process holds
    open the sidecars its lines need, not one per commit."""
    long: list[CallTokens] = []
    current: list[CallTokens] = []
    store = SidecarStore(CheckpointStore(root), lambda: current)
    for n in range(6):
        long.append(token_line(n, 2))
        current = [*long, *(token_line(100 * (n + 1) + k, 60) for k in range(8))]
        directory = commit_lines(store, root / f"c{n}", current)
        if n:
            shutil.rmtree(root / f"c{n - 1}")  # pruned: the last checkpoint kept
        sidecars = {path.stat().st_ino for path in directory.iterdir() if SIDECAR_NAME.fullmatch(path.name)}
        assert len(sidecars) == 1  # every line copied into the new sidecar
        assert open_under(root) == sidecars
    assert all(after.crc_in == before.crc for before, after in pairwise(long))  # one chain: a copy is one CRC
    for line in long:  # read from the new sidecar, its CRC still of its bytes
        assert line.line == orjson.dumps({"call_id": line.call_id, "generation_token_ids": [0, 1]})
        assert line.crc == line_crc(line.line, line.crc_in)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc/self/fd")
def test_spilled_lines_a_commit_made_durable_leave_the_spill_file_which_is_closed(root: Path) -> None:
    spill = root / "spill"
    spill.mkdir()
    memory = CaptureMemory(0, spill_dir=str(spill))
    tokens = [CallTokens.of(f"mc_{n}", TokenCapture([1, n], [2], [-0.5]), memory) for n in range(3)]
    assert memory.spilled == 3 and len(open_under(spill)) == 1
    store = SidecarStore(CheckpointStore(root), lambda: tokens)
    directory = commit_lines(store, root / "c1", tokens)
    assert memory.spilled == 0  # durable: counted no longer among the spilled lines
    assert open_under(spill) == set()  # the spill file the lines were in (the current one) is closed
    [sidecar] = [path for path in directory.iterdir() if SIDECAR_NAME.fullmatch(path.name)]
    assert open_under(root) == {sidecar.stat().st_ino}
    assert b"".join(line.line + b"\n" for line in tokens) == sidecar.read_bytes()
    late = CallTokens.of("mc_9", TokenCapture([9], [2], [-0.5]), memory)  # a new spill file
    assert memory.spilled == 1 and len(open_under(spill)) == 1
    late.forget()  # its ledger forgotten
    del late
    assert memory.spilled == 0 and open_under(spill) == set()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc/self/fd")
def test_spilled_lines_a_linked_sidecar_holds_are_read_from_it(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Spilled lines whose commit could not open its sidecar stay spilled; the next commit links that
    sidecar (every line in use), and they are read from the link."""
    spill = root / "spill"
    spill.mkdir()
    memory = CaptureMemory(0, spill_dir=str(spill))
    tokens = [CallTokens.of(f"mc_{n}", TokenCapture([1, n], [2], [-0.5]), memory) for n in range(3)]
    store = SidecarStore(CheckpointStore(root), lambda: tokens)

    def out_of_descriptors(path: Path) -> LineFile:
        raise OSError(errno.EMFILE, "Too many open files")

    with monkeypatch.context() as patched:
        patched.setattr(LineFile, "open", out_of_descriptors)
        first = commit_lines(store, root / "c1", tokens)
    assert memory.spilled == 3 and len(open_under(spill)) == 1
    second = commit_lines(store, root / "c2", tokens)
    [sidecar] = [path for path in second.iterdir() if SIDECAR_NAME.fullmatch(path.name)]
    assert sidecar.stat().st_ino == (first / sidecar.name).stat().st_ino  # linked, not written again
    assert memory.spilled == 0 and open_under(spill) == set()
    assert b"".join(line.line + b"\n" for line in tokens) == sidecar.read_bytes()


async def test_the_capture_route_is_rollout_scoped(open_policy: Callable[..., Any]) -> None:
    async with open_policy() as policy:
        reply = await policy.http.get(CAPTURE_TOKENS_PATH)
        assert (reply.status_code, reply.json()["error"]["code"]) == (400, "rollout_id_required")
        assert await policy.calls(R1) == []


def flip_a_digit(line: bytes) -> bytes:
    """The line with its first token id changed (still valid JSON)."""
    head, _, rest = line.partition(b"[")
    return head + b"[" + (b"9" if rest[:1] != b"9" else b"8") + rest[1:]


def change_a_byte(path: Path) -> None:
    path.write_bytes(flip_a_digit(path.read_bytes()))


def change_and_rename(path: Path) -> None:
    """A sidecar that matches its name, but whose line is not the one the row's digest names."""
    content = flip_a_digit(path.read_bytes())
    path.unlink()
    path.with_name(named_by_lines(content)).write_bytes(content)


def cut_the_last_newline(path: Path) -> None:
    """The same lines, so the same line digests, but the file no longer ends as it was written."""
    path.write_bytes(path.read_bytes()[:-1])


def earlier_form(path: Path) -> Path:
    """The sidecar renamed in the earlier form: ``tokens-<sha256 of the file>.jsonl``."""
    target = path.with_name(f"tokens-{hashlib.sha256(path.read_bytes()).hexdigest()}.jsonl")
    path.rename(target)
    return target


def earlier_form_changed(path: Path) -> None:
    change_a_byte(earlier_form(path))


TAMPERS: dict[str, Callable[[Path], None]] = {
    "the last newline cut": cut_the_last_newline,
    "a changed byte under the earlier name": earlier_form_changed,
    "a changed byte": change_a_byte,
    "a changed line renamed to its new digest": change_and_rename,
    "a missing sidecar": Path.unlink,
}


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
async def test_a_tampered_or_missing_sidecar_is_refused_with_nothing_installed(
    tamper: str, open_policy: Callable[..., Any]
) -> None:
    async with open_policy(CALL) as policy:
        await first_turns(policy)
        where, _ = await policy.commit("c1")
    original = sidecar_of(where)
    content = original.read_bytes()
    TAMPERS[tamper](original)
    async with open_policy() as fresh:
        refused = await fresh.restore("bad", where, [R1, R2])
        assert (refused.status_code, refused.json()["error"]["code"]) == (422, "invalid_checkpoint_state")
        assert (await fresh.extras())["ledgers"] == 0
        await fresh.control.ok("resume", checkpoint_id="bad")
        for path in where.iterdir():
            if SIDECAR_NAME.fullmatch(path.name):
                path.unlink()
        original.write_bytes(content)
        restored = await fresh.restore("good", where, [R1, R2])  # the same process: nothing was installed
        assert restored.status_code == 200, restored.text
        assert (await fresh.extras())["ledgers"] == 2


async def test_a_sidecar_named_as_before_by_the_files_digest_is_still_restored(
    open_policy: Callable[..., Any],
) -> None:
    async with open_policy(CALL) as policy:
        first, _ = await first_turns(policy)
        where, _ = await policy.commit("c1")
    earlier = earlier_form(sidecar_of(where))
    async with open_policy() as fresh:
        restored = await fresh.restore("c1", where, [R1, R2])
        assert restored.status_code == 200, restored.text
        assert (await fresh.extras())["ledgers"] == 2
        [call] = await fresh.calls(R1.next_attempt())
        await fresh.control.ok("resume", checkpoint_id="c1")
        scope = [R1.to_json(), R2.to_json()]
        linked, _ = await fresh.commit("c2", episode_ids=scope)  # the earlier file linked as it is named
        again, _ = await fresh.commit("c3", episode_ids=scope, incremental=False)  # written in the new form
    assert {name: call[name] for name in ARRAYS} == {name: first["output"][0][name] for name in ARRAYS}
    assert sidecar_of(linked).name == earlier.name and sidecar_of(linked).stat().st_ino == earlier.stat().st_ino
    assert sidecar_of(again).name == named_by_lines(earlier.read_bytes())
    for directory in (linked, again):  # each holds attempt 0's records again (the restored ledgers unchanged)
        async with open_policy() as later:
            assert (await later.restore("later", directory, [R1])).status_code == 200
            [call] = await later.calls(R1.next_attempt())
            assert {name: call[name] for name in ARRAYS} == {name: first["output"][0][name] for name in ARRAYS}


# ---- the sidecar's index --------------------------------------------------------------------------


async def two_calls_committed(open_policy: Callable[..., Any]) -> tuple[Path, bytes]:
    """r1 and r3 each made a call with token ids: the sidecar's two lines; the directory and r3's line."""
    async with open_policy(CALL, CALL) as policy:
        await policy.respond(R1, QUESTION, return_token_ids=True)
        await policy.respond(R3, QUESTION, return_token_ids=True)
        where, _ = await policy.commit("c1")
    [call] = calls_of(where, R3)
    [line] = [line for line in sidecar_of(where).read_bytes().splitlines() if orjson.loads(line)["call_id"] == call]
    return where, line


def calls_of(where: Path, episode: RolloutIdentity) -> list[str]:
    """The call ids of ``episode``'s ledger rows in the committed records of ``where``."""
    manifest = orjson.loads((where / "manifest.json").read_bytes())
    for record in map(orjson.loads, (where / manifest["records_file"]).read_bytes().splitlines()):
        if record["episode_id"]["rollout_id"] == episode.rollout_id:
            return [row["call_id"] for row in record["ledger"]]
    raise AssertionError(f"no record of {episode}")


def damage_line(where: Path, line: bytes) -> None:
    """One byte of ``line`` in the sidecar changed, in place (the file keeps its name and size)."""
    path = sidecar_of(where)
    content = path.read_bytes()
    at = content.index(line) + len(line) - 2  # a digit of its last array
    path.write_bytes(content[:at] + (b"0" if content[at:at + 1] != b"0" else b"1") + content[at + 1:])


async def test_a_restore_through_the_index_reads_only_the_lines_it_needs(open_policy: Callable[..., Any]) -> None:
    """r3's line damaged on disk: a restore of r1 alone never reads it through the index; without the
    index, the sidecar read whole no longer matches its name and the restore is refused."""
    where, r3_line = await two_calls_committed(open_policy)
    damage_line(where, r3_line)
    async with open_policy() as fresh:
        restored = await fresh.restore("c1", where, [R1])
        assert restored.status_code == 200, restored.text
        assert (await fresh.extras())["ledgers"] == 1
    index_of(where).unlink()
    async with open_policy() as fresh:
        refused = await fresh.restore("c1", where, [R1])
        assert (refused.status_code, refused.json()["error"]["code"]) == (422, "invalid_checkpoint_state")
        assert "does not match its digest" in refused.json()["error"]["detail"]


@pytest.mark.parametrize("damage", ["a changed byte", "cut short", "another sidecar's index"])
async def test_a_damaged_index_is_not_used_the_sidecar_is_read_whole(
    damage: str, open_policy: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    where, r3_line = await two_calls_committed(open_policy)
    index = index_of(where)
    content = index.read_bytes()
    if damage == "a changed byte":
        index.write_bytes(content[:20] + bytes([content[20] ^ 1]) + content[21:])
    elif damage == "cut short":
        index.write_bytes(content[:-1])
    else:
        index.write_bytes(encode_index([IndexedLine(hashlib.sha256(b"{}").hexdigest(), 0, 2)]))
    async with open_policy() as fresh:
        with caplog.at_level(logging.WARNING):
            restored = await fresh.restore("c1", where, [R1, R3])
        assert restored.status_code == 200, restored.text
        assert (await fresh.extras())["ledgers"] == 2
    assert "is damaged; the sidecar is read whole" in caplog.text
    damage_line(where, r3_line)  # read whole, a damaged line of the sidecar is found again
    async with open_policy() as fresh:
        refused = await fresh.restore("c1", where, [R1])
        assert refused.status_code == 422


@pytest.mark.parametrize("case", ["another name", "sizes that do not add up", "a changed byte", "no magic",
                                  "longer than the sidecar allows"])
def test_an_index_that_is_not_its_sidecars_decodes_to_nothing(case: str) -> None:
    lines = [b'{"call_id":"mc_1","prompt_token_ids":[1],"generation_token_ids":[2],"generation_log_probs":[-1]}',
             b'{"call_id":"mc_22","prompt_token_ids":[1],"generation_token_ids":[],"generation_log_probs":[]}']
    digests = [hashlib.sha256(line).hexdigest() for line in lines]
    named, size = lines_digest_of(digests), sum(len(line) + 1 for line in lines)
    placed = [IndexedLine(digests[0], 0, len(lines[0])), IndexedLine(digests[1], len(lines[0]) + 1, len(lines[1]))]
    data = encode_index(placed)
    assert decode_index(data, named, size, set(digests)) == placed
    assert decode_index(data, named, size, {digests[1]}) == placed[1:]  # only the lines wanted
    many = [IndexedLine(digests[0], 0, 0)] * 10  # ten lines said to fit where the shortest would not
    broken = {
        "another name": (data, lines_digest_of(digests[::-1]), size),
        "sizes that do not add up": (data, named, size + 1),
        "a changed byte": (data[:-40] + bytes([data[-40] ^ 1]) + data[-39:], named, size),
        "no magic": (b"X" + data[1:], named, size),
        "longer than the sidecar allows": (encode_index(many), lines_digest_of([digests[0]] * 10), 10),
    }[case]
    assert decode_index(*broken, set(digests)) is None


def test_a_sidecar_line_that_does_not_hash_to_its_row_is_refused() -> None:
    capture = TokenCapture([1, 2, 3], [4, 5], [-0.5, -0.25])
    tokens = CallTokens.of("mc_1", capture)
    row = {"call_id": "mc_1", "parent_call_id": None, "attempt": 0, "prompt_length": 3,
           "prompt_digest": sha256_of([1, 2, 3]), "output_length": 2, "output_digest": sha256_of([4, 5]),
           "finish_reason": "stop", "policy_version": 7, "admitted_at": 1.0, "conversation_digest": "ab" * 32,
           "token_digest": tokens.digest}
    plain = Record.from_data({"episode_id": {"rollout_id": "r1", "attempt": 0}, "ledger": [row]})
    good = TokenedRecord(plain.raw, plain.data, plain.episode, {"mc_1": tokens})
    assert LedgerBook().install([good]) == [RolloutIdentity("r1", 1)]
    with pytest.raises(InvalidCheckpointState, match="not in the token sidecar"):
        LedgerBook().install([plain])
    other = Record.from_data({"episode_id": {"rollout_id": "r1", "attempt": 0},
                              "ledger": [{**row, "output_digest": sha256_of([4, 6])}]})
    with pytest.raises(InvalidCheckpointState, match="do not match the ledger row"):
        LedgerBook().install([TokenedRecord(other.raw, other.data, other.episode, {"mc_1": tokens})])



GOOD_LINE = {"call_id": "mc_1", "prompt_token_ids": [1, 2, 3], "generation_token_ids": [4, 5],
             "generation_log_probs": [-0.5, -2.5e-05]}
MALFORMED_LINES: dict[str, tuple[bytes, str]] = {
    "not JSON": (b'{"call_id":"mc_1",', "not valid JSON"),
    "keys in another order": (orjson.dumps({**dict(reversed(GOOD_LINE.items()))}), "must be"),
    "a missing key": (orjson.dumps({k: v for k, v in GOOD_LINE.items() if k != "generation_log_probs"}), "must be"),
    "another call's line": (orjson.dumps({**GOOD_LINE, "call_id": "mc_2"}), "is for mc_2"),
    "a boolean id": (orjson.dumps({**GOOD_LINE, "prompt_token_ids": [1, True, 3]}), "malformed"),
    "a negative id": (orjson.dumps({**GOOD_LINE, "generation_token_ids": [4, -5]}), "malformed"),
    "a float id": (orjson.dumps({**GOOD_LINE, "prompt_token_ids": [1, 2.0, 3]}), "malformed"),
    "a string id": (orjson.dumps({**GOOD_LINE, "prompt_token_ids": [1, "2", 3]}), "malformed"),
    "a nested id list": (orjson.dumps({**GOOD_LINE, "prompt_token_ids": [[1, 2, 3]]}), "malformed"),
    "ids as an object": (orjson.dumps({**GOOD_LINE, "prompt_token_ids": {"a": 1}}), "malformed"),
    "an id past 64 bits": (orjson.dumps({**GOOD_LINE, "generation_token_ids": [4, 5]}).replace(
        b"[4,5]", b"[4," + b"9" * 30 + b"]"), "malformed|not valid JSON"),
    "a null log-prob": (orjson.dumps({**GOOD_LINE, "generation_log_probs": [-0.5, None]}), "malformed"),
    "a boolean log-prob": (orjson.dumps({**GOOD_LINE, "generation_log_probs": [-0.5, False]}), "malformed"),
    "one log-prob too few": (orjson.dumps({**GOOD_LINE, "generation_log_probs": [-0.5]}), "malformed"),
    "ids that hash elsewhere": (orjson.dumps({**GOOD_LINE, "prompt_token_ids": [1, 2, 4]}), "do not match"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_LINES))
def test_a_sidecar_line_is_checked_against_its_row_at_the_install(case: str) -> None:
    line, refusal = MALFORMED_LINES[case]
    tokens = CallTokens("mc_1", line, hashlib.sha256(line).hexdigest())  # as a restore keeps it: unparsed
    with pytest.raises(InvalidCheckpointState, match=refusal):
        tokens.check("mc_1", sha256_of([1, 2, 3]), sha256_of([4, 5]), "here")
    good = orjson.dumps(GOOD_LINE)
    CallTokens("mc_1", good, hashlib.sha256(good).hexdigest()).check(
        "mc_1", sha256_of([1, 2, 3]), sha256_of([4, 5]), "here")

# ---- splicing a restored call ----------------------------------------------------------------------


async def test_a_restored_call_is_spliced_from_the_sidecar_ids_as_the_uninterrupted_run_was(
    open_policy: Callable[..., Any], fmt: ChatFormat,
) -> None:
    async with open_policy(CALL, "The answer is 42.", "The answer is 42.") as policy:
        first = await policy.respond(R1, QUESTION, return_token_ids=True)
        where, _ = await policy.commit("c1", episode_ids=[R1.to_json()])
        # the uninterrupted run: the caller sends its items back with their token fields
        await policy.respond(R1, second_turn(first, first["output"]), return_token_ids=True)
        reference = policy.worker.requests[-1]["prompt"]
        # a caller without the ids, no restore: the text is all there is, the prompt is re-tokenized
        await policy.respond(R2, second_turn(first, stripped(first["output"])), return_token_ids=True)
        retokenized = policy.worker.requests[-1]["prompt"]
    item = first["output"][0]
    known = item["prompt_token_ids"] + item["generation_token_ids"]
    assert reference[: len(known)] == known and retokenized != reference  # the test can tell them apart
    assert fmt.decode(retokenized) == fmt.decode(reference)
    async with open_policy("The answer is 42.") as fresh:
        assert (await fresh.restore("back", where, [R1])).status_code == 200
        await fresh.control.ok("resume", checkpoint_id="back")
        second = await fresh.respond(R1.next_attempt(), second_turn(first, stripped(first["output"])),
                                     return_token_ids=True)
        assert fresh.worker.requests[-1]["prompt"] == reference  # spliced, never re-tokenized
        assert second["output"][0]["prompt_token_ids"] == reference


async def test_a_restored_call_whose_text_differs_from_the_ledger_is_encoded_afresh(
    open_policy: Callable[..., Any], fmt: ChatFormat, caplog: pytest.LogCaptureFixture,
) -> None:
    async with open_policy(CALL) as policy:
        first = await policy.respond(R1, QUESTION, return_token_ids=True)
        where, _ = await policy.commit("c1", episode_ids=[R1.to_json()])
    changed = [{**item, "arguments": '{"a":41,"b":2}'} for item in stripped(first["output"])]
    async with open_policy() as fresh:
        assert (await fresh.restore("back", where, [R1])).status_code == 200
        await fresh.control.ok("resume", checkpoint_id="back")
        with caplog.at_level(logging.WARNING, logger="model_servers.policy_model.token_splice"):
            await fresh.respond(R1.next_attempt(), second_turn(first, changed))
        prompt = fresh.worker.requests[-1]["prompt"]
    assert prompt == fmt.encode(fmt.decode(prompt))  # encoded afresh from the text
    assert "from the ledger" in caplog.text and "afresh" in caplog.text
