"""The coordinator over an in-process mesh (one ASGI app per host): discovery, the orders of
docs/protocol.md section 5, failure handling, and result objects."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from nemo_gym_ckpt.checkpoint.coordinator import Coordinator, ParticipantRef
from nemo_gym_ckpt.checkpoint.models import ControlRequest
from nemo_gym_ckpt.checkpoint.router import CONTROL_PREFIX
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import CheckpointConfig
from nemo_gym_ckpt.errors import (
    CheckpointConflict,
    InvalidCheckpointState,
    StaleCheckpoint,
    Unauthorized,
    Unavailable,
    UpstreamError,
)
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.server import create_app, error_response
from nemo_gym_ckpt.testing.conformance import MeshTransport
from nemo_gym_ckpt.testing.minimal import MinimalServer, create_head_stub, create_minimal_server

from .conftest import TOKEN, Otel

pytestmark = pytest.mark.unit

KINDS = ("environment", "model", "agent", "resources")
CALLERS_FIRST = {"environment": 0, "agent": 1, "model": 2, "resources": 2}
STAGE = {  # the stage of each kind, per op (docs/protocol.md section 5)
    "prepare": {"environment": 0, "model": 1, "agent": 2, "resources": 3},
    "resume": {"resources": 0, "agent": 1, "model": 2, "environment": 3},
    "retire": CALLERS_FIRST,
    "forget": CALLERS_FIRST,
}


Answer = Exception | ASGIApp
"""How a participant answers an op instead of its own route: an error, or a misbehaving handler."""


class Recorder:
    """Logs each control POST a participant receives, and can answer one op its own way (``Answer``)."""

    def __init__(
        self, app: ASGIApp, name: str, log: list[tuple[str, str]], fail: dict[str, Answer]
    ) -> None:
        self.app, self.name, self.log, self.fail = app, name, log, fail

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and scope["method"] == "POST" and path.startswith(CONTROL_PREFIX):
            op = path.rsplit("/", 1)[-1]
            self.log.append((self.name, op))
            if op in self.fail:
                answer = self.fail[op]
                handler = error_response(answer) if isinstance(answer, Exception) else answer
                await handler(scope, receive, send)  # type: ignore[arg-type]
                return
        await self.app(scope, receive, send)


@dataclass
class Mesh:
    config: CheckpointConfig
    servers: dict[str, MinimalServer] = field(default_factory=dict)
    log: list[tuple[str, str]] = field(default_factory=list)
    fail: dict[str, dict[str, Answer]] = field(default_factory=dict)

    def kind_of(self, name: str) -> str:
        return self.servers[name].participant.kind  # type: ignore[union-attr]

    def calls(self, op: str) -> list[str]:
        return [name for name, logged in self.log if logged == op]

    def coordinator(self, token: str = TOKEN, **kwargs: Any) -> Coordinator:
        apps: dict[str, Any] = {
            name: Recorder(s.app, name, self.log, self.fail.setdefault(name, {}))
            for name, s in self.servers.items()
        }
        apps["plain"] = create_app("plain")
        listing = [
            {"name": n, "type": "resources_servers", "implementation": "x", "url": f"http://{n}"}
            for n in apps
        ]
        apps["head"] = create_head_stub(listing)
        client = MeshClient(transport=MeshTransport(apps), retries=0)
        return Coordinator("http://head", token, client=client, **kwargs)

    def fresh(self) -> Mesh:
        """The same instances in new processes (nothing served, nothing restored)."""
        mesh = Mesh(self.config)
        for name in self.servers:
            mesh.servers[name] = create_minimal_server(name, self.config, kind=self.kind_of(name))
        return mesh


def make_mesh(config: CheckpointConfig) -> Mesh:
    mesh = Mesh(config)
    for kind in KINDS:
        mesh.servers[f"{kind}1"] = create_minimal_server(f"{kind}1", config, kind=kind)
    mesh.servers["resources2"] = create_minimal_server("resources2", config, kind="resources")
    return mesh


@pytest.fixture
async def mesh(config: CheckpointConfig) -> AsyncIterator[Mesh]:
    built = make_mesh(config)
    yield built
    for server in built.servers.values():
        await server.participant.aclose()  # type: ignore[union-attr]


def deadline(seconds: float = 30.0) -> float:
    return time.time() + seconds


def stages_in_order(mesh: Mesh, op: str) -> bool:
    """Each round of calls (one per participant) went stage by stage."""
    positions = [STAGE[op][mesh.kind_of(name)] for name in mesh.calls(op)]
    rounds = [
        positions[start : start + len(mesh.servers)] for start in range(0, len(positions), len(mesh.servers))
    ]
    return all(one == sorted(one) for one in rounds)


async def test_discovery_skips_servers_that_are_not_participants(mesh: Mesh) -> None:
    async with mesh.coordinator() as coordinator:
        found = await coordinator.discover()
        assert {p.name: p.kind for p in found} == {name: mesh.kind_of(name) for name in mesh.servers}
        assert found[0] == ParticipantRef(
            "environment1", "environment", "environment1", "http://environment1:80"
        )
        statuses = await coordinator.status()
        assert set(statuses) == set(mesh.servers) and {s["phase"] for s in statuses.values()} == {"idle"}


async def test_discovery_failures_are_errors_of_the_tree(mesh: Mesh) -> None:
    async with mesh.coordinator(token="wrong") as coordinator:
        with pytest.raises(Unauthorized, match="discovery"):
            await coordinator.discover()
    async with mesh.coordinator(required_kinds=("model", "judge")) as coordinator:
        with pytest.raises(Unavailable, match="judge"):
            await coordinator.discover()
    for answer in ([{"name": "x", "url": "http://x"}], "- a list\n- of yaml", "key: [unclosed", 7):
        head = create_app("head")
        head.add_api_route("/global_config_dict_yaml", _answering(answer), methods=["GET"])
        client = MeshClient(transport=MeshTransport({"head": head}), retries=0)
        async with Coordinator("http://head", TOKEN, client=client) as coordinator:
            with pytest.raises(UpstreamError, match="global_config_dict_yaml"):
                await coordinator.discover()


def _answering(answer: Any) -> Any:
    async def route() -> Any:
        return answer

    return route


async def test_a_full_cycle_in_protocol_order(mesh: Mesh, root: Path) -> None:
    mesh.servers["environment1"].adapter.put(RolloutIdentity("r1"), {"step": 2})
    mesh.servers["environment1"].adapter.put(RolloutIdentity("r2"), {"step": 1}, restart=True)
    mesh.servers["agent1"].adapter.put(RolloutIdentity("r1"), {"loop": [1, 2]})
    async with mesh.coordinator() as coordinator:
        prepared = await coordinator.prepare("c1", deadline_ts=deadline())
        assert prepared.prepared and prepared.restarts() == {"r2"}
        assert prepared.continued([RolloutIdentity("r1"), RolloutIdentity("r2")]) == [RolloutIdentity("r1")]
        assert stages_in_order(mesh, "prepare") and len(mesh.calls("prepare")) == 5
        committed = await coordinator.commit(
            "c1",
            deadline_ts=deadline(),
            checkpoint_dir=str(mesh.config.root / "ck"),
            episode_ids=prepared.continued([RolloutIdentity("r1")]),
        )
        assert set(committed.manifests()) == set(mesh.servers) and committed.episode_ids() == ["r1"]
        assert committed.staging_keys() == {}
        await coordinator.resume("c1", deadline_ts=deadline())
        assert stages_in_order(mesh, "resume") and len(mesh.calls("resume")) == 5
    assert {s.participant.phase for s in mesh.servers.values()} == {"idle"}  # type: ignore[union-attr]
    assert len(list((root / "ck").rglob("manifest.json"))) == 5


async def test_prepare_stops_at_the_first_stage_not_ready(mesh: Mesh) -> None:
    mesh.servers["model1"].adapter.set_busy(RolloutIdentity("streaming"), True)
    async with mesh.coordinator() as coordinator:
        result = await coordinator.prepare("c1", deadline_ts=deadline(1.0))
        assert not result.prepared and result.not_ready_stage == "model"
        assert mesh.calls("prepare") == ["environment1", "model1"]
        assert result.to_json()["participants"]["model1"]["report"]["blockers"] == ["streaming"]
        await coordinator.resume("c1", deadline_ts=deadline())
        assert stages_in_order(mesh, "resume") and len(mesh.calls("resume")) == 5
    agent = mesh.servers["agent1"].participant
    assert agent is not None
    with pytest.raises(StaleCheckpoint):  # the resume of an unknown id fenced it there too
        await agent.prepare(ControlRequest(checkpoint_id="c1", deadline_ts=deadline()))


async def test_a_commit_failure_fails_the_commit_and_names_the_participant(mesh: Mesh) -> None:
    mesh.fail["agent1"] = {"commit": InvalidCheckpointState("cannot export")}
    async with mesh.coordinator() as coordinator:
        await coordinator.prepare("c1", deadline_ts=deadline())
        with pytest.raises(InvalidCheckpointState, match="commit on agent1: cannot export") as caught:
            await coordinator.commit(
                "c1", deadline_ts=deadline(), checkpoint_dir=str(mesh.config.root / "ck")
            )
        result = caught.value.fields["result"]
        assert [o.participant.name for o in result.failures] == ["agent1"] and len(result.outcomes) == 5
        await coordinator.resume("c1", deadline_ts=deadline())


async def test_restore_continues_the_next_attempts(mesh: Mesh) -> None:
    mesh.servers["environment1"].adapter.put(RolloutIdentity("r1", 1), {"step": 3})
    mesh.servers["resources1"].adapter.put(RolloutIdentity("r1", 1), {"table": "t"})
    async with mesh.coordinator() as coordinator:
        await checkpoint(coordinator, "c1", str(mesh.config.root / "ck"))
    fresh = mesh.fresh()
    scope = [RolloutIdentity("r1", 1), RolloutIdentity("lost")]
    async with fresh.coordinator() as coordinator:
        result = await coordinator.restore(
            "r1", deadline_ts=deadline(), checkpoint_dir=str(mesh.config.root / "ck"), episode_ids=scope
        )
        assert result.restored() == {"r1-a2"}
        assert result.continued() == [RolloutIdentity("r1", 2)] and result.restarts() == [
            RolloutIdentity("lost")
        ]
        assert fresh.servers["resources1"].adapter.sessions["r1-a2"].state == {"table": "t"}
        await coordinator.resume("r1", deadline_ts=deadline())
    assert orjson.loads(orjson.dumps(result.to_json()))["continued"] == ["r1-a2"]


async def test_a_failed_restore_retires_the_next_attempts_resumes_everyone_and_raises(mesh: Mesh) -> None:
    mesh.servers["environment1"].adapter.put(RolloutIdentity("r1"), {"step": 3})
    async with mesh.coordinator() as coordinator:
        await checkpoint(coordinator, "c1", str(mesh.config.root / "ck"))
    fresh = mesh.fresh()
    fresh.fail["model1"] = {"restore": InvalidCheckpointState("lineage mismatch")}
    async with fresh.coordinator() as coordinator:
        with pytest.raises(InvalidCheckpointState, match="restore on model1: lineage mismatch"):
            await coordinator.restore(
                "r1",
                deadline_ts=deadline(),
                checkpoint_dir=str(mesh.config.root / "ck"),
                episode_ids=[RolloutIdentity("r1")],
            )
    for name, server in fresh.servers.items():
        status = server.participant.status()  # type: ignore[union-attr]
        assert (status["phase"], status["retired_rollouts"]) == ("idle", 1), name
    assert stages_in_order(fresh, "retire") and stages_in_order(fresh, "resume")
    with pytest.raises(Exception, match="retired"):
        await fresh.servers["environment1"].participant.admit(RolloutIdentity("r1", 1))  # type: ignore[union-attr]


async def test_resume_goes_on_past_failures_then_raises(mesh: Mesh) -> None:
    mesh.fail["agent1"] = {"resume": CheckpointConflict("confused")}
    async with mesh.coordinator() as coordinator:
        await coordinator.prepare("c1", deadline_ts=deadline())
        with pytest.raises(CheckpointConflict, match="resume on agent1") as caught:
            await coordinator.resume("c1", deadline_ts=deadline())
        assert len(caught.value.fields["result"].outcomes) == 5
    phases = {name: s.participant.phase for name, s in mesh.servers.items()}  # type: ignore[union-attr]
    assert phases == {**dict.fromkeys(mesh.servers, "idle"), "agent1": "prepared"}


async def test_retire_and_forget_go_callers_first_in_batches(mesh: Mesh) -> None:
    episodes = [RolloutIdentity(f"r{n}", 1) for n in range(1030)]
    async with mesh.coordinator() as coordinator:
        retired = await coordinator.retire(episodes, deadline_ts=deadline())
        assert len(retired.outcomes) == 10  # two batches of at most 1024, five participants each
        assert retired.checkpoint_id.startswith("retire-")
        assert stages_in_order(mesh, "retire")
        for server in mesh.servers.values():
            assert server.participant.status()["retired_rollouts"] == 1030  # type: ignore[union-attr]
        await coordinator.forget([e.rollout_id for e in episodes], deadline_ts=deadline(), checkpoint_id="f1")
        assert stages_in_order(mesh, "forget")
    assert {s.participant.status()["retired_rollouts"] for s in mesh.servers.values()} == {0}  # type: ignore[union-attr]


async def test_coordinator_spans(mesh: Mesh, otel: Otel) -> None:
    async with mesh.coordinator(telemetry=otel.telemetry.for_participant("controller", "coordinator")) as c:
        await checkpoint(c, "c1", str(mesh.config.root / "ck"))
    names = otel.span_names()
    for name in ("prepare", "prepare.environment", "prepare.resources", "commit", "resume"):
        assert f"gym.checkpoint.coordinate.{name}" in names
    span = next(s for s in otel.spans.get_finished_spans() if s.name == "gym.checkpoint.coordinate.commit")
    assert span.attributes["nemo.gym.checkpoint.participant_kind"] == "controller"
    assert span.attributes["nemo.gym.checkpoint.id"] == "c1"


async def checkpoint(coordinator: Coordinator, cid: str, directory: str) -> None:
    prepared = await coordinator.prepare(cid, deadline_ts=deadline())
    assert prepared.prepared
    await coordinator.commit(cid, deadline_ts=deadline(), checkpoint_dir=directory)
    await coordinator.resume(cid, deadline_ts=deadline())


Factory = Callable[[], Mesh]


async def test_every_commit_body_carries_stop_as_upstreams_does() -> None:
    bodies: list[dict[str, Any]] = []
    participant = create_app("p1")

    async def status() -> dict[str, Any]:
        return {"kind": "model", "instance": "p1", "phase": "prepared"}

    async def commit(request: Request) -> dict[str, Any]:
        bodies.append(await request.json())
        manifest = {"kind": "model", "instance": "p1", "checkpoint_id": bodies[-1]["checkpoint_id"], "record_count": 0}
        return {"phase": "committed", "manifest": manifest, "episode_ids": []}

    participant.add_api_route("/ng-control/v1/checkpoint/status", status, methods=["GET"])
    participant.add_api_route("/ng-control/v1/checkpoint/commit", commit, methods=["POST"])
    head = create_head_stub([{"name": "p1", "type": "responses_api_models", "implementation": "x", "url": "http://p1"}])
    client = MeshClient(transport=MeshTransport({"head": head, "p1": participant}), retries=0)
    async with Coordinator("http://head", TOKEN, client=client) as coordinator:
        await coordinator.commit("c1", deadline_ts=deadline(), checkpoint_dir="/d/c1")
        await coordinator.commit("c2", deadline_ts=deadline(), checkpoint_dir="/d/c2", stop=True,
                                 episode_ids=[RolloutIdentity("r", 2)])
    assert [body["stop"] for body in bodies] == [False, True]
    assert "episode_ids" not in bodies[0] and bodies[1]["episode_ids"] == [{"rollout_id": "r", "attempt": 2}]


async def test_a_commit_body_is_encoded_once_for_every_participant(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its scope names thousands of episodes: one encoding, the same bytes sent to all five."""
    scope = [RolloutIdentity(f"r{n}") for n in range(50)]
    encoded: list[Any] = []
    real_dumps = orjson.dumps

    def counting_dumps(value: Any, *args: Any, **kwargs: Any) -> bytes:
        if isinstance(value, dict) and {"episode_ids", "checkpoint_dir"} <= value.keys():  # a commit body
            encoded.append(value)
        return real_dumps(value, *args, **kwargs)

    monkeypatch.setattr(orjson, "dumps", counting_dumps)
    async with mesh.coordinator() as coordinator:
        await coordinator.prepare("c1", deadline_ts=deadline())
        committed = await coordinator.commit("c1", deadline_ts=deadline(), checkpoint_dir=str(mesh.config.root / "ck"),
                                             episode_ids=scope)
        await coordinator.resume("c1", deadline_ts=deadline())
    assert len(encoded) == 1 and len(encoded[0]["episode_ids"]) == 50
    assert set(committed.manifests()) == set(mesh.servers)
