"""The participant conformance suite, written once: ``check_participant(make)``.

``make()`` is an async context manager that gives a fresh participant (a new app in process, or a
new server process) as a ``ParticipantUnderTest``: an HTTP client whose base URL is the server,
the control token, the checkpoint root, the participant's clock and, when the harness can, a way
to move that clock and the kind's data-plane hooks. Every check is a small async function of
``make``; ``CHECKS`` names them so a test module can run each as its own test case::

    @pytest.mark.parametrize("name", sorted(CHECKS))
    async def test_conformance(name):
        await CHECKS[name](make_minimal)

A check that needs a capability the harness lacks raises ``NotApplicable``. Also here:
``MeshTransport``, an httpx transport that routes each host to an in-process ASGI app.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import orjson

from nemo_gym_ckpt.checkpoint.router import CONTROL_PREFIX
from nemo_gym_ckpt.errors import ERROR_CODES
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = [
    "CHECKS",
    "Control",
    "DataHooks",
    "MakeParticipant",
    "MeshTransport",
    "NotApplicable",
    "ParticipantUnderTest",
    "check_participant",
]

WAIT_S = 10.0
UNDER_ROOT = "@"
SHORT_DEADLINE_S = 2.0
"""The deadline of a check that waits one out (on the real clock it is waited for, so it is short):
the request must still reach the server before it on a loaded machine, where a server process or a
test's loop can be held for several tenths of a second."""


def unique(label: str) -> str:
    """A fresh directory under the checkpoint root (``@name``: ``Control`` sends its absolute path)."""
    return f"{UNDER_ROOT}{label}-{secrets.token_hex(4)}"


def located(pt: ParticipantUnderTest, directory: str) -> Path:
    """The path a ``unique`` directory stands for."""
    return pt.root / directory.removeprefix(UNDER_ROOT)


class NotApplicable(Exception):
    """The harness lacks what this check needs (a movable clock, data-plane hooks)."""


class DataHooks(Protocol):
    """The kind-specific data plane a harness offers to the suite."""

    async def request(
        self, client: httpx.AsyncClient, episode: RolloutIdentity, payload: dict[str, Any]
    ) -> httpx.Response:
        """One rollout-scoped request that creates or changes the episode's checkpointed state."""
        ...

    async def block(self, client: httpx.AsyncClient, episode: RolloutIdentity, blocked: bool) -> None:
        """Make the episode block readiness (or release it)."""
        ...


@dataclass
class ParticipantUnderTest:
    client: httpx.AsyncClient
    token: str
    root: Path
    now: Callable[[], float] = time.time
    advance_clock: Callable[[float], None] | None = None
    data: DataHooks | None = None

    def hooks(self) -> DataHooks:
        if self.data is None:
            raise NotApplicable("the harness has no data-plane hooks")
        return self.data


MakeParticipant = Callable[[], AbstractAsyncContextManager[ParticipantUnderTest]]
Check = Callable[[MakeParticipant], Awaitable[None]]


class Control:
    """The control routes of one participant, with assertions on replies."""

    def __init__(self, pt: ParticipantUnderTest) -> None:
        self.pt = pt
        self.auth = {"authorization": f"Bearer {pt.token}"}

    def deadline(self, seconds: float = 30.0) -> float:
        return self.pt.now() + seconds

    async def send(
        self, op: str, body: Any = None, *, headers: Mapping[str, str] | None = None
    ) -> httpx.Response:
        url = f"{CONTROL_PREFIX}/{op}"
        headers = self.auth if headers is None else headers
        if op == "status":
            return await self.pt.client.get(url, headers=headers)
        if isinstance(body, dict) and str(body.get("checkpoint_dir", "")).startswith(UNDER_ROOT):
            body = {**body, "checkpoint_dir": str(located(self.pt, body["checkpoint_dir"]))}
        content = body if isinstance(body, bytes) else orjson.dumps(body)
        return await self.pt.client.post(
            url, content=content, headers={**headers, "content-type": "application/json"}
        )

    async def ok(self, op: str, **body: Any) -> dict[str, Any]:
        if op != "status":
            body.setdefault("deadline_ts", self.deadline())
        response = await self.send(op, body)
        assert response.status_code == 200, f"{op}: expected 200, got {response.status_code} {response.text}"
        reply: dict[str, Any] = response.json()
        return reply

    async def refused(self, code: str, op: str, body: Any = None, **fields: Any) -> dict[str, Any]:
        if body is None:
            body = {"deadline_ts": self.deadline(), **fields}
        response = await self.send(op, body)
        return expect_error(response, code, op)

    async def status(self) -> dict[str, Any]:
        return await self.ok("status")


