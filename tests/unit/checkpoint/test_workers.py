"""A multi-worker server's checkpoint machinery in one process: frames, the channel, the hub.

The coordinator (``WorkerHub`` over its one ``Participant``) and two workers
(``FollowerParticipant`` + ``WorkerLink``, each over the test kit's ``SessionsAdapter``) talk over a
real Unix socket in a temporary directory, exactly as the processes of a ``num_workers: 2`` server
do; only the processes are one. Checked: the frame codec's bounds and refusals, calls and errors
over the channel, the gate (admission closes on every worker), readiness merged across workers and
the blockers of missing or lost workers, one manifest holding every worker's records, restored
records claimed by the first worker that needs them, retire and forget on every worker, and the
503 ``checkpoint_coordinator_unavailable`` and the worker's exit when the coordinator is gone.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import pytest
from fastapi import FastAPI

from nemo_gym_ckpt.checkpoint import follower as follower_module
from nemo_gym_ckpt.checkpoint import frames as frames_module
from nemo_gym_ckpt.checkpoint import participant as participant_module
from nemo_gym_ckpt.checkpoint import worker_hub as worker_hub_module
from nemo_gym_ckpt.checkpoint.channel import Channel
from nemo_gym_ckpt.checkpoint.follower import FollowerParticipant, WorkerLink
from nemo_gym_ckpt.checkpoint.frames import encode_frame, read_frame
from nemo_gym_ckpt.checkpoint.models import CommitRequest, ControlRequest, ForgetRequest, RestoreRequest, RetireRequest
from nemo_gym_ckpt.checkpoint.participant import Participant
from nemo_gym_ckpt.checkpoint.router import make_router
from nemo_gym_ckpt.checkpoint.store import CheckpointStore
from nemo_gym_ckpt.checkpoint.worker_hub import WorkerHub, start_coordinator
from nemo_gym_ckpt.config import CheckpointConfig
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.errors import (
    ConfigError,
    CoordinatorUnavailable,
    InvalidCheckpointState,
    InvalidPhase,
    StaleAttempt,
    StaleCheckpoint,
    Unavailable,
)
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.launch.workers import RUNTIME_PREFIX, runtime_dir
from nemo_gym_ckpt.server import create_app
from nemo_gym_ckpt.testing.minimal import SessionsAdapter
from nemo_gym_ckpt.testing.resources import mesh_with
from tests.support.resources_participants import SERVERS

pytestmark = pytest.mark.unit

TOKEN = "workers-unit-token"
KIND, NAME = "resources", "res"
A, B = RolloutIdentity("a"), RolloutIdentity("b")
WAIT_S = 30.0


# ---- frames --------------------------------------------------------------------------------------


def reader_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def test_a_frame_round_trips_and_a_stream_ending_between_frames_is_a_clean_end() -> None:
    message = {"id": 1, "kind": "readiness", "body": {"text": "é", "n": 2**63 - 1}}
    reader = reader_of(encode_frame(message) + encode_frame({"kind": "gate", "body": {}}))
    assert await read_frame(reader) == message
    assert await read_frame(reader) == {"kind": "gate", "body": {}}
    assert await read_frame(reader) is None


async def test_frames_over_the_bound_are_refused_before_their_body_is_read() -> None:
    with pytest.raises(InvalidCheckpointState, match="over the 64-byte bound"):
        encode_frame({"body": "x" * 100}, max_bytes=64)
    reader = asyncio.StreamReader()  # a header announcing 1 GiB, and no body: refused without waiting
    reader.feed_data(struct.pack(">I", 1 << 30))
    with pytest.raises(InvalidCheckpointState, match="over the 1024-byte bound"):
        await asyncio.wait_for(read_frame(reader, max_bytes=1024), 1.0)


@pytest.mark.parametrize(("data", "problem"), [
    (struct.pack(">I", 3) + b"{]}", "not JSON"),
    (struct.pack(">I", 2) + b"[]", "not an object"),
    (b"\x00\x00", "inside a frame header"),
    (struct.pack(">I", 10) + b"{}", "inside a frame of 10 bytes"),
])
async def test_a_bad_frame_is_a_structured_refusal(data: bytes, problem: str) -> None:
    with pytest.raises(InvalidCheckpointState, match=problem) as caught:
        await read_frame(reader_of(data))
    assert caught.value.to_body()["error"]["code"] == "invalid_checkpoint_state"


# ---- the channel ---------------------------------------------------------------------------------


@dataclass
class Pair:
    left: Channel
    right: Channel
    closed: list[str] = field(default_factory=list)
    answered: list[str] = field(default_factory=list)  # the kinds of the calls the right end has answered


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (a Unix socket's path is at most 107 bytes), removed afterwards."""
    directory = Path(tempfile.mkdtemp(prefix="ngc-test-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
async def pair(short_dir: Path) -> AsyncIterator[Pair]:
    """Two channel ends over a real Unix socket; the right end answers ``echo`` and fails ``stale``."""
    path = short_dir / "s.sock"
    ends: asyncio.Queue[Channel] = asyncio.Queue()
    closed: list[str] = []
    answered: list[str] = []

    async def on_call(kind: str, body: dict[str, object]) -> dict[str, object]:
        if kind == "stale":
            raise StaleCheckpoint("c1 was resumed")
        if kind == "slow":
            await asyncio.sleep(10)
        answered.append(kind)
        if kind == "big":
            return {"text": "x" * 2000}
        return {"echo": body}

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channel = Channel(reader, writer, on_call=on_call, on_note=lambda kind, body: None, name="right",
                          on_closed=lambda: closed.append("right"))
        await ends.put(channel)
        await channel.serve()

    server = await asyncio.start_unix_server(accept, path=str(path))
    reader, writer = await asyncio.open_unix_connection(str(path))
    left = Channel(reader, writer, on_call=on_call, on_note=lambda kind, body: None, name="left",
                   on_closed=lambda: closed.append("left"))
    serving = asyncio.create_task(left.serve())
    right = await ends.get()
    yield Pair(left, right, closed, answered)
    left.close()
    right.close()
    server.close()
    await asyncio.gather(serving, return_exceptions=True)


async def test_a_call_gets_its_reply_and_a_remote_error_comes_back_as_its_class(pair: Pair) -> None:
    assert await pair.left.call("echo", {"x": 1}, 5) == {"echo": {"x": 1}}
    with pytest.raises(StaleCheckpoint, match="c1 was resumed"):
        await pair.left.call("stale", {}, 5)


async def test_a_call_past_its_deadline_or_on_a_closed_channel_is_coordinator_unavailable(pair: Pair) -> None:
    with pytest.raises(CoordinatorUnavailable, match=r"no reply within 0\.2 s"):
        await pair.left.call("slow", {}, 0.2)
    assert "slow" not in pair.answered  # given up at its deadline while the other end still works on it (10 s)
    pending = asyncio.create_task(pair.left.call("slow", {}, 30))
    await asyncio.sleep(0.05)
    pair.right.close()  # the peer goes away with a call pending
    with pytest.raises(CoordinatorUnavailable, match="closed"):
        await asyncio.wait_for(pending, 5)
    with pytest.raises(CoordinatorUnavailable, match="closed"):
        await pair.left.call("echo", {}, 5)
    assert sorted(pair.closed) == ["left", "right"]


async def test_a_reply_too_large_to_frame_is_answered_with_that_refusal(pair: Pair) -> None:
    pair.right.max_frame_bytes = 1024
    with pytest.raises(InvalidCheckpointState, match="over the 1024-byte bound"):  # a timeout: CoordinatorUnavailable
        async with asyncio.timeout(10):  # at once, not at the call's timeout
            await pair.left.call("big", {}, 60)
    assert await pair.left.call("echo", {"x": 1}, 5) == {"echo": {"x": 1}}  # the channel still works


async def test_a_frame_breaking_the_rules_closes_the_channel(pair: Pair) -> None:
    pending = asyncio.create_task(pair.left.call("slow", {}, 30))
    await asyncio.sleep(0.05)
    pair.right.writer.write(struct.pack(">I", 2) + b"[]")  # no object: the left end closes
    with pytest.raises(CoordinatorUnavailable):
        await asyncio.wait_for(pending, 5)
    assert "left" in pair.closed


# ---- a coordinator and two workers ---------------------------------------------------------------


@dataclass
class Worker:
    participant: FollowerParticipant
    adapter: SessionsAdapter
    link: WorkerLink
    lost: list[int]


@dataclass
class Server:
    hub: WorkerHub
    workers: list[Worker]
    root: Path
    path: Path

    def deadline(self, seconds: float = 10.0) -> float:
        return time.time() + seconds

    def control(self, seconds: float = 10.0, **fields: object) -> ControlRequest:
        return ControlRequest(checkpoint_id=str(fields.pop("checkpoint_id", "c1")), deadline_ts=self.deadline(seconds))


def config(root: Path) -> CheckpointConfig:
    return CheckpointConfig(enabled=True, control_auth_token=TOKEN, root=root)


async def worker(path: Path, root: Path, pid: int) -> Worker:
    adapter = SessionsAdapter()
    participant = FollowerParticipant(kind=KIND, instance=NAME, adapter=adapter, store=CheckpointStore(root),
                                      lease_grace_s=600)
    adapter.participant = participant
    lost: list[int] = []
    link = WorkerLink(participant, adapter, path, lambda: lost.append(pid), pid=pid)
    link.start()
    await link.registered()
    return Worker(participant, adapter, link, lost)


async def start_server(root: Path, sockets: Path, workers: int = 2) -> Server:
    path = sockets / f"{time.monotonic_ns()}.sock"
    hub = await start_coordinator(kind=KIND, instance=NAME, config=config(root), path=path, expected_workers=2)
    started = [await worker(path, root, 1000 + i) for i in range(workers)]
    return Server(hub, started, root, path)


@pytest.fixture
async def server(tmp_path: Path, short_dir: Path) -> AsyncIterator[Server]:
    started = await start_server(tmp_path, short_dir)
    yield started
    for each in started.workers:
        await each.link.aclose()
    await started.hub.aclose()


def participant(server: Server) -> Participant:
    assert server.hub.participant is not None
    return server.hub.participant


@pytest.fixture
def patient_readiness(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prepare's look at the workers' readiness waits for their replies however late past its
    deadline (0.25 s and 0.5 s of grace in production: a loaded machine can hold the loop that long
    while a reply is on its way, and the worker is then counted unanswered). For the tests that check
    what the replies say, not when they come; the prepare still answers as soon as they came."""
    monkeypatch.setattr(worker_hub_module, "READINESS_GRACE_S", WAIT_S)
    monkeypatch.setattr(participant_module, "READINESS_GRACE_S", WAIT_S)


@pytest.mark.usefixtures("patient_readiness")
async def test_prepare_closes_every_worker_and_merges_their_readiness(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(participant_module, "READINESS_POLL_S", 60.0)  # only the workers' notes wake it
    first, second = server.workers
    first.adapter.set_busy(A, True)
    second.adapter.set_busy(B, True)
    reply = await participant(server).prepare(server.control(0.3))
    assert reply["phase"] == "preparing"
    assert sorted(reply["report"]["blockers"]) == ["a", "b"] and reply["report"]["counts"] == {"sessions": 2}
    assert [w.participant.checkpoint_id for w in server.workers] == ["c1", "c1"]  # the gate reached both
    waiting = asyncio.create_task(second.participant.admit(RolloutIdentity("c")))
    await asyncio.sleep(0.1)
    assert not waiting.done(), "a worker admitted a request while the checkpoint was open"
    pending = asyncio.create_task(participant(server).prepare(server.control(60)))
    await asyncio.sleep(0.1)  # the prepare looked: both still busy
    first.adapter.set_busy(A, False)
    second.adapter.set_busy(B, False)  # each worker tells the coordinator, which looks again
    reply = await asyncio.wait_for(pending, 10)
    assert reply["phase"] == "prepared" and reply["report"]["ready"] is True
    await participant(server).resume(server.control())
    await asyncio.wait_for(waiting, 5)
    assert [w.participant.checkpoint_id for w in server.workers] == [None, None]


@pytest.mark.usefixtures("patient_readiness")
async def test_a_missing_or_lost_worker_blocks_the_prepare(tmp_path: Path, short_dir: Path) -> None:
    server = await start_server(tmp_path, short_dir, workers=1)
    try:
        reply = await participant(server).prepare(server.control(0.2))
        assert reply["report"]["blockers"] == ["resources-workers-unregistered:1"]
        server.workers.append(await worker(server.path, tmp_path, 2000))
        reply = await participant(server).prepare(server.control())
        assert reply["phase"] == "prepared"
        await participant(server).resume(server.control())
        await participant(server).prepare(server.control(checkpoint_id="c2"))
        await server.workers[1].link.aclose()  # gone while c2 is open
        await asyncio.sleep(0.1)
        reply = await participant(server).prepare(server.control(0.2, checkpoint_id="c2"))
        assert reply["phase"] == "prepared"  # a prepare that succeeded is stored: the same reply
        await participant(server).resume(server.control(checkpoint_id="c2"))
        reply = await participant(server).prepare(server.control(0.2, checkpoint_id="c3"))
        assert reply["report"]["blockers"] == ["resources-workers-unregistered:1"]
    finally:
        for each in server.workers:
            await each.link.aclose()
        await server.hub.aclose()


async def test_a_worker_lost_while_open_blocks_until_the_checkpoint_closes(server: Server) -> None:
    pending = asyncio.create_task(participant(server).prepare(server.control(0.5)))
    server.workers[0].adapter.set_busy(A, True)
    await asyncio.sleep(0.1)
    await server.workers[1].link.aclose()
    reply = await pending
    assert "resources-worker-lost" in reply["report"]["blockers"], reply


async def raw_peer(path: Path, pid: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A registered 'worker' that answers nothing: the test writes what it sends."""
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(encode_frame({"id": 1, "kind": "register", "body": {"pid": pid}}))
    while "reply_to" not in (await asyncio.wait_for(read_frame(reader), 5) or {"reply_to": None}):
        pass
    return reader, writer


async def test_a_worker_stalled_inside_a_frame_is_dropped_as_lost(
    tmp_path: Path, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(frames_module, "FRAME_BODY_S", 0.3, raising=False)  # 30 s in production
    server = await start_server(tmp_path, short_dir, workers=1)
    _, writer = await raw_peer(server.path, 2000)
    try:
        writer.write(struct.pack(">I", 100) + b'{"reply_to"')  # a header for 100 bytes, 11 of them, then silence
        await asyncio.sleep(1.0)
        assert sorted(server.hub.workers) == [1000]
        assert server.hub.blockers() == ["resources-workers-unregistered:1"]
    finally:
        writer.close()
        await server.workers[0].link.aclose()
        await server.hub.aclose()


async def test_a_second_register_on_one_channel_is_refused(tmp_path: Path, short_dir: Path) -> None:
    server = await start_server(tmp_path, short_dir, workers=1)
    reader, writer = await raw_peer(server.path, 2000)
    try:
        writer.write(encode_frame({"id": 2, "kind": "register", "body": {"pid": 2001}}))
        reply = await asyncio.wait_for(read_frame(reader), 5)
        assert reply is not None and reply["ok"] is False and reply["error"]["code"] == "invalid_request"
        writer.close()  # the peer goes away: none of its entries stays
        await asyncio.sleep(0.2)
        assert sorted(server.hub.workers) == [1000]
    finally:
        await server.workers[0].link.aclose()
        await server.hub.aclose()


async def test_a_prepare_answers_by_its_deadline_while_a_worker_does_not(
    tmp_path: Path, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_hub_module, "CALL_TIMEOUT_S", 60.0)  # 30 s in production
    # The hub gives up on the silent worker 0.25 s past the deadline, the participant on the hub 0.5 s
    # past it: on a loaded machine the 0.25 s between them ran out, and the reply had no report yet.
    monkeypatch.setattr(participant_module, "READINESS_GRACE_S", 10.0)
    server = await start_server(tmp_path, short_dir, workers=1)
    _, writer = await raw_peer(server.path, 2000)  # registered, never answers its readiness
    try:
        async with asyncio.timeout(20):  # by its deadline (1 s, and 0.25 s of grace), not the call's timeout
            reply = await participant(server).prepare(server.control(1.0))
        assert reply["report"]["blockers"] == ["resources-workers-unanswered:1"]
    finally:
        writer.close()
        await server.workers[0].link.aclose()
        await server.hub.aclose()


@pytest.mark.parametrize(("operation", "bad"), [
    ("prepare", {"blockers": [], "counts": {"sessions": "many"}, "restarts": []}),
    ("prepare", {}),
    ("status", {"extras": {}}),
    ("commit", {"items": [], "done": "yes"}),
])
async def test_a_worker_reply_of_the_wrong_shape_is_a_structured_refusal(
    server: Server, tmp_path: Path, operation: str, bad: dict[str, object]
) -> None:
    second = server.workers[1].link.channel
    assert second is not None
    answer = second.on_call

    async def misbehaving(kind: str, body: dict[str, object]) -> dict[str, object]:
        late = {"prepare": "readiness", "status": "extras", "commit": "export"}[operation] == kind
        return bad if late else await answer(kind, body)

    second.on_call = misbehaving
    request: dict[str, object] | None = None if operation == "status" else {
        "checkpoint_id": "c1", "deadline_ts": server.deadline()}
    if operation == "commit":
        await server.workers[0].link.forward("prepare", request)
        request = {**(request or {}), "checkpoint_dir": str(tmp_path / "ck")}
    with pytest.raises(InvalidCheckpointState, match="reply has no usable"):
        await server.workers[0].link.forward(operation, request)  # run on the coordinator, answered here


async def commit(server: Server, checkpoint_id: str, directory: Path) -> dict[str, object]:
    control = participant(server)
    await control.prepare(server.control(checkpoint_id=checkpoint_id))
    reply = await control.commit(CommitRequest(checkpoint_id=checkpoint_id, deadline_ts=server.deadline(),
                                               checkpoint_dir=str(directory)))
    await control.resume(server.control(checkpoint_id=checkpoint_id))
    return reply


def records_in(directory: Path) -> list[dict[str, object]]:
    instance = directory / "gym" / KIND / NAME
    manifest = orjson.loads((instance / "manifest.json").read_bytes())
    lines = (instance / str(manifest["records_file"])).read_bytes().splitlines()
    assert manifest["record_count"] == len(lines)
    return [orjson.loads(line) for line in lines]


async def test_one_manifest_holds_every_workers_records_and_a_restore_is_claimed_once(
    tmp_path: Path, short_dir: Path
) -> None:
    server = await start_server(tmp_path, short_dir)
    try:
        server.workers[0].adapter.put(A, {"on": "first"})
        server.workers[1].adapter.put(B, {"on": "second"})
        directory = tmp_path / "ck1"
        reply = await commit(server, "c1", directory)
        assert sorted(reply["episode_ids"]) == ["a", "b"]  # type: ignore[arg-type]
        assert sorted(str(r["state"]) for r in records_in(directory)) == ["{'on': 'first'}", "{'on': 'second'}"]
        assert sorted(p.name for p in (directory / "gym" / KIND).iterdir()) == [NAME]
    finally:
        for each in server.workers:
            await each.link.aclose()
        await server.hub.aclose()

    fresh = await start_server(tmp_path, short_dir)
    try:
        control = participant(fresh)
        restored = await control.restore(RestoreRequest(checkpoint_id="r1", deadline_ts=fresh.deadline(),
                                                        checkpoint_dir=str(directory), episode_ids=[
                                                            {"rollout_id": "a"}, {"rollout_id": "b"}]))
        assert restored["restored"] == ["a-a1", "b-a1"]
        assert [sorted(w.adapter.sessions) for w in fresh.workers] == [["a-a1", "b-a1"]] * 2  # both hold both
        await control.resume(fresh.control(checkpoint_id="r1"))
        again = await commit(fresh, "c2", tmp_path / "ck2")  # restored, untouched: exported once each
        assert sorted(again["episode_ids"]) == ["a", "b"]  # type: ignore[arg-type]
        assert len(records_in(tmp_path / "ck2")) == 2
        await fresh.workers[1].participant.admit(A.next_attempt())  # the N+1 request lands on the second
        assert sorted(fresh.workers[0].adapter.sessions) == ["b-a1"]  # the first dropped its copy of a
        assert sorted(fresh.workers[1].adapter.sessions) == ["a-a1", "b-a1"]
        await fresh.workers[0].participant.admit(A.next_attempt())  # claimed already: nothing more moves
        assert sorted(fresh.workers[1].adapter.sessions) == ["a-a1", "b-a1"]
        status = await fresh.hub._status(control)
        assert status["extras"]["restored_unclaimed"] == 1 and status["extras"]["sessions"] == 3
    finally:
        for each in fresh.workers:
            await each.link.aclose()
        await fresh.hub.aclose()


async def test_a_worker_lost_after_answering_the_commits_readiness_fails_the_commit(
    server: Server, tmp_path: Path
) -> None:
    first, second = server.workers
    first.adapter.put(A, {"on": "first"})
    second.adapter.put(B, {"on": "second"})
    assert second.link.channel is not None
    channel, looks = second.link.channel, []
    answer = channel.on_call

    async def dies_after_readiness(kind: str, body: dict[str, object]) -> dict[str, object]:
        reply = await answer(kind, body)
        if kind == "readiness":
            looks.append(kind)
            if len(looks) == 2:  # the commit's own look: answered "ready", then the worker is gone
                asyncio.get_running_loop().call_soon(channel.close)
        return reply

    channel.on_call = dies_after_readiness
    control = participant(server)
    await control.prepare(server.control())
    with pytest.raises(InvalidPhase, match=r"resources-worker-lost|lost worker 1001"):
        await control.commit(CommitRequest(checkpoint_id="c1", deadline_ts=server.deadline(),
                                           checkpoint_dir=str(tmp_path / "ck")))
    assert looks == ["readiness", "readiness"]
    assert not (tmp_path / "ck" / "gym" / KIND / NAME / "manifest.json").exists()  # no manifest without b


async def test_a_claim_whose_drop_failed_is_asked_again(tmp_path: Path, short_dir: Path) -> None:
    server = await start_server(tmp_path, short_dir)
    server.workers[0].adapter.put(A, {"n": 1})
    await commit(server, "c1", tmp_path / "ck")
    for each in server.workers:
        await each.link.aclose()
    await server.hub.aclose()
    fresh = await start_server(tmp_path, short_dir)
    try:
        await participant(fresh).restore(RestoreRequest(checkpoint_id="r1", deadline_ts=fresh.deadline(),
                                                        checkpoint_dir=str(tmp_path / "ck"),
                                                        episode_ids=[{"rollout_id": "a"}]))
        await participant(fresh).resume(fresh.control(checkpoint_id="r1"))
        holder, claimer = fresh.workers
        forget, failures = holder.adapter.forget, [Unavailable("could not free the session right now")]

        async def fails_once(rollout_ids: list[str]) -> None:
            if failures:
                raise failures.pop()
            await forget(rollout_ids)

        holder.adapter.forget = fails_once  # type: ignore[method-assign]
        with pytest.raises(Unavailable):
            await claimer.participant.admit(A.next_attempt())
        await claimer.participant.admit(A.next_attempt())  # the client's retry: the drop is asked again
        assert (holder.adapter.sessions, sorted(claimer.adapter.sessions)) == ({}, ["a-a1"])
    finally:
        for each in fresh.workers:
            await each.link.aclose()
        await fresh.hub.aclose()


async def test_every_worker_starts_its_export_before_the_pages_are_read_in_turn(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(follower_module, "PAGE_BYTES", 1024)  # several pages per worker
    calls: list[tuple[int, bool]] = []
    real_page = WorkerLink._export_page

    async def logged(self: WorkerLink, body: dict[str, object]) -> dict[str, object]:
        calls.append((self.pid, bool(body.get("first"))))
        return await real_page(self, body)

    monkeypatch.setattr(WorkerLink, "_export_page", logged)
    for number, each in enumerate(server.workers):
        for n in range(20):
            each.adapter.put(RolloutIdentity(f"w{number}-r{n}"), {"text": "x" * 200})
    directory = tmp_path / "ck"
    reply = await commit(server, "c1", directory)
    first, second = (each.link.pid for each in server.workers)
    assert calls.index((second, True)) < calls.index((first, False))  # the second began before page 2 of the first
    assert len(reply["episode_ids"]) == 40 and len(records_in(directory)) == 40  # type: ignore[arg-type]
    assert calls.count((first, True)) == calls.count((second, True)) == 1


async def committed_with(
    tmp_path: Path, short_dir: Path, records: int, size: int
) -> tuple[Path, list[dict[str, str]]]:
    """A checkpoint of a 2-worker server holding ``records`` records of about ``size`` bytes each."""
    server = await start_server(tmp_path, short_dir)
    try:
        for n in range(records):
            server.workers[n % 2].adapter.put(RolloutIdentity(f"r{n}"), {"text": "x" * size})
        await commit(server, "c1", tmp_path / "ck")
    finally:
        for each in server.workers:
            await each.link.aclose()
        await server.hub.aclose()
    return tmp_path / "ck", [{"rollout_id": f"r{n}"} for n in range(records)]


def bound_frames(server: Server, max_bytes: int) -> None:
    """Every channel between ``server``'s coordinator and its workers bounds its frames at ``max_bytes``."""
    for each in [*server.hub.workers.values(), *(w.link for w in server.workers)]:
        assert each.channel is not None
        each.channel.max_frame_bytes = max_bytes


async def test_a_restore_over_one_frame_reaches_every_worker_in_pages(
    tmp_path: Path, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, episodes = await committed_with(tmp_path, short_dir, 40, 600)  # about 27 KB of records
    monkeypatch.setattr(worker_hub_module, "PAGE_BYTES", 4096)  # 4 MiB in production
    pages: list[tuple[int, object]] = []
    real_install = WorkerLink._install

    async def logged(self: WorkerLink, body: dict[str, object]) -> dict[str, object]:
        pages.append((self.pid, body.get("page")))
        return await real_install(self, body)

    monkeypatch.setattr(WorkerLink, "_install", logged)
    fresh = await start_server(tmp_path, short_dir)
    bound_frames(fresh, 16 * 1024)  # 256 MiB in production: the records are over one frame
    try:
        restored = await participant(fresh).restore(RestoreRequest(
            checkpoint_id="r1", deadline_ts=fresh.deadline(), checkpoint_dir=str(directory), episode_ids=episodes))
        assert len(restored["restored"]) == 40
        assert [len(w.adapter.sessions) for w in fresh.workers] == [40, 40]
        first = [page for pid, page in pages if pid == fresh.workers[0].link.pid]
        assert first == list(range(len(first))) and len(first) > 4  # every page, in turn
    finally:
        for each in fresh.workers:
            await each.link.aclose()
        await fresh.hub.aclose()


async def test_a_worker_lost_mid_restore_fails_it_and_leaves_the_others_fresh(
    tmp_path: Path, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, episodes = await committed_with(tmp_path, short_dir, 20, 600)
    monkeypatch.setattr(worker_hub_module, "PAGE_BYTES", 4096)
    fresh = await start_server(tmp_path, short_dir)
    kept, lost = fresh.workers
    assert lost.link.channel is not None
    channel, answer = lost.link.channel, lost.link.channel.on_call

    async def dies_on_page_2(kind: str, body: dict[str, object]) -> dict[str, object]:
        if kind == "install" and body.get("page") == 2:
            channel.close()
        return await answer(kind, body)

    channel.on_call = dies_on_page_2
    try:
        with pytest.raises(InvalidPhase, match="restore lost worker 1001 during its install"):
            await participant(fresh).restore(RestoreRequest(
                checkpoint_id="r1", deadline_ts=fresh.deadline(), checkpoint_dir=str(directory), episode_ids=episodes))
        await asyncio.sleep(0.1)  # the abort note reaches the worker kept
        assert kept.adapter.sessions == {} and kept.participant.fresh and kept.link._receiving is None
        with pytest.raises(InvalidCheckpointState, match="out of turn"):  # a page with no install begun
            await kept.link._install({"page": 3, "records": [], "done": True})
        await participant(fresh).resume(fresh.control(checkpoint_id="r1"))
        fresh.workers[1] = await worker(fresh.path, tmp_path, 2000)  # a new worker: the restore runs again
        restored = await participant(fresh).restore(RestoreRequest(
            checkpoint_id="r2", deadline_ts=fresh.deadline(), checkpoint_dir=str(directory), episode_ids=episodes))
        assert len(restored["restored"]) == 20 and [len(w.adapter.sessions) for w in fresh.workers] == [20, 20]
    finally:
        for each in [*fresh.workers, lost]:
            await each.link.aclose()
        await fresh.hub.aclose()


async def test_retire_and_forget_reach_every_worker(server: Server) -> None:
    for each in server.workers:
        each.adapter.put(A, {})
    control = participant(server)
    await control.retire(RetireRequest(checkpoint_id="x1", deadline_ts=server.deadline(),
                                       episode_ids=[{"rollout_id": "a"}]))
    assert [each.adapter.sessions for each in server.workers] == [{}, {}]
    for each in server.workers:
        with pytest.raises(StaleAttempt):
            await each.participant.admit(A)
    await control.forget(ForgetRequest(checkpoint_id="x2", deadline_ts=server.deadline(), rollout_ids=["a"]))
    for each in server.workers:
        await asyncio.wait_for(each.participant.admit(A), 5)


async def test_a_close_that_finds_nothing_has_the_other_workers_drop_the_rollout(server: Server) -> None:
    first, second = server.workers
    first.adapter.put(A, {"seeded": "here"})
    second.adapter.put(B, {})
    await second.participant.close_elsewhere(A)  # the close of a landed on the second worker
    assert (first.adapter.sessions, sorted(second.adapter.sessions)) == ({}, ["b"])
    await server.hub.aclose()
    await asyncio.sleep(0.05)
    with pytest.raises(CoordinatorUnavailable):
        await second.participant.close_elsewhere(B)  # no coordinator: 503, never a silent leak


async def test_control_calls_on_a_worker_run_on_the_coordinator(server: Server) -> None:
    reply = await server.workers[0].link.forward("prepare", {"checkpoint_id": "c1", "deadline_ts": server.deadline()})
    assert reply["phase"] == "prepared"
    status = await server.workers[1].link.forward("status", None)
    assert (status["phase"], status["checkpoint_id"], status["extras"]["workers"]) == ("prepared", "c1", 2)


def test_a_resources_server_that_keeps_sessions_refuses_several_workers(tmp_path: Path) -> None:
    block = {"enabled": True, "control_auth_token": TOKEN, "root": str(tmp_path)}
    for implementation, workers in (("kv_store", 2), ("kv_store", 1), ("calculator_tools", 2)):
        mesh = mesh_with(implementation, NAME, block, {"num_workers": workers})
        server = SERVERS[implementation](ServerContext(NAME, mesh.instance(NAME).settings, mesh))
        if implementation == "kv_store" and workers > 1:
            with pytest.raises(ConfigError, match="needs a stateless resources server; KvStore is exported"):
                server.build_app()
        else:
            assert server.build_app() is not None


# ---- no coordinator ------------------------------------------------------------------------------


def worker_app(link: WorkerLink, participant: FollowerParticipant) -> FastAPI:
    app = create_app("res")
    app.include_router(make_router(participant, TOKEN, link.forward))
    return app


async def test_a_worker_without_its_coordinator_answers_503_and_shuts_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(follower_module, "CONNECT_S", 0.3)
    adapter = SessionsAdapter()
    alone = FollowerParticipant(kind=KIND, instance=NAME, adapter=adapter, store=CheckpointStore(tmp_path),
                                lease_grace_s=600)
    lost: list[str] = []
    link = WorkerLink(alone, adapter, tmp_path / "nobody.sock", lambda: lost.append("lost"), pid=7)
    link.start()
    transport = httpx.ASGITransport(app=worker_app(link, alone))
    async with httpx.AsyncClient(transport=transport, base_url="http://w") as client:
        reply = await client.post("/ng-control/v1/checkpoint/prepare", headers={"authorization": f"Bearer {TOKEN}"},
                                  json={"checkpoint_id": "c1", "deadline_ts": time.time() + 10})
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == "checkpoint_coordinator_unavailable"
    with pytest.raises(CoordinatorUnavailable):
        await alone.admit(A)
    assert lost == ["lost"]
    await link.aclose()


async def test_a_worker_exits_when_its_coordinator_is_gone(server: Server) -> None:
    await server.hub.aclose()
    await asyncio.sleep(0.1)
    assert [each.lost for each in server.workers] == [[1000], [1001]]
    with pytest.raises(CoordinatorUnavailable, match="lost its coordinator"):
        await server.workers[0].link.forward("status", None)


async def test_requests_parked_on_a_worker_are_refused_when_its_coordinator_is_gone(server: Server) -> None:
    await participant(server).prepare(server.control())  # the gate closes on both workers
    parked = asyncio.create_task(server.workers[0].participant.admit(A))
    await asyncio.sleep(0.1)
    assert not parked.done()
    await server.hub.aclose()
    with pytest.raises(CoordinatorUnavailable, match="lost its coordinator"):
        await asyncio.wait_for(parked, 2)  # not left to wait for the dead coordinator's lease
    assert server.workers[0].lost == [1000]


def test_a_runtime_dir_is_private_and_the_dirs_of_dead_owners_are_swept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead_pid = subprocess.Popen(["true"])
    dead_pid.wait()
    stale, live = tmp_path / f"{RUNTIME_PREFIX}stale", tmp_path / f"{RUNTIME_PREFIX}live"
    for directory, pid in ((stale, dead_pid.pid), (live, os.getpid())):
        directory.mkdir()
        (directory / "owner.pid").write_text(str(pid))
    made = runtime_dir()
    assert (made.stat().st_mode & 0o777) == 0o700 and (made / "owner.pid").read_text() == str(os.getpid())
    assert not stale.exists() and live.exists()
