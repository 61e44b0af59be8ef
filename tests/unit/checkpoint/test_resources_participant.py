"""Resources servers as checkpoint participants, in process (httpx.ASGITransport) on a fake clock.

Every resources server of the project passes the conformance suite; then, by declaration:
checkpointing off mounts nothing; requests wait while a checkpoint is open; in-flight tool calls
and ``wait`` verifies block a prepare, ``replay`` verifies never do; the records of stateless and
exported servers; restore on a fresh process only, all or nothing, bound to the next attempt;
byte-for-byte re-export; retire and forget leave nothing; restart-only servers never block, are
listed as restarts and keep running; the hooks run when they should.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI

from nemo_gym_ckpt.checkpoint.records import Record
from nemo_gym_ckpt.checkpoint.router import CONTROL_PREFIX
from nemo_gym_ckpt.checkpoint.store import CheckpointStore, StopSignal
from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.errors import ConfigError
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.resources.base import ResourcesServer, Session, ToolArgs, tool
from nemo_gym_ckpt.resources.sessions import SessionTable
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.conformance import CHECKS, Control, ParticipantUnderTest, check_participant
from nemo_gym_ckpt.testing.resources import held, mesh_with, until_held
from resources_servers.calculator_tools.app import CalculatorTask, CalculatorTools, CalculatorVerdict
from resources_servers.kv_store.app import KvStore, KvVerdict, KvVerifyTask
from resources_servers.python_repl.app import PythonRepl
from tests.support.resources_participants import SERVERS, WAIT_S, hooks_for
from tests.unit.checkpoint.conftest import GRACE_S, TOKEN, until

pytestmark = pytest.mark.unit

NAME = "res"
EMPTY_RESPONSE: dict[str, Any] = {"output": []}
RESTART_ONLY_CHECKS = {  # they need an episode whose state a checkpoint captures; see the restart tests
    "restored_content_is_exported_byte_for_byte",
    "commit_scope_limits_the_export",
    "requests_wait_for_resume",  # a restart-only server never closes admission (its own test says so)
}


# ---- harness ---------------------------------------------------------------------------------


@dataclass
class Running:
    server: Any
    app: FastAPI
    client: httpx.AsyncClient
    control: Control
    root: Path

    def cookie(self, reply: httpx.Response) -> dict[str, str]:
        """The session cookie a seed reply set, as a header to pass explicitly (as agents do)."""
        return {"cookie": f"{self.server.cookie_name}={reply.cookies[self.server.cookie_name]}"}

    async def seed(self, key: str, **row: Any) -> dict[str, str]:
        reply = await self.client.post(f"/ng-rollout/{key}/seed_session", json=row)
        assert reply.status_code == 200, reply.text
        return self.cookie(reply)

    async def call(
        self, capture_key: str, route: str, cookie: dict[str, str] | None = None, /, **body: Any
    ) -> httpx.Response:
        return await self.client.post(f"/ng-rollout/{capture_key}/{route}", json=body, headers=cookie)

    def release(self, key: str) -> None:
        """Let the held call of ``key`` end, in process: while a control call is in flight (a prepare
        waiting on that very call) ``POST /_test/release`` would first wait out ``MAX_DEFER_S`` (1 s), as
        ``ControlFirst`` makes every data-plane request wait."""
        self.server.holds.gate(key).set()

    async def extras(self) -> dict[str, Any]:
        extras: dict[str, Any] = (await self.control.status())["extras"]
        return extras


def no_cookie_jar() -> CookieJar:
    return CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))


def checkpoint_block(root: Path) -> dict[str, Any]:
    return {"enabled": True, "control_auth_token": TOKEN, "root": str(root), "lease_grace_seconds": GRACE_S}


@asynccontextmanager
async def running(
    server_class: type[ResourcesServer[Any]],
    implementation: str,
    root: Path,
    clock: FakeClock,
    *,
    enabled: bool = True,
) -> AsyncIterator[Running]:
    """A fresh server of ``server_class`` (its app's lifespan entered), with a client."""
    mesh = mesh_with(implementation, NAME, checkpoint_block(root) if enabled else None)
    ctx: ServerContext[Any] = ServerContext(NAME, mesh.instance(NAME).settings, mesh)
    server = server_class(ctx)
    app = server.build_app(clock=clock)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://res", cookies=no_cookie_jar()
            ) as client:
                pt = ParticipantUnderTest(client, TOKEN, root, now=clock.now, advance_clock=clock.advance)
                yield Running(server, app, client, Control(pt), root)
    finally:
        await ctx.aclose()


@pytest.fixture
def start(root: Path, clock: FakeClock) -> Callable[..., Any]:
    def start_server(server_class: type[ResourcesServer[Any]], implementation: str, **kwargs: Any) -> Any:
        return running(server_class, implementation, root, clock, **kwargs)

    return start_server


async def checkpoint(control: Control, cid: str, directory: Path, **commit: Any) -> dict[str, Any]:
    await control.ok("prepare", checkpoint_id=cid)
    committed = await control.ok("commit", checkpoint_id=cid, checkpoint_dir=str(directory), **commit)
    await control.ok("resume", checkpoint_id=cid)
    return committed