def expect_error(response: httpx.Response, code: str, what: str) -> dict[str, Any]:
    status = ERROR_CODES[code].status
    assert response.status_code == status, (
        f"{what}: expected {status} {code}, got {response.status_code} {response.text}"
    )
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "detail"}, f"{what}: error shape {body}"
    assert body["error"]["code"] == code, f"{what}: expected {code}, got {body['error']['code']}"
    return dict(body["error"])


# ---- checks ----------------------------------------------------------------------------------


async def status_is_the_snapshot(make: MakeParticipant) -> None:
    async with make() as pt:
        status = await Control(pt).status()
        for key in (
            "kind",
            "instance",
            "phase",
            "checkpoint_id",
            "lease_expires_at",
            "retired_rollouts",
            "report",
            "extras",
        ):
            assert key in status, f"status lacks {key}"
        assert status["kind"] in ("environment", "model", "agent", "resources")
        assert (status["phase"], status["checkpoint_id"], status["lease_expires_at"]) == ("idle", None, None)
        assert status["retired_rollouts"] == 0


async def auth_on_every_route(make: MakeParticipant) -> None:
    async with make() as pt:
        control = Control(pt)
        wrong = [
            {},
            {"authorization": "Bearer " + pt.token[:-1] + "x"},
            {"authorization": "Basic " + pt.token},
            {"authorization": "Bearer"},
            {"authorization": pt.token},
        ]
        for op in ("status", "prepare", "renew", "commit", "restore", "resume", "retire", "forget"):
            for headers in wrong:
                error = expect_error(
                    await control.send(op, b"{not json", headers=headers), "unauthorized", op
                )
                assert pt.token not in error["detail"], "the token is echoed"
        assert (await control.status())["phase"] == "idle"


async def bodies_are_strict(make: MakeParticipant) -> None:
    async with make() as pt:
        control = Control(pt)
        good = {"checkpoint_id": "c-1", "deadline_ts": control.deadline()}
        for op, body in _bad_bodies(good):
            await control.refused("invalid_request", op, body)
        assert (await control.status())["phase"] == "idle"


def _bad_bodies(good: dict[str, Any]) -> list[tuple[str, Any]]:
    bad_ids = ["", ".a", "-a", "a/b", "a b", "a\n", "x" * 129, 7, None]
    bodies: list[tuple[str, Any]] = [("prepare", {**good, "checkpoint_id": bad}) for bad in bad_ids]
    bodies += [
        ("prepare", b"{not json"),
        ("prepare", b"[]"),
        ("prepare", b'"x"'),
        ("prepare", b""),
        ("prepare", {**good, "extra": 1}),
        ("prepare", {"checkpoint_id": "c-1"}),
        ("prepare", {**good, "deadline_ts": "soon"}),
        ("prepare", b'{"checkpoint_id":"c","deadline_ts":1e999}'),
        ("prepare", b'{"checkpoint_id":"c","deadline_ts":NaN}'),
        ("renew", {**good, "deadline_ts": None}),
        ("commit", good),
        ("commit", {**good, "checkpoint_dir": ""}),
        ("commit", {**good, "checkpoint_dir": "d", "episode_ids": [{"rollout_id": "r", "attempt": -1}]}),
        ("commit", {**good, "checkpoint_dir": "d", "episode_ids": [{"rollout_id": "/r"}]}),
        ("commit", {**good, "checkpoint_dir": "d", "episode_ids": [{"rollout_id": "r", "extra": 1}]}),
        ("restore", {**good, "checkpoint_dir": "d"}),
        ("retire", {**good, "episode_ids": []}),
        ("retire", good),
        ("forget", {**good, "rollout_ids": []}),
        ("forget", {**good, "rollout_ids": [1]}),
        ("resume", {**good, "checkpoint_dir": "d"}),
        ("commit", {**good, "checkpoint_dir": "d", "stop": "yes"}),
        ("commit", {**good, "checkpoint_dir": "d", "stop": 1}),
    ]
    # rollout ids: capture keys must be one-to-one, so no ':' and no ending that names an attempt
    for bad in ("r:1", "r-a1", "r-a0", "r-a01", "x" * 201, "r\n", "_r"):
        bodies += [
            ("commit", {**good, "checkpoint_dir": "d", "episode_ids": [{"rollout_id": bad}]}),
            ("retire", {**good, "episode_ids": [{"rollout_id": bad, "attempt": 1}]}),
            ("forget", {**good, "rollout_ids": [bad]}),
        ]
    bodies.append(("retire", {**good, "episode_ids": [{"rollout_id": "r", "attempt": 10**9}]}))
    return bodies


