"""The participant shell around a resources server that is not ours, in process on a fake clock.

The inner app implements NeMo Gym's resources-server interface as its base class serves it (seed
with either body and ``{}`` / ``resources_session_id`` replies, a close that needs
``{resources_session_id, episode_id}``, a verify validated by pydantic with FastAPI's 422, one tool
route, NeMo Gym's own ``/health``), plus a gate so that a test holds a verify or a tool call in
flight. NeMo Gym's real servers run inside the shell in the e2e tests (``tests/e2e/test_verifiers.py``).

Checked: the conformance suite; the declaration headers, the cookie and the membership the shell
exports under NeMo Gym's session id; replay verifies never block a prepare, wait verifies and tool
calls do; seed, tool and verify calls wait while a checkpoint is open (GETs never); a restart-only
declaration never closes admission; a cookie of another attempt is
``stale_attempt``; the server's errors in our shape (its 408 and 429 as ours, ``Retry-After`` kept);
retire frees a session only after its request in flight ended; checkpointing off mounts nothing and
admits everything; an exported declaration is refused; the server's lifespan runs inside the shell's.
Bodies: read before admission, so a client stalled mid-body is never in flight, never holds a
prepare, and gets 408 after ``BODY_PART_TIMEOUT_S`` (a body cut by its client leaving never reaches
the server); a ``Content-Length`` over ``max_body_bytes`` is 413 before anything is read; a body
the mesh cannot read or write again (nesting, a lone surrogate, ``NaN``) is 400 and never reaches
the server, while an empty body, a form, a byte order mark or UTF-16 JSON reach it as they came.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http.cookiejar import CookieJar, DefaultCookiePolicy
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel, ConfigDict
from starlette.types import ASGIApp, Message

from nemo_gym_ckpt import server
from nemo_gym_ckpt.config import CheckpointConfig
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.resources.shell import Declaration, ResourcesShell
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.conformance import CHECKS, Control, ParticipantUnderTest, check_participant
from tests.unit.checkpoint.conftest import GRACE_S, TOKEN, until

pytestmark = pytest.mark.unit

NAME = "ng_verifier"
WAIT_S = 10.0
STATELESS_REPLAY = Declaration("stateless", "replay")
RESPONSE = {"id": "resp_1", "object": "response", "output": [
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "\\boxed{4}"}]}]}


# ---- a server shaped like NeMo Gym's base resources server -------------------------------------


class EpisodeId(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rollout_id: str
    attempt: int


class CloseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    resources_session_id: str
    episode_id: EpisodeId


class VerifyBody(BaseModel):
    responses_create_params: dict[str, Any]
    response: dict[str, Any]
    expected_answer: str


@dataclass
class Inner:
    """The app and its gates (``hold`` in a row: verify or tool calls wait until released)."""

    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    waiting: list[str] = field(default_factory=list)
    lifespan: list[str] = field(default_factory=list)
    raw_bodies: list[bytes] = field(default_factory=list)

    async def gate(self, what: str, row: dict[str, Any]) -> None:
        key = row.get("hold")
        if key:
            self.waiting.append(f"{what}:{key}")
            await self.gates.setdefault(key, asyncio.Event()).wait()
            self.waiting.remove(f"{what}:{key}")

    def app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            self.lifespan.append("started")
            yield
            self.lifespan.append("stopped")

        app = FastAPI(lifespan=lifespan)

        @app.post("/seed_session")
        async def seed(request: Request) -> dict[str, Any]:
            body = await request.json()
            if isinstance(body, dict) and "resources_session_id" in body:
                return {"resources_session_id": body["resources_session_id"], "resources_tools": None}
            return {}

        @app.post("/close_session")
        async def close(body: CloseBody) -> dict[str, Any]:
            return {"resources_session_id": body.resources_session_id}

        @app.post("/verify")
        async def verify(body: VerifyBody, request: Request) -> dict[str, Any]:
            row = await request.json()
            await self.gate("verify", row)
            if body.expected_answer == "conflict":
                raise HTTPException(status_code=409, detail="cohort already evaluating")
            if body.expected_answer == "unavailable":
                raise HTTPException(status_code=503, detail="cohort did not collect")
            if body.expected_answer.startswith("busy-"):  # busy-<its Retry-After>
                retry_after = body.expected_answer.removeprefix("busy-")
                raise HTTPException(status_code=429, detail="judge busy", headers={"Retry-After": retry_after})
            if body.expected_answer == "slow":
                raise HTTPException(status_code=408, detail="its own body deadline")
            text = body.response["output"][0]["content"][0]["text"]
            return {**row, "reward": 1.0 if body.expected_answer in text else 0.0}

        @app.post("/compare")
        async def compare(request: Request) -> dict[str, Any]:
            row = await request.json()
            await self.gate("tool", row)
            return {"rewards": [3.0, 3.0]}

        @app.post("/raw")
        async def raw(request: Request) -> dict[str, Any]:
            body = await request.body()
            self.raw_bodies.append(body)
            return {"bytes": len(body)}

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        return app


# ---- harness ---------------------------------------------------------------------------------


@dataclass
class Running:
    shell: ResourcesShell
    inner: Inner
    client: httpx.AsyncClient
    control: Control
    app: ASGIApp

    async def seed(self, key: str, body: dict[str, Any] | None = None) -> httpx.Response:
        reply = await self.client.post(f"/ng-rollout/{key}/seed_session", json=body or {"task": key})
        assert reply.status_code == 200, reply.text
        return reply

    def cookie(self, reply: httpx.Response) -> dict[str, str]:
        return {"cookie": f"{self.shell.cookie_name}={reply.cookies[self.shell.cookie_name]}"}

    def verify(self, key: str, cookie: dict[str, str] | None = None, **row: Any) -> Any:
        body = {"responses_create_params": {"input": "2+2?"}, "response": RESPONSE, "expected_answer": "4", **row}
        return self.client.post(f"/ng-rollout/{key}/verify", json=body, headers=cookie)

    async def release(self, key: str) -> None:
        self.inner.gates.setdefault(key, asyncio.Event()).set()


@asynccontextmanager
async def running(root: Path, clock: FakeClock, declaration: Declaration = STATELESS_REPLAY, *, enabled: bool = True,
                  max_body_bytes: int | None = None) -> AsyncIterator[Running]:
    inner = Inner()
    shell = ResourcesShell(inner.app(), NAME, declaration)
    checkpoint = CheckpointConfig(enabled=True, control_auth_token=TOKEN, root=root, lease_grace_seconds=GRACE_S)
    limit = {} if max_body_bytes is None else {"max_body_bytes": max_body_bytes}
    app = shell.build_app(checkpoint if enabled else None, clock=clock, **limit)
    jar = CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))  # cookies are passed explicitly, as agents do
    async with shell_lifespan(app), httpx.AsyncClient(
        transport=httpx.ASGITransport(app), base_url="http://ng", cookies=jar
    ) as client:
        pt = ParticipantUnderTest(client, TOKEN, root, now=clock.now, advance_clock=clock.advance)
        yield Running(shell, inner, client, Control(pt), app)
    assert inner.lifespan == ["started", "stopped"]


@asynccontextmanager
async def shell_lifespan(app: Any) -> AsyncIterator[None]:
    """Drive the shell's ASGI lifespan as uvicorn does."""
    from nemo_gym_ckpt.resources.shell import asgi_lifespan

    async with asgi_lifespan(app):
        yield