def records_of(directory: Path, committed: dict[str, Any]) -> list[dict[str, Any]]:
    where = directory / "gym" / "resources" / NAME / committed["manifest"]["records_file"]
    return [orjson.loads(line) for line in where.read_bytes().splitlines()]


def write_checkpoint(root: Path, label: str, records: list[dict[str, Any]]) -> Path:
    """A committed checkpoint holding exactly ``records``, written by the real store."""
    directory = root / label
    writer = CheckpointStore(root).open_writer(directory, "resources", NAME, StopSignal())
    writer.write_lines([orjson.dumps(record) for record in records])
    writer.finish("resources", NAME, label)
    return directory


async def until_status(control: Control, condition: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while not condition(status := await control.status()):
        assert time.monotonic() < deadline, f"status never matched: {status}"
        await asyncio.sleep(0)
    return status


def episode(key: str, attempt: int = 0) -> dict[str, Any]:
    return {"rollout_id": key, "attempt": attempt}


# ---- the conformance suite, every server ---------------------------------------------------


@pytest.mark.parametrize("implementation", sorted(SERVERS))
async def test_every_resources_server_passes_the_conformance_suite(
    implementation: str, root: Path, clock: FakeClock
) -> None:
    @asynccontextmanager
    async def make() -> AsyncIterator[ParticipantUnderTest]:
        async with running(held(SERVERS[implementation]), implementation, root, clock) as started:
            pt = started.control.pt
            yield ParticipantUnderTest(
                pt.client,
                TOKEN,
                root,
                now=clock.now,
                advance_clock=clock.advance,
                data=hooks_for(implementation),
            )

    restart_only = SERVERS[implementation].checkpoint_mode == "restart_only"
    skip = tuple(RESTART_ONLY_CHECKS) if restart_only else ()
    results = await check_participant(make, skip=skip)
    expected = {name: "passed" for name in CHECKS if name not in skip}
    if restart_only:
        expected["prepare_reports_blockers_until_ready"] = (
            "not applicable: a restart-only server never blocks a prepare"
        )
    assert results == expected


@pytest.mark.parametrize("implementation", sorted(SERVERS))
def test_config_cannot_weaken_the_declarations(implementation: str) -> None:
    for key, value in (("checkpoint_mode", "exported"), ("checkpoint_verify", "replay")):
        with pytest.raises(ConfigError, match=key):
            load_config_dict({NAME: {"resources_servers": {implementation: {key: value}}}})


# ---- checkpointing off ---------------------------------------------------------------------


@pytest.mark.parametrize("implementation", sorted(SERVERS))
async def test_off_mounts_nothing_and_changes_nothing(implementation: str, start: Callable[..., Any]) -> None:
    server_class = SERVERS[implementation]
    async with start(server_class, implementation, enabled=False) as off:
        assert off.server.checkpoint is None
        assert not [route for route in off.app.routes if getattr(route, "path", "").startswith("/ng-control")]
        status = await off.client.get(
            f"{CONTROL_PREFIX}/status", headers={"authorization": f"Bearer {TOKEN}"}
        )
        assert (status.status_code, status.json()["error"]["code"]) == (404, "not_found")
        seeded = await off.client.post("/seed_session", json={})  # no rollout prefix needed
        assert seeded.status_code == 200 and seeded.json()["resources_session_id"]
        assert dict(seeded.headers).items() >= off.server.checkpoint_headers().items()
        assert len(off.server.sessions) == (0 if server_class.checkpoint_mode == "stateless" else 1)
        closed = await off.client.post("/close_session", headers=off.cookie(seeded))
        assert closed.json() == {"resources_session_id": seeded.json()["resources_session_id"]}
        assert len(off.server.sessions) == 0


async def test_off_a_stateless_server_answers_without_a_prefix(start: Callable[..., Any]) -> None:
    async with start(CalculatorTools, "calculator_tools", enabled=False) as off:
        assert (await off.client.post("/add", json={"a": 2, "b": 3})).text == "5"
        assert len(off.server.sessions) == 0


# ---- checkpointing on: admission ---------------------------------------------------------------


async def test_on_rollout_scoped_requests_need_the_prefix(start: Callable[..., Any]) -> None:
    async with start(CalculatorTools, "calculator_tools") as on:
        verify = {"expected_answer": 3, "response": EMPTY_RESPONSE}
        for route, body in (
            ("seed_session", {}),
            ("add", {"a": 1, "b": 2}),
            ("verify", verify),
            ("close_session", {}),
        ):
            reply = await on.client.post(f"/{route}", json=body)
            assert (reply.status_code, reply.json()["error"]["code"]) == (400, "rollout_id_required"), route
        assert (await on.client.get("/tools")).status_code == 200  # not rollout traffic
        assert (await on.call("r1", "add", a=2, b=3)).text == "5"


async def test_seed_tools_verify_and_close_wait_for_resume(start: Callable[..., Any]) -> None:
    async with start(KvStore, "kv_store") as on:
        first, second = await on.seed("r1"), await on.seed("r2")
        await on.control.ok("prepare", checkpoint_id="c1")
        calls = [
            asyncio.create_task(on.call("r3", "seed_session")),
            asyncio.create_task(on.call("r1", "kv_set", first, key="k", value="v")),
            asyncio.create_task(on.call("r2", "verify", second, expected_state={}, response=EMPTY_RESPONSE)),
            asyncio.create_task(on.call("r2", "close_session", second)),
        ]
        await until_status(on.control, lambda status: status["waiting_requests"] == len(calls))
        assert not any(call.done() for call in calls)
        assert len(on.server.sessions) == 2
        await on.control.ok("resume", checkpoint_id="c1")
        replies = await asyncio.wait_for(asyncio.gather(*calls), WAIT_S)
        assert [reply.status_code for reply in replies] == [200] * len(calls)
        assert (await on.call("r1", "kv_get", first, key="k")).json()["value"] == "v"


async def test_status_declares_and_counts(start: Callable[..., Any]) -> None:
    async with start(held(KvStore), "kv_store") as on:
        await on.seed("r1")
        await on.seed("r2")
        hold = asyncio.create_task(on.call("r1", "hold"))
        await until_held(on.client, "r1", hold)
        assert await on.extras() == {
            "checkpoint_mode": "exported",
            "checkpoint_verify": "wait",
            "sessions": 2,
            "restored_sessions": 0,
            "in_flight_requests": 1,
            "blocking_requests": 1,
            "verifying_requests": 0,
            "retiring_sessions": 0,
        }
        await on.client.post("/_test/release/r1")
        assert (await asyncio.wait_for(hold, WAIT_S)).status_code == 200
        assert (await on.extras())["in_flight_requests"] == 0


# ---- readiness: replay verifies never block, wait verifies and tool calls do ----------------------


class GatedCalculator(CalculatorTools):
    """calculator_tools (stateless, replay) whose verify waits at a gate."""

    def __init__(self, ctx: ServerContext[Any]) -> None:
        super().__init__(ctx)
        self.entered, self.gate = asyncio.Event(), asyncio.Event()

    async def verify(self, task: CalculatorTask) -> CalculatorVerdict:
        self.entered.set()
        await self.gate.wait()
        return await super().verify(task)


class GatedKv(KvStore):
    """kv_store (exported, wait) whose verify waits at a gate."""

    def __init__(self, ctx: ServerContext[Any]) -> None:
        super().__init__(ctx)
        self.entered, self.gate = asyncio.Event(), asyncio.Event()

    async def verify(self, task: KvVerifyTask, session: Session) -> KvVerdict:
        self.entered.set()
        await self.gate.wait()
        return await super().verify(task, session)


def answer(text: str) -> dict[str, Any]:
    return {
        "output": [
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
        ]
    }


async def test_a_replay_verify_in_flight_never_blocks_prepare(start: Callable[..., Any], root: Path) -> None:
    async with start(GatedCalculator, "calculator_tools") as on:
        await on.seed("r1")
        row = {"expected_answer": 5, "response": answer("The answer is 5.")}
        verify = asyncio.create_task(on.call("r1", "verify", **row))
        await asyncio.wait_for(on.server.entered.wait(), WAIT_S)
        extras = await on.extras()
        assert (extras["in_flight_requests"], extras["verifying_requests"]) == (1, 1)
        prepared = await asyncio.wait_for(on.control.ok("prepare", checkpoint_id="c1"), WAIT_S)
        assert prepared["report"]["ready"] is True and prepared["report"]["counts"]["in_flight"] == 1
        committed = await on.control.ok("commit", checkpoint_id="c1", checkpoint_dir=str(root / "ck"))
        assert committed["episode_ids"] == ["r1"] and not verify.done()
        await on.control.ok("resume", checkpoint_id="c1")
        on.server.gate.set()
        assert (await asyncio.wait_for(verify, WAIT_S)).json()["reward"] == 1.0


async def test_a_wait_verify_blocks_prepare_until_it_ends(
    start: Callable[..., Any], clock: FakeClock
) -> None:
    async with start(GatedKv, "kv_store") as on:
        cookie = await on.seed("r1")
        verify = asyncio.create_task(
            on.call("r1", "verify", cookie, expected_state={}, response=EMPTY_RESPONSE)
        )
        await asyncio.wait_for(on.server.entered.wait(), WAIT_S)
        deadline = clock.now() + 5
        pending = asyncio.create_task(on.control.ok("prepare", checkpoint_id="c1", deadline_ts=deadline))
        await until_status(on.control, lambda status: status["report"] is not None)
        clock.advance(6)
        report = (await asyncio.wait_for(pending, WAIT_S))["report"]
        assert (report["ready"], report["blockers"], report["counts"]["blocking"]) == (False, ["r1"], 1)
        sleepers = clock.sleepers
        pending = asyncio.create_task(on.control.ok("prepare", checkpoint_id="c1"))
        await until(lambda: clock.sleepers > sleepers)  # the prepare waits for a change
        assert not pending.done()
        on.server.gate.set()  # the verify ends: the prepare waiting on it is ready, without a resume
        assert (await asyncio.wait_for(pending, WAIT_S))["report"]["ready"] is True
        assert (await asyncio.wait_for(verify, WAIT_S)).json()["reward"] == 1.0
        await on.control.ok("resume", checkpoint_id="c1")


async def test_an_in_flight_tool_call_blocks_prepare_until_it_ends(start: Callable[..., Any]) -> None:
    async with start(held(CalculatorTools), "calculator_tools") as on:
        hold = asyncio.create_task(on.call("r1-a2", "hold"))
        await until_held(on.client, "r1-a2", hold)
        pending = asyncio.create_task(on.control.ok("prepare", checkpoint_id="c1"))
        report = await until_status(on.control, lambda status: status["report"] is not None)
        assert report["report"]["blockers"] == ["r1-a2"] and not pending.done()
        on.release("r1-a2")
        assert (await asyncio.wait_for(pending, WAIT_S))["phase"] == "prepared"
        await on.control.ok("resume", checkpoint_id="c1")
        assert (await asyncio.wait_for(hold, WAIT_S)).text == '"released"'


# ---- records and restore ---------------------------------------------------------------------


async def test_stateless_records_carry_membership_only(start: Callable[..., Any], root: Path) -> None:
    async with start(CalculatorTools, "calculator_tools") as on:
        cookie = await on.seed("r1")
        await on.seed("r2-a3")
        await on.call("r1", "close_session", cookie)
        committed = await checkpoint(on.control, "c1", root / "ck")
    (record,) = records_of(root / "ck", committed)
    assert set(record) == {"episode_id", "session_id"} and record["episode_id"] == episode("r2", 3)


async def test_a_stateless_sessions_record_is_encoded_once_at_its_seed(
    start: Callable[..., Any], root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    encoded: list[bytes] = []
    for name in ("from_data", "of_strings"):
        original = getattr(Record, name)

        def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Record:
            record: Record = _original(*args, **kwargs)
            encoded.append(record.raw)
            return record

        monkeypatch.setattr(Record, name, counted)
    async with start(CalculatorTools, "calculator_tools") as on:
        await on.seed("r1")
        assert len(encoded) == 1  # at the seed, on the data plane: no commit builds it in its pause
        first = await checkpoint(on.control, "c1", root / "c1", incremental=False)
        assert len(encoded) == 1
        second = await checkpoint(on.control, "c2", root / "c2", incremental=False)
    assert len(encoded) == 1  # the second commit looked the record up
    assert records_of(root / "c1", first) == records_of(root / "c2", second) == [orjson.loads(encoded[0])]


async def test_exported_records_carry_the_state(start: Callable[..., Any], root: Path) -> None:
    async with start(KvStore, "kv_store") as on:
        cookie = await on.seed("r1", initial_state={"a": "1"})
        await on.call("r1", "kv_set", cookie, key="b", value="2")
        committed = await checkpoint(on.control, "c1", root / "ck")
    session_id = cookie["cookie"].split("=")[1]
    assert records_of(root / "ck", committed) == [
        {"episode_id": episode("r1"), "session_id": session_id, "state": {"items": {"a": "1", "b": "2"}}}
    ]


async def test_a_restored_session_keeps_its_cookie_under_the_next_attempt(
    start: Callable[..., Any], root: Path
) -> None:
    async with start(KvStore, "kv_store") as before:
        cookie = await before.seed("r1-a1", initial_state={"a": "1"})
        await checkpoint(before.control, "c1", root / "ck")
    async with start(KvStore, "kv_store") as after:
        restored = await after.control.ok(
            "restore", checkpoint_id="r", checkpoint_dir=str(root / "ck"), episode_ids=[episode("r1", 1)]
        )
        assert restored["restored"] == ["r1-a2"] and (await after.extras())["restored_sessions"] == 1
        waiting = asyncio.create_task(after.call("r1-a2", "kv_get", cookie, key="a"))
        await until_status(after.control, lambda status: status["waiting_requests"] == 1)
        await after.control.ok("resume", checkpoint_id="r")
        assert (await asyncio.wait_for(waiting, WAIT_S)).json() == {"key": "a", "value": "1", "found": True}
        stale = await after.call("r1-a1", "kv_get", cookie, key="a")
        assert (stale.status_code, stale.json()["error"]["code"]) == (409, "stale_attempt")
        (session,) = after.server.sessions
        assert session.identity == RolloutIdentity("r1", 2)


async def test_a_seed_after_a_restore_drops_its_own_restored_session_without_walking_the_table(
    start: Callable[..., Any], root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thousands of sessions after a restore: a seed must not cost a walk over all of them."""
    async with start(KvStore, "kv_store") as before:
        for key in ("r1", "r2", "r3"):
            await before.seed(key, initial_state={"k": key})
        await checkpoint(before.control, "c1", root / "ck")
    async with start(KvStore, "kv_store") as after:
        scope = [episode(key) for key in ("r1", "r2", "r3")]
        await after.control.ok("restore", checkpoint_id="r", checkpoint_dir=str(root / "ck"), episode_ids=scope)
        await after.control.ok("resume", checkpoint_id="r")
        walks = 0
        table_iter = SessionTable.__iter__

        def counted(table: SessionTable) -> Iterator[Session]:
            nonlocal walks
            walks += 1
            return table_iter(table)

        monkeypatch.setattr(SessionTable, "__iter__", counted)
        await after.seed("r9", initial_state={"k": "new"})  # no restored session of its own
        await after.seed("r2-a1", initial_state={"k": "again"})  # starts over: its restored one goes
        assert walks == 0
        monkeypatch.undo()
        by_attempt = {(s.identity.rollout_id, s.identity.attempt): s.restored is not None
                      for s in after.server.sessions}
        assert by_attempt == {("r1", 1): True, ("r3", 1): True, ("r9", 0): False, ("r2", 1): False}
        assert (await after.extras())["restored_sessions"] == 2


async def test_restored_content_is_exported_again_as_read_until_touched(
    start: Callable[..., Any], root: Path
) -> None:
    async with start(KvStore, "kv_store") as before:
        cookies = [await before.seed(key, initial_state={"k": key}) for key in ("r1", "r2")]
        first = await checkpoint(before.control, "c1", root / "ck1")
    original = records_of(root / "ck1", first)
    async with start(KvStore, "kv_store") as after:
        scope = [episode("r1"), episode("r2")]
        await after.control.ok(
            "restore", checkpoint_id="r", checkpoint_dir=str(root / "ck1"), episode_ids=scope
        )
        await after.control.ok("resume", checkpoint_id="r")
        same = await checkpoint(after.control, "c2", root / "ck2", incremental=False)  # a full write
        assert same["manifest"]["records_sha256"] == first["manifest"]["records_sha256"]
        next_scope = [episode("r1", 1), episode("r2", 1)]
        moved = records_of(
            root / "ck3", await checkpoint(after.control, "c3", root / "ck3", episode_ids=next_scope)
        )
        assert [r["episode_id"] for r in moved] == next_scope
        assert [r["state"] for r in moved] == [r["state"] for r in original]
        assert (await after.call("r1-a1", "kv_get", cookies[0], key="k")).status_code == 200  # touched
        touched = records_of(root / "ck4", await checkpoint(after.control, "c4", root / "ck4"))
        assert [r["episode_id"] for r in touched] == [episode("r1", 1), episode("r2")]
        assert (await after.extras())["restored_sessions"] == 1


async def test_a_commit_drops_restored_sessions_its_scope_left_out(
    start: Callable[..., Any], root: Path
) -> None:
    async with start(KvStore, "kv_store") as before:
        for key in ("r1", "r2", "r3"):
            await before.seed(key)
        await checkpoint(before.control, "c1", root / "ck1")
    async with start(KvStore, "kv_store") as after:
        scope = [episode("r1"), episode("r2"), episode("r3")]
        await after.control.ok(
            "restore", checkpoint_id="r", checkpoint_dir=str(root / "ck1"), episode_ids=scope
        )
        await after.control.ok("resume", checkpoint_id="r")
        committed = await checkpoint(
            after.control, "c2", root / "ck2", episode_ids=[episode("r1"), episode("r2", 1)]
        )
        assert sorted(committed["episode_ids"]) == ["r1", "r2-a1"]
        assert sorted(s.identity.capture_key for s in after.server.sessions) == ["r1-a1", "r2-a1"]


def kv_record(key: str, session_id: str, state: Any) -> dict[str, Any]:
    return {"episode_id": episode(key), "session_id": session_id, "state": state}


@pytest.mark.parametrize(
    ("bad", "detail"),
    [
        (kv_record("r2", "s2", {"items": {"k": 5}}), "malformed session state"),
        (kv_record("r2", "s2", {"items": {"k": "v"}, "extra": 1}), "malformed session state"),
        (kv_record("r2", "s2", ["not", "an", "object"]), "malformed session state"),
        (kv_record("r2", "s2", {"items": {f"k{n}": "v" for n in range(300)}}), "more than max_keys=256"),
        (kv_record("r2", "bad id!", {"items": {}}), "session_id 'bad id!' is malformed"),
        (kv_record("r2", "s1", {"items": {}}), "session s1 appears in more than one record"),
        ({"episode_id": episode("r2"), "session_id": "s2"}, "expected the fields"),
        ({**kv_record("r2", "s2", {"items": {}}), "extra": 1}, "expected the fields"),
    ],
)
async def test_a_malformed_record_installs_nothing(
    start: Callable[..., Any], root: Path, bad: dict[str, Any], detail: str
) -> None:
    directory = write_checkpoint(root, "ck", [kv_record("r1", "s1", {"items": {"a": "1"}}), bad])
    async with start(KvStore, "kv_store") as fresh:
        error = await fresh.control.refused(
            "invalid_checkpoint_state",
            "restore",
            checkpoint_id="r",
            checkpoint_dir=str(directory),
            episode_ids=[episode("r1"), episode("r2")],
        )
        assert detail in error["detail"]
        assert len(fresh.server.sessions) == 0
        await fresh.control.ok("resume", checkpoint_id="r")


async def test_a_stateless_server_refuses_an_exported_record(start: Callable[..., Any], root: Path) -> None:
    directory = write_checkpoint(root, "ck", [kv_record("r1", "s1", {"items": {}})])
    async with start(CalculatorTools, "calculator_tools") as fresh:
        error = await fresh.control.refused(
            "invalid_checkpoint_state",
            "restore",
            checkpoint_id="r",
            checkpoint_dir=str(directory),
            episode_ids=[episode("r1")],
        )
        assert "expected the fields ['episode_id', 'session_id']" in error["detail"]


async def test_a_stateless_restore_recreates_sessions_under_the_same_ids(
    start: Callable[..., Any], root: Path
) -> None:
    directory = write_checkpoint(root, "ck", [{"episode_id": episode("r1", 4), "session_id": "s-1"}])
    async with start(CalculatorTools, "calculator_tools") as fresh:
        await fresh.control.ok(
            "restore", checkpoint_id="r", checkpoint_dir=str(directory), episode_ids=[episode("r1", 4)]
        )
        (session,) = fresh.server.sessions
        assert (session.session_id, session.identity, session.state) == ("s-1", RolloutIdentity("r1", 5), {})


# ---- restore needs a fresh process (the adapter's own check) -----------------------------------


class Probe(ToolArgs):
    pass


class RestartProbe(PythonRepl):
    """A restart-only server with a tool that needs no session: a call takes no seed first."""

    @tool
    async def ping(self, args: Probe) -> str:
        """Answer pong."""
        return "pong"


async def test_a_restart_only_call_without_a_seed_still_counts_as_traffic(
    start: Callable[..., Any], root: Path
) -> None:
    directory = write_checkpoint(root, "ck", [])
    async with start(RestartProbe, "python_repl") as used:
        assert (await used.call("r1", "ping")).text == '"pong"'
        error = await used.control.refused(
            "invalid_phase", "restore", checkpoint_id="r", checkpoint_dir=str(directory), episode_ids=[]
        )
        assert "served rollout traffic" in error["detail"]


# ---- commit with stop ------------------------------------------------------------------------


async def test_a_stop_commit_frees_the_interpreters_and_a_plain_commit_keeps_them(
    start: Callable[..., Any], root: Path
) -> None:
    async with start(PythonRepl, "python_repl") as on:
        cookie = await on.seed("r1")
        ran = await on.call("r1", "run_python", cookie, code="x = 6 * 7")
        assert ran.status_code == 200, ran.text
        assert len(on.server.interpreters) == 1
        await checkpoint(on.control, "c1", root / "c1", stop=False)
        assert len(on.server.interpreters) == 1, "a commit without stop freed a session's child"
        await checkpoint(on.control, "c2", root / "c2", stop=True)
        assert on.server.interpreters == {}, "the stop commit left the interpreter running"
        assert len(on.server.sessions) == 1  # the session itself stays; only what it held is freed


class FailingRelease(KvStore):
    released: list[str] = []

    async def release_session(self, session: Session) -> None:
        self.released.append(session.session_id)
        raise OSError("the sandbox would not stop")


async def test_a_failure_to_free_never_fails_the_stop_commit(start: Callable[..., Any], root: Path) -> None:
    async with start(FailingRelease, "kv_store") as on:
        cookies = [await on.seed(key) for key in ("r1", "r2")]
        assert all(cookies)
        committed = await checkpoint(on.control, "c1", root / "c1", stop=True)
        assert committed["phase"] == "committed" and committed["manifest"]["record_count"] == 2
        assert len(FailingRelease.released) == 2, "one failure stopped the other releases"
        assert (root / "c1" / "gym" / "resources" / NAME / "manifest.json").is_file()


# ---- retire and forget -----------------------------------------------------------------------


async def test_retire_then_forget_leaves_nothing(start: Callable[..., Any], clock: FakeClock) -> None:
    async with start(held(KvStore), "kv_store") as on:
        cookies = {key: await on.seed(key) for key in ("r1", "r1-a1", "r2", "r3")}
        retired = [episode("r1", 1), episode("r2")]
        assert await on.control.ok("retire", checkpoint_id="h1", episode_ids=retired) == {
            "retired": ["r1-a1", "r2"]
        }
        assert sorted(s.identity.capture_key for s in on.server.sessions) == ["r3"]
        stale = await on.call("r1", "kv_list", cookies["r1"])
        assert (stale.status_code, stale.json()["error"]["code"]) == (409, "stale_attempt")
        await on.control.ok("forget", checkpoint_id="h2", rollout_ids=["r1", "r2", "r3"])
        status = await on.control.status()
        assert status["retired_rollouts"] == 0 and status["waiting_requests"] == 0
        assert status["extras"] == {
            "checkpoint_mode": "exported",
            "checkpoint_verify": "wait",
            "sessions": 0,
            "restored_sessions": 0,
            "in_flight_requests": 0,
            "blocking_requests": 0,
            "verifying_requests": 0,
            "retiring_sessions": 0,
        }


class FreeingKv(KvStore):
    """kv_store (exported) with the ``hold`` tool, logging what each session's tool calls and its
    ``retire_session`` see, in order."""

    def __init__(self, ctx: ServerContext[Any]) -> None:
        super().__init__(ctx)
        self.log: list[str] = []

    async def retire_session(self, session: Session) -> None:
        assert session.identity is not None
        self.log.append(f"freed {session.identity.capture_key}")


async def test_retire_frees_a_session_only_after_its_requests_in_flight_stopped(
    start: Callable[..., Any], clock: FakeClock
) -> None:
    async with start(held(FreeingKv), "kv_store") as on:
        cookie = await on.seed("r1")
        hold = asyncio.create_task(on.call("r1", "hold", cookie))
        await until_held(on.client, "r1", hold)
        retire = asyncio.create_task(
            on.control.send("retire", {"checkpoint_id": "h1", "deadline_ts": clock.now() + 5,
                                       "episode_ids": [episode("r1")]})
        )
        await until_status(on.control, lambda status: status["extras"]["retiring_sessions"] == 1)
        assert on.server.log == [] and len(on.server.sessions) == 1  # its call still runs: nothing freed
        refused = await on.call("r1", "kv_list", cookie)  # a new request of the attempt: fenced already
        assert (refused.status_code, refused.json()["error"]["code"]) == (409, "stale_attempt")
        clock.advance(6)  # the deadline passes while the call runs: retire says so, frees nothing yet
        late = await asyncio.wait_for(retire, WAIT_S)
        assert (late.status_code, late.json()["error"]["code"]) == (409, "deadline_exceeded")
        assert on.server.log == [] and len(on.server.sessions) == 1
        await on.client.post("/_test/release/r1")
        assert (await asyncio.wait_for(hold, WAIT_S)).status_code == 200
        await on.control.ok("retire", checkpoint_id="h2", episode_ids=[episode("r1")])
        assert on.server.log == ["freed r1"] and len(on.server.sessions) == 0
        assert (await on.extras())["retiring_sessions"] == 0


# ---- restart-only servers ------------------------------------------------------------------------


async def test_restart_only_sessions_are_restarts_that_never_block(
    start: Callable[..., Any], root: Path
) -> None:
    async with start(held(PythonRepl), "python_repl") as on:
        cookie = await on.seed("r1")
        hold = asyncio.create_task(on.call("r2-a1", "hold"))
        await until_held(on.client, "r2-a1", hold)
        prepared = await asyncio.wait_for(on.control.ok("prepare", checkpoint_id="c1"), WAIT_S)
        assert prepared["report"]["ready"] is True and prepared["report"]["restarts"] == ["r1", "r2-a1"]
        ran = await asyncio.wait_for(
            on.call("r1", "run_python", cookie, code="6 * 7"), WAIT_S
        )  # keeps running
        assert ran.json() == {"output": "42\n", "error": None}
        seed = await asyncio.wait_for(on.call("r3", "seed_session"), WAIT_S)  # a new seed never waits
        assert seed.headers["x-ng-checkpoint-restart"] == "1"
        assert (await on.control.status())["waiting_requests"] == 0
        committed = await on.control.ok("commit", checkpoint_id="c1", checkpoint_dir=str(root / "ck"))
        assert committed["manifest"]["record_count"] == 0 and committed["episode_ids"] == []
        await on.control.ok("resume", checkpoint_id="c1")
        await on.control.ok("prepare", checkpoint_id="c2")
        error = await on.control.refused(
            "restart_in_scope",
            "commit",
            checkpoint_id="c2",
            checkpoint_dir=str(root / "bad"),
            episode_ids=[episode("r1")],
        )
        assert "restart episodes cannot be in a commit scope: ['r1']" in error["detail"]
        await on.control.ok("resume", checkpoint_id="c2")
        await on.client.post("/_test/release/r2-a1")
        assert (await asyncio.wait_for(hold, WAIT_S)).status_code == 200


async def test_restart_only_retire_kills_the_interpreter_and_fences(start: Callable[..., Any]) -> None:
    async with start(PythonRepl, "python_repl") as on:
        cookie = await on.seed("r1")
        assert (await on.call("r1", "run_python", cookie, code="x = 1")).json()["error"] is None
        (interpreter,) = on.server.interpreters.values()
        await on.control.ok("retire", checkpoint_id="h1", episode_ids=[episode("r1")])
        assert not interpreter.alive and on.server.interpreters == {} and len(on.server.sessions) == 0
        stale = await on.call("r1", "run_python", cookie, code="x")
        assert (stale.status_code, stale.json()["error"]["code"]) == (409, "stale_attempt")


async def test_a_restart_only_server_refuses_records(start: Callable[..., Any], root: Path) -> None:
    directory = write_checkpoint(root, "ck", [{"episode_id": episode("r1"), "session_id": "s1"}])
    async with start(PythonRepl, "python_repl") as fresh:
        error = await fresh.control.refused(
            "invalid_checkpoint_state",
            "restore",
            checkpoint_id="r",
            checkpoint_dir=str(directory),
            episode_ids=[episode("r1")],
        )
        assert "restart-only server never exports" in error["detail"]


# ---- the hooks -------------------------------------------------------------------------------------


class ParkedKv(KvStore):
    """kv_store that records when its sessions are parked and exported."""

    def __init__(self, ctx: ServerContext[Any]) -> None:
        super().__init__(ctx)
        self.log: list[tuple[str, str]] = []

    async def park_session(self, session: Session) -> None:
        self.log.append(("park", session.identity.capture_key if session.identity else "-"))

    async def export_session(self, session: Session) -> dict[str, Any]:
        self.log.append(("export", session.identity.capture_key if session.identity else "-"))
        return await super().export_session(session)


async def test_park_runs_once_per_checkpoint_after_the_sessions_calls_end(
    start: Callable[..., Any], root: Path
) -> None:
    async with start(held(ParkedKv), "kv_store") as on:
        await on.seed("r1")
        await on.seed("r2")
        hold = asyncio.create_task(on.call("r2", "hold"))
        await until_held(on.client, "r2", hold)
        pending = asyncio.create_task(on.control.ok("prepare", checkpoint_id="c1"))
        await until_status(on.control, lambda status: status["report"] is not None)
        assert on.server.log == [("park", "r1")]
        on.release("r2")
        await asyncio.wait_for(pending, WAIT_S)
        await on.control.ok("commit", checkpoint_id="c1", checkpoint_dir=str(root / "ck1"))
        await on.control.ok("resume", checkpoint_id="c1")
        assert on.server.log == [("park", "r1"), ("park", "r2"), ("export", "r1"), ("export", "r2")]
        await checkpoint(on.control, "c2", root / "ck2")
        assert on.server.log[4:] == [("park", "r1"), ("park", "r2"), ("export", "r1"), ("export", "r2")]


async def _export(self: Any, session: Session) -> dict[str, Any]:
    return {}


async def _retire(self: Any, session: Session) -> None:
    return None


@pytest.mark.parametrize(
    ("base", "hooks", "unused"),
    [
        (CalculatorTools, {"export_session": _export}, "['export_session'] never run"),
        (CalculatorTools, {"retire_session": _retire}, "['retire_session'] never run"),
        (PythonRepl, {"park_session": _retire, "retire_session": _retire}, "['park_session'] never run"),
    ],
)
def test_hooks_a_mode_never_runs_are_refused(base: type, hooks: dict[str, Any], unused: str) -> None:
    with pytest.raises(TypeError) as raised:
        type("Bad", (base,), hooks)
    assert unused in str(raised.value)


async def test_nemo_gym_calls_without_a_prefix_are_admitted_by_their_body_or_their_session(
    start: Callable[..., Any],
) -> None:
    """NeMo Gym's environment servers seed with ``episode_id`` in the body and then call without the
    rollout prefix: the seed is admitted under that episode, later calls under their session's."""
    async with start(SERVERS["kv_store"], "kv_store") as res:
        nobody = await res.client.post("/seed_session", json={"initial_state": {}})
        assert (nobody.status_code, nobody.json()["error"]["code"]) == (400, "rollout_id_required")
        seed = {"resources_session_id": "resources-session-9", "episode_id": {"rollout_id": "2-0", "attempt": 1},
                "task_id": {"taskset": "kv", "task_id": "2"}, "task_data": {"initial_state": {"a": "1"}}}
        seeded = await res.client.post("/seed_session", json=seed)
        assert seeded.status_code == 200, seeded.text
        (session,) = list(res.server.sessions)
        assert session.identity == RolloutIdentity("2-0", 1) and session.session_id == "resources-session-9"
        cookie = res.cookie(seeded)
        assert (await res.client.post("/kv_get", json={"key": "a"}, headers=cookie)).status_code == 200
        await res.control.ok("prepare", checkpoint_id="ck-ng")
        waiting = asyncio.create_task(res.client.post("/kv_set", json={"key": "b", "value": "2"}, headers=cookie))
        await until(lambda: res.server.checkpoint.participant.status()["waiting_requests"] == 1)
        assert not waiting.done()
        await res.control.ok("resume", checkpoint_id="ck-ng")
        assert (await asyncio.wait_for(waiting, WAIT_S)).status_code == 200
        close = {"resources_session_id": "resources-session-9", "episode_id": seed["episode_id"]}
        closed = await res.client.post("/close_session", json=close)
        assert (closed.status_code, closed.json()) == (200, {"resources_session_id": "resources-session-9"})
        assert len(res.server.sessions) == 0