async def deadline_in_the_past(make: MakeParticipant) -> None:
    async with make() as pt:
        control = Control(pt)
        past = pt.now() - 1
        for op, extra in (
            ("prepare", {}),
            ("retire", {"episode_ids": [{"rollout_id": "r"}]}),
            ("forget", {"rollout_ids": ["r"]}),
            ("restore", {"checkpoint_dir": unique("d"), "episode_ids": [{"rollout_id": "r"}]}),
        ):
            await control.refused(
                "deadline_exceeded", op, {"checkpoint_id": "late", "deadline_ts": past, **extra}
            )
        assert (await control.status())["phase"] == "idle"


async def resume_is_never_refused_for_its_deadline(make: MakeParticipant) -> None:
    async with make() as pt:
        control = Control(pt)
        past = pt.now() - 3600
        await control.ok("prepare", checkpoint_id="c1")
        resumed = await control.ok("resume", checkpoint_id="c1", deadline_ts=past)
        assert resumed == {"phase": "idle", "idempotent": False}
        assert await control.ok("resume", checkpoint_id="c1", deadline_ts=past) == {
            "phase": "idle", "idempotent": True}
        assert await control.ok("resume", checkpoint_id="never-opened", deadline_ts=past) == {
            "phase": "idle", "idempotent": True}


async def deadlines_are_bounded(make: MakeParticipant) -> None:
    ck = unique("ck")
    async with make() as pt:
        control = Control(pt)
        for far in (control.deadline(2 * 24 * 3600), 1e300):
            for op, extra in (
                ("prepare", {}),
                ("renew", {}),
                ("commit", {"checkpoint_dir": ck}),
                ("restore", {"checkpoint_dir": ck, "episode_ids": []}),
                ("resume", {}),
                ("retire", {"episode_ids": [{"rollout_id": "r"}]}),
                ("forget", {"rollout_ids": ["r"]}),
            ):
                await control.refused("invalid_request", op, checkpoint_id="far", deadline_ts=far, **extra)
        status = await control.status()
        assert (status["phase"], status["checkpoint_id"]) == ("idle", None)
        await control.ok("prepare", checkpoint_id="far")
        await control.refused("invalid_request", "renew", checkpoint_id="far", deadline_ts=1e300)
        assert (await control.status())["lease_expires_at"] < control.deadline(2 * 24 * 3600)
        await control.ok("resume", checkpoint_id="far")


async def unopened_fences_are_kept_apart(make: MakeParticipant) -> None:
    async with make() as pt:
        control = Control(pt)
        await control.ok("prepare", checkpoint_id="old-1")
        await control.ok("resume", checkpoint_id="old-1")
        for n in range(70):
            assert (await control.ok("resume", checkpoint_id=f"made-up-{n}"))["idempotent"] is True
        await control.refused("stale_checkpoint", "prepare", checkpoint_id="old-1")
        await control.refused("stale_checkpoint", "prepare", checkpoint_id="made-up-69")
        assert (await control.status())["phase"] == "idle"


async def commit_with_stop(make: MakeParticipant) -> None:
    async with make() as pt:
        control = Control(pt)
        for cid, stop in (("c1", False), ("c2", True)):
            ck = unique(cid)
            await control.ok("prepare", checkpoint_id=cid)
            committed = await control.ok("commit", checkpoint_id=cid, checkpoint_dir=ck, stop=stop)
            assert committed["phase"] == "committed" and committed["manifest"]["checkpoint_id"] == cid
            assert (located(pt, ck) / "gym").is_dir()
            again = await control.ok("commit", checkpoint_id=cid, checkpoint_dir=ck, stop=stop)
            assert again == committed
            await control.refused("checkpoint_conflict", "commit", checkpoint_id=cid, checkpoint_dir=ck,
                                  stop=not stop)
            await control.ok("resume", checkpoint_id=cid)