class ShellHooks:
    """The conformance suite's data plane on the shell: seeds, and a held tool call."""

    def __init__(self, on: Running) -> None:
        self.on = on
        self.pending: dict[str, asyncio.Task[httpx.Response]] = {}

    async def request(self, client: httpx.AsyncClient, episode: RolloutIdentity, payload: dict[str, Any]) -> Any:
        return await client.post(f"/ng-rollout/{episode.capture_key}/seed_session", json=payload)

    async def block(self, client: httpx.AsyncClient, episode: RolloutIdentity, blocked: bool) -> None:
        key = episode.capture_key
        if blocked:
            self.pending[key] = asyncio.create_task(client.post(f"/ng-rollout/{key}/compare", json={"hold": key}))
            await until(lambda: f"tool:{key}" in self.on.inner.waiting)
            return
        await self.on.release(key)
        assert (await asyncio.wait_for(self.pending.pop(key), WAIT_S)).status_code == 200


class StalledClient:
    """A POST driven message by message: the first part of its body, then nothing until ``hang_up``."""

    def __init__(self, app: ASGIApp, path: str, first_part: bytes = b'{"hold": ',
                 headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        self.sent: list[Message] = []
        self.asked_for_more = asyncio.Event()
        self.gone = asyncio.Event()
        self._first: bytes | None = first_part
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"host", b"ng"), (b"content-type", b"application/json"), *headers],
                 "client": ("127.0.0.1", 40000), "server": ("ng", 80)}
        self.call = asyncio.ensure_future(app(scope, self._receive, self._send))

    async def _receive(self) -> Message:
        if self._first is not None:
            first, self._first = self._first, None
            return {"type": "http.request", "body": first, "more_body": True}
        self.asked_for_more.set()
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: Message) -> None:
        self.sent.append(message)

    async def hang_up(self) -> None:
        self.gone.set()
        await asyncio.wait_for(self.call, WAIT_S)

    async def reply(self) -> tuple[int, dict[str, Any]]:
        """The status and body the shell answered (waited for, up to ``WAIT_S``)."""
        await asyncio.wait_for(self.call, WAIT_S)
        status = next(message["status"] for message in self.sent if message["type"] == "http.response.start")
        body = b"".join(message.get("body", b"") for message in self.sent if message["type"] == "http.response.body")
        return status, orjson.loads(body)


