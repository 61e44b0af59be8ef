"""The coordinator against participants that answer badly: a 200 reply of the wrong shape, a call that
fails outside the error tree, a status of no participant (docs/protocol.md sections 3 and 5). Each is
that participant's ``UpstreamError``, naming the field; the other participants' calls run to their end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from nemo_gym_ckpt.checkpoint.coordinator import Coordinator
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.collect.control import CollectionControl, ControlSettings
from nemo_gym_ckpt.collect.published import RunIdentity
from nemo_gym_ckpt.config import CheckpointConfig
from nemo_gym_ckpt.errors import UpstreamError
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.server import create_app
from nemo_gym_ckpt.testing.conformance import MeshTransport
from nemo_gym_ckpt.testing.minimal import create_head_stub

from .conftest import TOKEN
from .test_coordinator import Mesh, checkpoint, deadline, make_mesh

pytestmark = pytest.mark.unit


@pytest.fixture
async def mesh(config: CheckpointConfig) -> AsyncIterator[Mesh]:
    built = make_mesh(config)
    yield built
    for server in built.servers.values():
        await server.participant.aclose()  # type: ignore[union-attr]


def answering(body: Any, headers: dict[str, str] | None = None) -> ASGIApp:
    """A handler answering 200 with ``body`` (JSON, or these bytes as they are)."""
    content = body if isinstance(body, bytes) else orjson.dumps(body)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await Response(content, media_type="application/json", headers=headers)(scope, receive, send)

    return app


AGENT1_MANIFEST = {"schema_version": 1, "kind": "agent", "instance": "agent1", "checkpoint_id": "c1",
                   "records_file": "records.jsonl", "records_sha256": "0" * 64, "record_count": 0}


def committed(**changes: Any) -> dict[str, Any]:
    """agent1's commit reply, with ``changes`` (a ``manifest`` entry: changes to the manifest)."""
    reply = {"phase": "committed", "episode_ids": [], **changes}
    reply["manifest"] = {**AGENT1_MANIFEST, **changes.get("manifest", {})}
    return reply


READY = {"ready": True, "blockers": [], "blocker_count": 0, "counts": {}, "restarts": []}


@pytest.mark.parametrize(("reply", "problem"), [
    ({"phase": "prepared"}, "its report is missing, expected an object"),
    ({"phase": "preparing", "report": {**READY, "ready": "no"}}, "its report.ready is 'no', expected true or false"),
    ({"phase": "prepared", "report": {**READY, "ready": False}},
     "its phase is 'prepared' but its report.ready is false"),
    ({"phase": "idle", "report": READY}, "its phase is 'idle', expected 'prepared' or 'preparing'"),
    ({"phase": "prepared", "report": {**READY, "restarts": "r1"}}, "its report.restarts is 'r1', expected a list"),
    ({"phase": "prepared", "report": {**READY, "restarts": ["r1", 7]}},
     r"its report.restarts\[1\] is 7, expected a string"),
])
async def test_a_prepare_reply_of_the_wrong_shape_fails_the_prepare(mesh: Mesh, reply: Any, problem: str) -> None:
    mesh.fail["model1"] = {"prepare": answering(reply)}
    async with mesh.coordinator() as coordinator:
        with pytest.raises(UpstreamError, match=f"prepare on model1: prepare reply of model1: {problem}"):
            await coordinator.prepare("c1", deadline_ts=deadline())
        await coordinator.resume("c1", deadline_ts=deadline())
    assert mesh.calls("prepare") == ["environment1", "model1"]


@pytest.mark.parametrize("report", [None, {**READY, "restarts": ["r9"]}])
async def test_a_prepare_answered_preparing_is_not_ready_whatever_its_report(mesh: Mesh, report: Any) -> None:
    """``preparing``: the deadline came first; its report is null (none made yet) or the last one, which
    may say ready (an earlier checkpoint's): not ready either way."""
    mesh.fail["model1"] = {"prepare": answering({"phase": "preparing", "report": report})}
    async with mesh.coordinator() as coordinator:
        result = await coordinator.prepare("c1", deadline_ts=deadline())
        assert (result.prepared, result.not_ready_stage) == (False, "model")
        assert result.restarts() == (set() if report is None else {"r9"})
        await coordinator.resume("c1", deadline_ts=deadline())