async def prepare_commit_resume(make: MakeParticipant) -> None:
    ck1 = unique("ck1")
    async with make() as pt:
        control = Control(pt)
        prepared = await control.ok("prepare", checkpoint_id="c1")
        assert prepared["phase"] == "prepared" and prepared["report"]["ready"] is True
        assert set(prepared["report"]) == {"ready", "blockers", "blocker_count", "counts", "restarts"}
        status = await control.status()
        assert (status["phase"], status["checkpoint_id"]) == ("prepared", "c1")
        committed = await control.ok("commit", checkpoint_id="c1", checkpoint_dir=ck1)
        assert committed["phase"] == "committed"
        _check_manifest_files(located(pt, ck1), status, committed["manifest"], "c1")
        assert await control.ok("resume", checkpoint_id="c1") == {"phase": "idle", "idempotent": False}
        assert await control.ok("resume", checkpoint_id="c1") == {"phase": "idle", "idempotent": True}
        assert (await control.status())["phase"] == "idle"


def _check_manifest_files(
    directory: Path, status: dict[str, Any], manifest: dict[str, Any], cid: str
) -> None:
    where = directory / "gym" / status["kind"] / status["instance"]
    assert orjson.loads((where / "manifest.json").read_bytes()) == manifest
    assert manifest["schema_version"] == 1 and manifest["checkpoint_id"] == cid
    assert (manifest["kind"], manifest["instance"]) == (status["kind"], status["instance"])
    content = (where / manifest["records_file"]).read_bytes()
    assert hashlib.sha256(content).hexdigest() == manifest["records_sha256"]
    assert content.count(b"\n") == manifest["record_count"]
    assert manifest["records_file"] == f"records-{manifest['records_sha256']}.jsonl"
    assert sorted(p.name for p in where.iterdir()) == sorted(["manifest.json", manifest["records_file"]])


async def retries_return_the_stored_reply(make: MakeParticipant) -> None:
    ck1 = unique("ck1")
    ck2 = unique("ck2")
    async with make() as pt:
        control = Control(pt)
        first = await control.ok("prepare", checkpoint_id="c1")
        assert await control.ok("prepare", checkpoint_id="c1") == first
        committed = await control.ok("commit", checkpoint_id="c1", checkpoint_dir=ck1)
        assert await control.ok("commit", checkpoint_id="c1", checkpoint_dir=ck1) == committed
        await control.refused("checkpoint_conflict", "commit", checkpoint_id="c1", checkpoint_dir=ck2)
        await control.refused(
            "checkpoint_conflict",
            "commit",
            checkpoint_id="c1",
            checkpoint_dir=ck1,
            episode_ids=[{"rollout_id": "r"}],
        )
        assert await control.ok("prepare", checkpoint_id="c1") == first
        assert not located(pt, ck2).exists()
        await control.ok("resume", checkpoint_id="c1")


async def another_id_conflicts(make: MakeParticipant) -> None:
    ck = unique("ck")
    async with make() as pt:
        control = Control(pt)
        await control.ok("prepare", checkpoint_id="c1")
        for op, extra in (
            ("prepare", {}),
            ("renew", {}),
            ("resume", {}),
            ("commit", {"checkpoint_dir": ck}),
            ("retire", {"episode_ids": [{"rollout_id": "r"}]}),
            ("forget", {"rollout_ids": ["r"]}),
            ("restore", {"checkpoint_dir": ck, "episode_ids": []}),
        ):
            await control.refused("checkpoint_conflict", op, checkpoint_id="c2", **extra)
        assert (await control.status())["checkpoint_id"] == "c1"
        await control.ok("resume", checkpoint_id="c1")


async def resumed_ids_are_stale(make: MakeParticipant) -> None:
    ck = unique("ck")
    async with make() as pt:
        control = Control(pt)
        await control.ok("prepare", checkpoint_id="c1")
        await control.ok("resume", checkpoint_id="c1")
        for op, extra in (
            ("prepare", {}),
            ("renew", {}),
            ("commit", {"checkpoint_dir": ck}),
            ("retire", {"episode_ids": [{"rollout_id": "r"}]}),
            ("forget", {"rollout_ids": ["r"]}),
            ("restore", {"checkpoint_dir": ck, "episode_ids": []}),
        ):
            await control.refused("stale_checkpoint", op, checkpoint_id="c1", **extra)
        assert (await control.ok("resume", checkpoint_id="c1"))["idempotent"] is True
        assert (await control.status())["phase"] == "idle"