def records(root: Path, directory: str, committed: dict[str, Any]) -> list[dict[str, Any]]:
    where = root / directory / "gym" / "resources" / NAME / committed["manifest"]["records_file"]
    return [orjson.loads(line) for line in where.read_bytes().splitlines()]


# ---- tests -----------------------------------------------------------------------------------


async def test_the_shell_passes_the_conformance_suite(root: Path, clock: FakeClock) -> None:
    @asynccontextmanager
    async def make() -> AsyncIterator[ParticipantUnderTest]:
        async with running(root, clock) as on:
            yield ParticipantUnderTest(on.client, TOKEN, root, now=clock.now, advance_clock=clock.advance,
                                       data=ShellHooks(on))

    assert await check_participant(make) == {name: "passed" for name in CHECKS}


async def test_seed_replies_declare_and_membership_is_exported_under_gyms_session_id(
    root: Path, clock: FakeClock
) -> None:
    async with running(root, clock) as on:
        gym_seed = {"resources_session_id": "sess-1", "episode_id": {"rollout_id": "r1", "attempt": 0},
                    "task_id": {"taskset": "t", "task_id": "0"}, "task_data": {}}
        reply = await on.seed("r1", gym_seed)
        assert reply.json() == {"resources_session_id": "sess-1", "resources_tools": None}  # the server's own
        assert reply.headers["x-ng-checkpoint-verify"] == "replay" and "x-ng-checkpoint-restart" not in reply.headers
        assert reply.cookies[on.shell.cookie_name] == "sess-1"
        legacy = await on.seed("r2-a1")
        assert legacy.json() == {} and len(legacy.cookies[on.shell.cookie_name]) == 32
        # each record made at its seed, on the data plane, so no commit builds it inside its pause
        legacy_id = legacy.cookies[on.shell.cookie_name].encode()
        assert {session.encoded.raw for session in on.shell.sessions if session.encoded} == {
            b'{"episode_id":{"rollout_id":"r1","attempt":0},"session_id":"sess-1"}',
            b'{"episode_id":{"rollout_id":"r2","attempt":1},"session_id":"%s"}' % legacy_id}
        await on.control.ok("prepare", checkpoint_id="c1")
        committed = await on.control.ok("commit", checkpoint_id="c1", checkpoint_dir=str(root / "ck"))
        await on.control.ok("resume", checkpoint_id="c1")
        exported = sorted(records(root, "ck", committed), key=lambda record: record["session_id"])
        assert exported[-1] == {"episode_id": {"rollout_id": "r1", "attempt": 0}, "session_id": "sess-1"}
        assert [record["episode_id"] for record in exported[:1]] == [{"rollout_id": "r2", "attempt": 1}]
        closed = await on.client.post("/ng-rollout/r1/close_session", headers=on.cookie(reply),
                                      json={"resources_session_id": "sess-1", "episode_id": gym_seed["episode_id"]})
        assert closed.status_code == 200 and "sess-1" not in on.shell.sessions
        verified = await on.verify("r2-a1", on.cookie(legacy))
        assert verified.json()["reward"] == 1.0 and len(on.shell.sessions) == 0  # a verify ends it too