@pytest.mark.parametrize(("reply", "problem"), [
    ({}, "its phase is missing, expected 'committed'"),
    (committed(phase="preparing"), "its phase is 'preparing', expected 'committed'"),
    (committed(manifest={"checkpoint_id": "OLD"}), "its manifest.checkpoint_id is 'OLD', expected 'c1'"),
    (committed(manifest={"instance": "agent2"}), "its manifest.instance is 'agent2', expected 'agent1'"),
    (committed(manifest={"kind": "model"}), "its manifest.kind is 'model', expected 'agent'"),
    (committed(manifest={"record_count": True}), "its manifest.record_count is True, expected an integer"),
    (committed(manifest={"record_count": "3"}), "its manifest.record_count is '3', expected an integer"),
    (committed(manifest={"record_count": -1}), "its manifest.record_count is -1, expected an integer, 0 or more"),
    ({"phase": "committed", "manifest": "m", "episode_ids": []}, "its manifest is 'm', expected an object"),
    (committed(episode_ids="r1"), "its episode_ids is 'r1', expected a list of strings"),
    (committed(episode_ids=["r1", None]), r"its episode_ids\[1\] is None, expected a string"),
    (committed(staging_keys=[1]), r"its staging_keys\[0\] is 1, expected a string"),
])
async def test_a_commit_reply_of_the_wrong_shape_fails_the_commit(mesh: Mesh, reply: Any, problem: str) -> None:
    mesh.fail["agent1"] = {"commit": answering(reply)}
    async with mesh.coordinator() as coordinator:
        assert (await coordinator.prepare("c1", deadline_ts=deadline())).prepared
        with pytest.raises(UpstreamError, match=f"commit on agent1: commit reply of agent1: {problem}") as caught:
            await coordinator.commit("c1", deadline_ts=deadline(), checkpoint_dir=str(mesh.config.root / "ck"))
        assert [o.participant.name for o in caught.value.fields["result"].failures] == ["agent1"]
        await coordinator.resume("c1", deadline_ts=deadline())


async def test_a_good_commit_reply_passes(mesh: Mesh) -> None:
    """The fakes above differ from a reply that passes only in what they name."""
    mesh.fail["agent1"] = {"commit": answering(committed(episode_ids=["r1"], staging_keys=[]))}
    async with mesh.coordinator() as coordinator:
        await coordinator.prepare("c1", deadline_ts=deadline())
        result = await coordinator.commit("c1", deadline_ts=deadline(), checkpoint_dir=str(mesh.config.root / "ck"))
        assert result.manifests()["agent1"]["checkpoint_id"] == "c1" and result.episode_ids() == ["r1"]
        await coordinator.resume("c1", deadline_ts=deadline())


@pytest.mark.parametrize(("reply", "problem"), [
    ({"phase": "restored", "source_checkpoint_id": "c1", "restored": "r1-a1"},
     "its restored is 'r1-a1', expected a list of strings"),
    ({"phase": "restored", "source_checkpoint_id": "c1"}, "its restored is missing, expected a list of strings"),
    ({"phase": "restored", "restored": [1]}, r"its restored\[0\] is 1, expected a string"),
    ({"phase": "idle", "restored": []}, "its phase is 'idle', expected 'restored'"),
])
async def test_a_restore_reply_of_the_wrong_shape_fails_the_restore_and_undoes_it(
    mesh: Mesh, reply: Any, problem: str
) -> None:
    mesh.servers["environment1"].adapter.put(RolloutIdentity("r1"), {"step": 3})
    async with mesh.coordinator() as coordinator:
        await checkpoint(coordinator, "c1", str(mesh.config.root / "ck"))
    fresh = mesh.fresh()
    fresh.fail["environment1"] = {"restore": answering(reply)}
    async with fresh.coordinator() as coordinator:
        with pytest.raises(UpstreamError, match=f"restore on environment1: restore reply of environment1: {problem}"):
            await coordinator.restore("r1", deadline_ts=deadline(), checkpoint_dir=str(mesh.config.root / "ck"),
                                      episode_ids=[RolloutIdentity("r1")])
    for name, server in fresh.servers.items():  # the next attempts retired, everyone resumed
        status = server.participant.status()  # type: ignore[union-attr]
        assert (status["phase"], status["retired_rollouts"]) == ("idle", 1), name
    for server in fresh.servers.values():
        await server.participant.aclose()  # type: ignore[union-attr]


def failing_then(answered: asyncio.Event, how: str) -> ASGIApp:
    """A participant's handler that lets ``answered`` go, then fails outside the error tree: it raises
    (a bug: the in-process transport passes the app's exception on) or answers bytes that are not gzip."""
    garbled = answering(b'{"phase": "committed"}', headers={"content-encoding": "gzip"})

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        answered.set()
        if how == "raises":
            raise RuntimeError("a bug in the call")
        await garbled(scope, receive, send)

    return app


def after(event: asyncio.Event, app: ASGIApp) -> ASGIApp:
    """``app``, once ``event`` is set: its call is still in flight when another participant fails."""

    async def gated(scope: Scope, receive: Receive, send: Send) -> None:
        await event.wait()
        await app(scope, receive, send)

    return gated