async def resume_of_unknown_id_fences_it(make: MakeParticipant) -> None:
    async with make() as pt:
        control = Control(pt)
        assert await control.ok("resume", checkpoint_id="abandoned") == {"phase": "idle", "idempotent": True}
        await control.refused("stale_checkpoint", "prepare", checkpoint_id="abandoned")
        assert (await control.status())["phase"] == "idle"


async def illegal_transitions(make: MakeParticipant) -> None:
    ck = unique("ck")
    async with make() as pt:
        control = Control(pt)
        await control.refused("invalid_phase", "commit", checkpoint_id="c1", checkpoint_dir=ck)
        await control.refused("invalid_phase", "renew", checkpoint_id="c1")
        await control.ok("prepare", checkpoint_id="c1")
        await control.refused(
            "invalid_phase", "retire", checkpoint_id="c1", episode_ids=[{"rollout_id": "r"}]
        )
        await control.refused("invalid_phase", "forget", checkpoint_id="c1", rollout_ids=["r"])
        await control.refused(
            "invalid_phase", "restore", checkpoint_id="c1", checkpoint_dir=ck, episode_ids=[]
        )
        await control.ok("commit", checkpoint_id="c1", checkpoint_dir=ck)
        await control.refused(
            "invalid_phase", "retire", checkpoint_id="c1", episode_ids=[{"rollout_id": "r"}]
        )
        assert (await control.status())["phase"] == "committed"
        await control.ok("resume", checkpoint_id="c1")


async def renew_extends_the_lease(make: MakeParticipant) -> None:
    async with make() as pt:
        control = Control(pt)
        first = control.deadline(30)
        await control.ok("prepare", checkpoint_id="c1", deadline_ts=first)
        lease = (await control.status())["lease_expires_at"]
        grace = lease - first
        assert grace > 0
        renewed = await control.ok("renew", checkpoint_id="c1", deadline_ts=first + 100)
        assert renewed == {"lease_expires_at": first + 100 + grace}
        assert (await control.status())["lease_expires_at"] == first + 100 + grace
        earlier = await control.ok("renew", checkpoint_id="c1", deadline_ts=first + 10)
        assert earlier == {"lease_expires_at": first + 100 + grace}, "a renew shortened the lease"
        assert (await control.status())["lease_expires_at"] == first + 100 + grace
        await control.ok("resume", checkpoint_id="c1")


async def checkpoint_dir_is_confined(make: MakeParticipant) -> None:
    escape = unique("escape")
    inside = unique("inside")
    async with make() as pt:
        control = Control(pt)
        outside = pt.root.parent / unique("outside")
        outside.mkdir()
        located(pt, escape).symlink_to(outside, target_is_directory=True)
        await control.ok("prepare", checkpoint_id="c1")
        link = located(pt, escape)
        bad_dirs = (f"{pt.root}/../x", f"{pt.root}/a/../../x", str(outside), str(link), f"{link}/sub",
                    str(pt.root), f"{pt.root}/.", "relative-to-the-server-cwd")
        for bad in bad_dirs:
            await control.refused("invalid_request", "commit", checkpoint_id="c1", checkpoint_dir=bad)
        assert list(outside.iterdir()) == []
        await control.ok("commit", checkpoint_id="c1", checkpoint_dir=inside)
        await control.ok("resume", checkpoint_id="c1")


async def restore_round_trip(make: MakeParticipant) -> None:
    ck1 = unique("ck1")
    episodes = [RolloutIdentity("r1"), RolloutIdentity("r2", 2)]
    async with make() as pt:
        await _seed(pt, episodes)
        committed = await _checkpoint(pt, "c1", ck1)
    async with make() as fresh:
        control = Control(fresh)
        scope = [e.to_json() for e in episodes] + [{"rollout_id": "absent"}]
        restored = await control.ok("restore", checkpoint_id="r1", checkpoint_dir=ck1, episode_ids=scope)
        assert restored["phase"] == "restored" and restored["source_checkpoint_id"] == "c1"
        if committed["manifest"]["record_count"]:
            assert restored["restored"] == sorted(e.next_attempt().capture_key for e in episodes)
        assert (
            await control.ok("restore", checkpoint_id="r1", checkpoint_dir=ck1, episode_ids=scope) == restored
        )
        await control.refused(
            "checkpoint_conflict", "restore", checkpoint_id="r1", checkpoint_dir=ck1, episode_ids=scope[:1]
        )
        await control.ok("retire", checkpoint_id="r1", episode_ids=[{"rollout_id": "other", "attempt": 1}])
        await control.ok("resume", checkpoint_id="r1")