async def test_a_replay_verify_in_flight_never_blocks_a_prepare(root: Path, clock: FakeClock) -> None:
    async with running(root, clock) as on:
        await on.seed("r1")
        verify = asyncio.create_task(on.verify("r1", hold="r1"))
        await until(lambda: "verify:r1" in on.inner.waiting)
        prepared = await asyncio.wait_for(on.control.ok("prepare", checkpoint_id="c1"), WAIT_S)
        assert prepared["report"]["ready"] is True and prepared["report"]["counts"]["in_flight"] == 1
        await on.control.ok("resume", checkpoint_id="c1")
        await on.release("r1")
        assert (await asyncio.wait_for(verify, WAIT_S)).json()["reward"] == 1.0


async def test_a_wait_verify_and_a_tool_call_block_a_prepare(root: Path, clock: FakeClock) -> None:
    async with running(root, clock, Declaration("stateless", "wait")) as on:
        verify = asyncio.create_task(on.verify("r1", hold="r1"))
        tool = asyncio.create_task(on.client.post("/ng-rollout/r2/compare", json={"hold": "r2"}))
        await until(lambda: {"verify:r1", "tool:r2"} <= set(on.inner.waiting))
        deadline = clock.now() + 1
        prepare = asyncio.create_task(on.control.ok("prepare", checkpoint_id="c1", deadline_ts=deadline))
        await until(lambda: on.shell.checkpoint is not None and on.shell.checkpoint._participant().status()["report"])
        clock.advance(2)
        reply = await asyncio.wait_for(prepare, WAIT_S)
        assert reply["phase"] == "preparing" and reply["report"]["blockers"] == ["r1", "r2"]
        await on.control.ok("resume", checkpoint_id="c1")
        await on.release("r1")
        await on.release("r2")
        assert [(await asyncio.wait_for(call, WAIT_S)).status_code for call in (verify, tool)] == [200, 200]


async def test_a_restart_only_server_never_closes_admission(root: Path, clock: FakeClock) -> None:
    async with running(root, clock, Declaration("restart_only", "wait")) as on:
        await on.control.ok("prepare", checkpoint_id="c1")
        reply = await asyncio.wait_for(on.seed("r1"), WAIT_S)
        assert reply.headers["x-ng-checkpoint-restart"] == "1"
        assert (await asyncio.wait_for(on.verify("r1", on.cookie(reply)), WAIT_S)).json()["reward"] == 1.0
        assert (await on.control.status())["waiting_requests"] == 0


async def test_requests_wait_while_a_checkpoint_is_open(root: Path, clock: FakeClock) -> None:
    async with running(root, clock) as on:
        await on.control.ok("prepare", checkpoint_id="c1")
        assert (await asyncio.wait_for(on.client.get("/ng-rollout/r1/openapi.json"), WAIT_S)).status_code == 200
        seed = asyncio.create_task(on.client.post("/ng-rollout/r1/seed_session", json={}))
        tool = asyncio.create_task(on.client.post("/ng-rollout/r1/compare", json={}))
        verify = asyncio.create_task(on.verify("r2"))
        await until(lambda: on.shell.checkpoint is not None
                    and on.shell.checkpoint._participant().status()["waiting_requests"] == 3)
        assert not (seed.done() or tool.done() or verify.done())
        await on.control.ok("resume", checkpoint_id="c1")
        calls = (seed, tool, verify)
        assert [(await asyncio.wait_for(call, WAIT_S)).status_code for call in calls] == [200, 200, 200]

        unscoped = await on.client.post("/seed_session", json={})
        assert (unscoped.status_code, unscoped.json()["error"]["code"]) == (400, "rollout_id_required")


async def test_a_cookie_of_another_attempt_is_a_stale_attempt(root: Path, clock: FakeClock) -> None:
    async with running(root, clock) as on:
        cookie = on.cookie(await on.seed("r1"))
        stale = await on.verify("r1-a1", cookie)
        assert (stale.status_code, stale.json()["error"]["code"]) == (409, "stale_attempt")
        await on.control.ok("retire", checkpoint_id="h1", episode_ids=[{"rollout_id": "r1", "attempt": 0}])
        fenced = await on.verify("r1", cookie)
        assert (fenced.status_code, fenced.json()["error"]["code"]) == (409, "stale_attempt")