@pytest.mark.parametrize(("how", "named"), [
    ("raises", "RuntimeError: a bug in the call"),
    ("garbled", "DecodingError"),
])
async def test_one_participant_failing_outside_the_error_tree_cancels_no_other_call(
    mesh: Mesh, how: str, named: str, caplog: pytest.LogCaptureFixture
) -> None:
    answered = asyncio.Event()
    mesh.fail["agent1"] = {"commit": failing_then(answered, how)}
    mesh.fail["environment1"] = {"commit": after(answered, mesh.servers["environment1"].app)}
    directory = mesh.config.root / "ck"
    async with mesh.coordinator() as coordinator:
        await coordinator.prepare("c1", deadline_ts=deadline())
        with pytest.raises(UpstreamError, match=f"commit on agent1: .*{named}") as caught:
            await coordinator.commit("c1", deadline_ts=deadline(), checkpoint_dir=str(directory))
        result = caught.value.fields["result"]
        assert [o.participant.name for o in result.failures] == ["agent1"] and len(result.outcomes) == 5
        assert mesh.servers["environment1"].participant.phase == "committed"  # type: ignore[union-attr]
        await coordinator.resume("c1", deadline_ts=deadline())
    assert (directory / "gym" / "environment" / "environment1" / "manifest.json").is_file()
    if how == "raises":
        assert "commit on agent1 failed with RuntimeError" in caplog.text


def participant_answering_status(status: dict[str, Any]) -> Coordinator:
    app = create_app("p1")

    async def route() -> dict[str, Any]:
        return status

    app.add_api_route("/ng-control/v1/checkpoint/status", route, methods=["GET"])
    head = create_head_stub([{"name": "p1", "type": "responses_api_agents", "implementation": "x", "url": "http://p1"}])
    client = MeshClient(transport=MeshTransport({"head": head, "p1": app}), retries=0)
    return Coordinator("http://head", TOKEN, client=client)


@pytest.mark.parametrize(("status", "problem"), [
    ({"kind": "Agent", "instance": "p1"}, "kind 'Agent' is none of environment, model, agent, resources"),
    ({"kind": "judge", "instance": "p1"}, "kind 'judge' is none of"),
    ({"kind": "agent", "instance": "../p1"}, "instance '../p1' is not an instance name"),
    ({"kind": "agent"}, "no string kind and instance"),
])
async def test_discovery_refuses_a_status_that_names_no_participant(status: dict[str, Any], problem: str) -> None:
    async with participant_answering_status(status) as coordinator:
        expected = f"discovery: p1: checkpoint status is not a participant status: {problem}"
        with pytest.raises(UpstreamError, match=expected):
            await coordinator.discover()


async def test_discovery_refuses_two_servers_answering_as_one_participant(mesh: Mesh) -> None:
    """Two entries of the config at one server: each op would reach that participant twice."""
    apps: dict[str, Any] = {name: server.app for name, server in mesh.servers.items()}
    listing = [{"name": name, "type": "t", "implementation": "i", "url": f"http://{name}"} for name in apps]
    listing.append({"name": "agent1_again", "type": "t", "implementation": "i", "url": "http://agent1"})
    apps["head"] = create_head_stub(listing)
    client = MeshClient(transport=MeshTransport(apps), retries=0)
    async with Coordinator("http://head", TOKEN, client=client) as coordinator:
        with pytest.raises(UpstreamError, match=r"agent1 \(http://agent1:80\) and agent1_again \(http://agent1:80\) "
                                                r"both answer as agent 'agent1'"):
            await coordinator.discover()


@pytest.mark.parametrize(("name", "op", "reply"), [
    ("agent1", "commit", {}),
    ("environment1", "prepare", {"phase": "prepared"}),
])
async def test_the_collector_does_not_publish_a_checkpoint_a_participant_answered_badly_and_resumes(
    mesh: Mesh, name: str, op: str, reply: Any
) -> None:
    mesh.fail[name] = {op: answering(reply)}
    coordinator = mesh.coordinator()
    settings = ControlSettings(mesh.config.root / "collect", RunIdentity("a" * 64, "b" * 64, 1), timeout_s=10)
    control = CollectionControl(coordinator, settings)
    async with coordinator:
        await coordinator.discover()
        assert await control.checkpoint(lambda: [], lambda: 0) is None
    assert not list((mesh.config.root / "collect").glob("*/collection.json")) and control.published == []
    assert sorted(mesh.calls("resume")) == sorted(mesh.servers)
    assert {s.participant.phase for s in mesh.servers.values()} == {"idle"}  # type: ignore[union-attr]