async def restored_content_is_exported_byte_for_byte(make: MakeParticipant) -> None:
    ck1 = unique("ck1")
    ck2 = unique("ck2")
    episodes = [RolloutIdentity("r1"), RolloutIdentity("r2")]
    async with make() as pt:
        await _seed(pt, episodes)
        first = await _checkpoint(pt, "c1", ck1)
    async with make() as fresh:
        control = Control(fresh)
        scope = [e.to_json() for e in episodes]
        await control.ok("restore", checkpoint_id="r1", checkpoint_dir=ck1, episode_ids=scope)
        await control.ok("resume", checkpoint_id="r1")
        # a full write (nothing referenced): the same bytes give the same records file
        again = await _checkpoint(fresh, "c2", ck2, episode_ids=scope, incremental=False)
    assert again["manifest"]["records_sha256"] == first["manifest"]["records_sha256"]
    assert again["manifest"]["record_count"] == len(episodes)


async def restore_needs_a_fresh_process(make: MakeParticipant) -> None:
    ck1 = unique("ck1")
    async with make() as pt:
        await _checkpoint(pt, "c1", ck1)
        if pt.data is not None:
            await _seed(pt, [RolloutIdentity("served")])
            control = Control(pt)
            await control.refused(
                "invalid_phase", "restore", checkpoint_id="r1", checkpoint_dir=ck1, episode_ids=[]
            )
    async with make() as pt:
        control = Control(pt)
        await control.ok("restore", checkpoint_id="r1", checkpoint_dir=ck1, episode_ids=[])
        await control.ok("resume", checkpoint_id="r1")
        await control.refused(
            "invalid_phase", "restore", checkpoint_id="r2", checkpoint_dir=ck1, episode_ids=[]
        )


async def restore_refuses_a_corrupt_checkpoint(make: MakeParticipant) -> None:
    ck1 = unique("ck1")
    empty = unique("empty")
    episodes = [RolloutIdentity("r1")]
    async with make() as pt:
        await _seed(pt, episodes)
        committed = await _checkpoint(pt, "c1", ck1)
        status = await Control(pt).status()
    where = located(pt, ck1) / "gym" / status["kind"] / status["instance"]
    records = where / committed["manifest"]["records_file"]
    original = records.read_bytes()
    records.write_bytes(original + b'{"episode_id":{"rollout_id":"r9","attempt":0}}\n')
    scope = [e.to_json() for e in episodes]
    async with make() as fresh:
        control = Control(fresh)
        await control.refused(
            "invalid_checkpoint_state",
            "restore",
            checkpoint_id="bad",
            checkpoint_dir=ck1,
            episode_ids=scope,
        )
        await control.refused(
            "invalid_checkpoint_state",
            "restore",
            checkpoint_id="bad",
            checkpoint_dir=ck1,
            episode_ids=scope,
        )
        await control.ok("resume", checkpoint_id="bad")
        await control.refused(
            "invalid_checkpoint_state",
            "restore",
            checkpoint_id="none",
            checkpoint_dir=empty,
            episode_ids=scope,
        )
        await control.ok("resume", checkpoint_id="none")
        records.write_bytes(original)
        restored = await control.ok("restore", checkpoint_id="good", checkpoint_dir=ck1, episode_ids=scope)
        assert restored["phase"] == "restored"
        await control.ok("resume", checkpoint_id="good")