async def test_the_servers_errors_come_in_our_shape(root: Path, clock: FakeClock) -> None:
    async with running(root, clock) as on:
        cases = [
            (await on.client.post("/ng-rollout/r1/verify", content=b"{not json"), 400, "invalid_request"),
            (await on.client.post("/ng-rollout/r1/verify", json={"response": 3}), 400, "invalid_request"),
            (await on.client.post("/ng-rollout/r1/close_session", json={}), 400, "invalid_request"),
            (await on.client.post("/ng-rollout/r1/nothing", json={}), 404, "not_found"),
            (await on.client.get("/ng-rollout/r1/verify"), 405, "method_not_allowed"),
            (await on.verify("r1", expected_answer="conflict"), 409, "request_conflict"),
            (await on.verify("r1", expected_answer="unavailable"), 503, "unavailable"),
            (await on.client.post("/ng-rollout//verify", json={}), 400, "invalid_request"),
            (await on.verify("r1", expected_answer="busy-7"), 429, "capacity_exceeded"),
            (await on.verify("r1", expected_answer="busy-3600"), 429, "capacity_exceeded"),
            (await on.verify("r1", expected_answer="busy-soon"), 429, "capacity_exceeded"),
            (await on.verify("r1", expected_answer="busy-Fri, 31 Dec 9999 23:59:59 GMT"), 429, "capacity_exceeded"),
            (await on.verify("r1", expected_answer="slow"), 408, "request_timeout"),
        ]
        for reply, status, code in cases:
            assert (reply.status_code, reply.json()["error"]["code"]) == (status, code), reply.text
        assert "response" in cases[1][0].json()["error"]["detail"]
        assert "cohort did not collect" in cases[6][0].json()["error"]["detail"]
        # a 429's Retry-After passed on, within the protocol's 1 to 60 s (one that is no number: 1 s; an
        # HTTP date read as the seconds until it)
        assert [reply.headers.get("retry-after") for reply, _, _ in cases[8:12]] == ["7", "60", "1", "60"]