async def retire_fences_attempts_and_forget_drops_the_fences(make: MakeParticipant) -> None:
    ck = unique("ck")
    async with make() as pt:
        control = Control(pt)
        retired = await control.ok(
            "retire", checkpoint_id="h1", episode_ids=[{"rollout_id": "r", "attempt": 1}]
        )
        assert retired == {"retired": ["r-a1"]}
        assert (await control.status())["retired_rollouts"] == 1
        await control.refused(
            "stale_attempt",
            "restore",
            checkpoint_id="x",
            checkpoint_dir=ck,
            episode_ids=[{"rollout_id": "r", "attempt": 0}],
        )
        await control.ok("resume", checkpoint_id="x")
        if pt.data is not None:
            for attempt in (0, 1):
                response = await pt.data.request(pt.client, RolloutIdentity("r", attempt), {"n": attempt})
                expect_error(response, "stale_attempt", f"a request of retired attempt {attempt}")
            response = await pt.data.request(pt.client, RolloutIdentity("r", 2), {"n": 2})
            assert response.status_code == 200, response.text
        assert await control.ok("forget", checkpoint_id="h2", rollout_ids=["r"]) == {"forgotten": ["r"]}
        assert (await control.status())["retired_rollouts"] == 0
        if pt.data is not None:
            response = await pt.data.request(pt.client, RolloutIdentity("r", 1), {"n": 1})
            assert response.status_code == 200, response.text


async def commit_refuses_a_retired_attempt_in_scope(make: MakeParticipant) -> None:
    ck = unique("ck")
    async with make() as pt:
        control = Control(pt)
        await control.ok("retire", checkpoint_id="h1", episode_ids=[{"rollout_id": "r", "attempt": 0}])
        await control.ok("prepare", checkpoint_id="c1")
        await control.refused(
            "stale_attempt",
            "commit",
            checkpoint_id="c1",
            checkpoint_dir=ck,
            episode_ids=[{"rollout_id": "r", "attempt": 0}],
        )
        await control.ok("resume", checkpoint_id="c1")


async def lease_expiry_resumes_by_itself(make: MakeParticipant) -> None:
    ck = unique("ck")
    async with make() as pt:
        control = Control(pt)
        # a short lease, but long enough for the prepare to arrive in time on a loaded machine
        await control.ok("prepare", checkpoint_id="c1", deadline_ts=control.deadline(SHORT_DEADLINE_S))
        expires = (await control.status())["lease_expires_at"]
        await _pass_time_until(pt, expires, control)
        assert (await control.status())["phase"] == "idle"
        await control.refused("stale_checkpoint", "prepare", checkpoint_id="c1")
        await control.refused("stale_checkpoint", "commit", checkpoint_id="c1", checkpoint_dir=ck)
        assert (await control.ok("resume", checkpoint_id="c1"))["idempotent"] is True


async def _pass_time_until(pt: ParticipantUnderTest, ts: float, control: Control) -> None:
    if pt.advance_clock is not None:
        pt.advance_clock(ts - pt.now() + 0.001)
        return
    if ts - pt.now() > WAIT_S / 2:
        raise NotApplicable("lease too long to wait for and no movable clock")
    await _until(lambda: pt.now() > ts, control)


async def requests_wait_for_resume(make: MakeParticipant) -> None:
    async with make() as pt:
        hooks, control = pt.hooks(), Control(pt)
        await control.ok("prepare", checkpoint_id="c1")
        waiting = asyncio.create_task(hooks.request(pt.client, RolloutIdentity("w"), {"n": 1}))
        await _until_status(control, lambda s: s.get("waiting_requests", 1) >= 1, waiting)
        assert not waiting.done(), "a request went through while the checkpoint was open"
        await control.ok("resume", checkpoint_id="c1")
        response = await asyncio.wait_for(waiting, WAIT_S)
        assert response.status_code == 200, response.text


async def prepare_reports_blockers_until_ready(make: MakeParticipant) -> None:
    ck = unique("ck")
    async with make() as pt:
        hooks, control = pt.hooks(), Control(pt)
        busy = RolloutIdentity("busy", 3)
        await hooks.block(pt.client, busy, True)
        deadline = control.deadline(SHORT_DEADLINE_S)  # the prepare arrives before it, and answers at it
        pending = asyncio.create_task(control.ok("prepare", checkpoint_id="c1", deadline_ts=deadline))
        await _until_status(control, lambda s: s["report"] is not None, pending)
        # the lease: past the reply, only the grace (0.5 s in the real-clock suites) for the next calls
        await control.ok("renew", checkpoint_id="c1")
        if pt.advance_clock is not None:
            pt.advance_clock(deadline - pt.now() + 0.001)
        reply = await asyncio.wait_for(pending, WAIT_S)
        assert reply["phase"] == "preparing" and reply["report"]["ready"] is False
        assert reply["report"]["blockers"] == [busy.capture_key] and reply["report"]["blocker_count"] == 1
        await control.refused("invalid_phase", "commit", checkpoint_id="c1", checkpoint_dir=ck)
        pending = asyncio.create_task(control.ok("prepare", checkpoint_id="c1"))
        await hooks.block(pt.client, busy, False)
        reply = await asyncio.wait_for(pending, WAIT_S)
        assert reply["phase"] == "prepared" and reply["report"]["ready"] is True
        await control.ok("resume", checkpoint_id="c1")


async def commit_scope_limits_the_export(make: MakeParticipant) -> None:
    ck1 = unique("ck1")
    async with make() as pt:
        episodes = [RolloutIdentity("r1"), RolloutIdentity("r2"), RolloutIdentity("r3", 1)]
        await _seed(pt, episodes)
        scope = [episodes[0].to_json(), episodes[2].to_json()]
        committed = await _checkpoint(pt, "c1", ck1, episode_ids=scope)
        assert sorted(committed["episode_ids"]) == ["r1", "r3-a1"]
        assert committed["manifest"]["record_count"] == 2


# ---- helpers ---------------------------------------------------------------------------------


async def _seed(pt: ParticipantUnderTest, episodes: list[RolloutIdentity]) -> None:
    hooks = pt.hooks()
    for index, episode in enumerate(episodes):
        response = await hooks.request(
            pt.client, episode, {"n": index, "text": f"state of {episode.capture_key}"}
        )
        assert response.status_code == 200, response.text


async def _checkpoint(pt: ParticipantUnderTest, cid: str, directory: str, **commit: Any) -> dict[str, Any]:
    control = Control(pt)
    await control.ok("prepare", checkpoint_id=cid)
    committed = await control.ok("commit", checkpoint_id=cid, checkpoint_dir=directory, **commit)
    await control.ok("resume", checkpoint_id=cid)
    return committed


async def _until_status(
    control: Control, condition: Callable[[dict[str, Any]], bool], task: asyncio.Task[Any]
) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition(await control.status()):
        if task.done():
            return
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def _until(condition: Callable[[], bool], control: Control) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "time did not pass"
        await control.status()
        await asyncio.sleep(0.01)


CHECKS: dict[str, Check] = {
    check.__name__: check
    for check in (
        status_is_the_snapshot,
        auth_on_every_route,
        bodies_are_strict,
        deadline_in_the_past,
        resume_is_never_refused_for_its_deadline,
        deadlines_are_bounded,
        unopened_fences_are_kept_apart,
        commit_with_stop,
        prepare_commit_resume,
        retries_return_the_stored_reply,
        another_id_conflicts,
        resumed_ids_are_stale,
        resume_of_unknown_id_fences_it,
        illegal_transitions,
        renew_extends_the_lease,
        checkpoint_dir_is_confined,
        restore_round_trip,
        restored_content_is_exported_byte_for_byte,
        restore_needs_a_fresh_process,
        restore_refuses_a_corrupt_checkpoint,
        retire_fences_attempts_and_forget_drops_the_fences,
        commit_refuses_a_retired_attempt_in_scope,
        lease_expiry_resumes_by_itself,
        requests_wait_for_resume,
        prepare_reports_blockers_until_ready,
        commit_scope_limits_the_export,
    )
}


async def check_participant(make: MakeParticipant, *, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Run every check against participants from ``make``: ``{name: "passed" | "not applicable: ..."}``.

    A failing check raises ``AssertionError`` naming it.
    """
    results = {}
    for name, check in CHECKS.items():
        if name in skip:
            continue
        try:
            await check(make)
        except NotApplicable as reason:
            results[name] = f"not applicable: {reason}"
            continue
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from error
        results[name] = "passed"
    return results


class MeshTransport(httpx.AsyncBaseTransport):
    """Routes each request by host to an in-process ASGI app: a mesh without sockets."""

    def __init__(self, apps: Mapping[str, Any]) -> None:
        self._transports = {host: httpx.ASGITransport(app) for host, app in apps.items()}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.netloc.decode()
        transport = self._transports.get(host)
        if transport is None:
            raise httpx.ConnectError(f"no app at {host}", request=request)
        return await transport.handle_async_request(request)

    async def aclose(self) -> None:
        for transport in self._transports.values():
            await transport.aclose()