async def test_a_client_stalled_mid_body_holds_no_prepare_and_gets_a_408(
        root: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    async with running(root, clock, Declaration("stateless", "wait")) as on:
        stalled = StalledClient(on.app, "/ng-rollout/r1/raw", first_part=b"{}")
        await asyncio.wait_for(stalled.asked_for_more.wait(), WAIT_S)
        # its body is read before admission: not in flight, so nothing blocks the prepare
        try:
            prepared = await asyncio.wait_for(on.control.ok("prepare", checkpoint_id="c1"), WAIT_S)
        except TimeoutError:
            raise AssertionError("the prepare waited on a request whose body never came") from None
        assert prepared["report"]["ready"] is True
        assert prepared["report"]["counts"] == {"sessions": 0, "in_flight": 0, "blocking": 0}
        await on.control.ok("resume", checkpoint_id="c1")
        await stalled.hang_up()
        assert on.inner.raw_bodies == []  # a body cut by its client's leaving never reaches the server

        monkeypatch.setattr(server, "BODY_PART_TIMEOUT_S", 0.05)
        status, body = await StalledClient(on.app, "/ng-rollout/r2/compare").reply()
        assert (status, body["error"]["code"]) == (408, "request_timeout"), body
        assert "0.05 s" in body["error"]["detail"]


async def test_a_declared_length_over_the_limit_is_a_413_before_anything_is_read(
        root: Path, clock: FakeClock) -> None:
    async with running(root, clock) as on:
        length = str(server.DEFAULT_MAX_BODY_BYTES + 1).encode()
        declared = StalledClient(on.app, "/ng-rollout/r1/raw", headers=((b"content-length", length),))
        try:
            status, body = await declared.reply()
        except TimeoutError:
            raise AssertionError("the shell waited for a body its Content-Length refuses") from None
        assert (status, body["error"]["code"]) == (413, "payload_too_large"), body
        assert not declared.asked_for_more.is_set() and on.inner.raw_bodies == []


async def test_the_body_limit_is_the_one_the_shell_is_built_with(root: Path, clock: FakeClock) -> None:
    async with running(root, clock, max_body_bytes=4096) as on:
        sent = await on.client.post("/ng-rollout/r1/raw", content=b'{"pad": "%s"}' % (b"x" * 5000),
                                    headers={"content-type": "application/json", "transfer-encoding": "chunked"})
        assert (sent.status_code, sent.json()["error"]["code"]) == (413, "payload_too_large"), sent.text
        fits = await on.client.post("/ng-rollout/r1/raw", json={"pad": "x" * 3000})
        assert fits.json() == {"bytes": len(fits.request.content)} and len(on.inner.raw_bodies) == 1


UNREADABLE = {
    "nested 5,000 deep": b'{"a":' * 5000 + b"1" + b"}" * 5000,
    "nested 300 deep": b'{"a": ' + b"[" * 300 + b"]" * 300 + b"}",
    "a lone surrogate escaped": b'{"expected_answer": "\\ud800"}',
    "a lone surrogate in UTF-8": b'{"expected_answer": "\xed\xa0\x80"}',
    "NaN": b'{"score": NaN}',
    "not JSON": b"{nope",
    "only spaces": b"   ",
}


@pytest.mark.parametrize("case", sorted(UNREADABLE))
async def test_a_body_the_mesh_cannot_read_or_write_again_is_a_400_the_server_never_sees(
        root: Path, clock: FakeClock, case: str) -> None:
    async with running(root, clock) as on:
        reply = await on.client.post("/ng-rollout/r1/raw", content=UNREADABLE[case],
                                     headers={"content-type": "application/json"})
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_request", reply.text
        assert on.inner.raw_bodies == []


async def test_bodies_a_server_reads_otherwise_reach_it_as_they_came(root: Path, clock: FakeClock) -> None:
    passing = [
        (b"", "application/json"),
        (b"a=1&b=%7B", "application/x-www-form-urlencoded"),
        (b"\xef\xbb\xbf" + b'{"a": 1}', "application/json"),  # a UTF-8 byte order mark
        ('{"a": "\u00e9"}'.encode("utf-16"), "application/json"),
        (b'{"big": 123456789012345678901234567890}', "application/json"),  # NeMo Gym reads it exactly
    ]
    async with running(root, clock) as on:
        for content, content_type in passing:
            reply = await on.client.post("/ng-rollout/r1/raw", content=content, headers={"content-type": content_type})
            assert reply.json() == {"bytes": len(content)}, (content, reply.text)
        assert on.inner.raw_bodies == [content for content, _ in passing]


async def test_retire_frees_a_session_only_after_its_request_in_flight_ended(root: Path, clock: FakeClock) -> None:
    async with running(root, clock) as on:
        cookie = on.cookie(await on.seed("r1"))
        tool = asyncio.create_task(on.client.post("/ng-rollout/r1/compare", json={"hold": "r1"}, headers=cookie))
        await until(lambda: "tool:r1" in on.inner.waiting)
        retire = asyncio.create_task(on.control.ok("retire", checkpoint_id="h1",
                                                   episode_ids=[{"rollout_id": "r1", "attempt": 0}]))
        await until(lambda: on.shell.checkpoint is not None
                    and on.shell.checkpoint.status_extras()["retiring_sessions"] == 1)
        assert len(on.shell.sessions) == 1 and not retire.done()
        await on.release("r1")
        await asyncio.wait_for(tool, WAIT_S)
        assert await asyncio.wait_for(retire, WAIT_S) == {"retired": ["r1"]}
        assert len(on.shell.sessions) == 0


async def test_off_mounts_nothing_admits_everything_and_keeps_the_headers(root: Path, clock: FakeClock) -> None:
    async with running(root, clock, enabled=False) as on:
        status = await on.client.get("/ng-control/v1/checkpoint/status", headers={"authorization": f"Bearer {TOKEN}"})
        assert (status.status_code, status.json()["error"]["code"]) == (404, "not_found")
        reply = await on.client.post("/seed_session", json={})
        assert reply.status_code == 200 and reply.headers["x-ng-checkpoint-verify"] == "replay"
        assert (await on.verify("r1")).json()["reward"] == 1.0 and len(on.shell.sessions) == 0
        health = await on.client.get("/health")
        assert health.json() == {"status": "ok", "name": NAME}


def test_an_exported_declaration_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be exported"):
        Declaration("exported", "wait")
    with pytest.raises(ValueError, match="checkpoint_verify"):
        Declaration("stateless", "sometimes")  # type: ignore[arg-type]
