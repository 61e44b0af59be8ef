"""Spans and metrics of docs/protocol.md section 9, read through the SDK's in-memory exporters."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from nemo_gym_ckpt.checkpoint.models import ControlRequest
from nemo_gym_ckpt.checkpoint.router import CONTROL_PREFIX
from nemo_gym_ckpt.checkpoint.telemetry import ATTR, METRIC, Telemetry
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.testing.clock import FakeClock

from .conftest import GRACE_S, Otel, ServerFactory, client_of, until

pytestmark = pytest.mark.unit


async def test_a_cycle_leaves_its_spans_and_metrics(
    make_server: ServerFactory, otel: Otel, clock: FakeClock, root: Path
) -> None:
    server = make_server(telemetry=otel.telemetry)
    server.adapter.put(RolloutIdentity("r1"), {"x": 1})
    later = clock.now() + 30
    async with client_of(server) as client:
        for op, extra in (("prepare", {}), ("renew", {}), ("commit", {"checkpoint_dir": str(root / "ck")}),
                          ("resume", {})):
            response = await client.post(
                f"{CONTROL_PREFIX}/{op}", json={"checkpoint_id": "c1", "deadline_ts": later, **extra}
            )
            assert response.status_code == 200, response.text
        assert (
            await client.post(f"{CONTROL_PREFIX}/prepare", json={"checkpoint_id": "c1", "deadline_ts": later})
        ).status_code == 409
        assert (
            await client.post(f"{CONTROL_PREFIX}/renew", json={"checkpoint_id": "c1", "deadline_ts": later})
        ).status_code == 409
        assert (
            await client.get(f"{CONTROL_PREFIX}/status", headers={"authorization": "Bearer x"})
        ).status_code == 401
    fresh = make_server(telemetry=otel.telemetry)
    async with client_of(fresh) as client:
        response = await client.post(
            f"{CONTROL_PREFIX}/restore",
            json={
                "checkpoint_id": "r1",
                "deadline_ts": later,
                "checkpoint_dir": str(root / "ck"),
                "episode_ids": [{"rollout_id": "r1"}],
            },
        )
        assert response.status_code == 200, response.text

    names = otel.span_names()
    for name in (
        "prepare",
        "wait_ready",
        "commit",
        "export",
        "write",
        "resume",
        "restore",
        "read",
        "install",
    ):
        assert f"gym.checkpoint.{name}" in names, name
    assert "gym.checkpoint.renew" not in names  # as upstream: a renew is not spanned
    spans = {span.name: span for span in otel.spans.get_finished_spans()}
    commit = spans["gym.checkpoint.commit"].attributes
    assert commit[ATTR.ID] == "c1" and commit[ATTR.KIND] == "resources" and commit[ATTR.PHASE] == "committed"
    assert commit[ATTR.INSTANCE] == "sessions"
    write = spans["gym.checkpoint.write"]
    assert write.attributes[ATTR.RECORDS] == 1 and write.attributes[ATTR.BYTES] > 0
    assert write.parent is not None and write.parent.span_id == spans["gym.checkpoint.commit"].context.span_id
    assert spans["gym.checkpoint.read"].attributes[ATTR.RECORDS] == 1

    outcomes = {
        (p.attributes[ATTR.OPERATION], p.attributes[ATTR.OUTCOME]) for p in otel.points(METRIC.DURATION)
    }
    assert outcomes == {  # upstream's outcomes: ok or error (the code is on the refused event); no renew
        ("prepare", "ok"),
        ("commit", "ok"),
        ("resume", "ok"),
        ("restore", "ok"),
        ("prepare", "error"),
    }
    records = {p.attributes[ATTR.OPERATION]: p.value for p in otel.points(METRIC.RECORDS)}
    assert records == {"commit": 1, "restore": 1}
    assert all(p.value > 0 for p in otel.points(METRIC.BYTES))
    events = {
        (p.attributes[ATTR.EVENT], p.attributes.get(ATTR.CODE)): p.value for p in otel.points(METRIC.EVENTS)
    }
    assert events == {("refused", "stale_checkpoint"): 2, ("refused", "unauthorized"): 1}


async def test_lease_expired_and_prepare_not_ready_are_events(
    make_server: ServerFactory, otel: Otel, clock: FakeClock
) -> None:
    server = make_server(telemetry=otel.telemetry)
    participant = server.participant
    assert participant is not None
    server.adapter.put(RolloutIdentity("r1"), {}).busy = True
    pending = asyncio.create_task(
        participant.prepare(ControlRequest(checkpoint_id="c1", deadline_ts=clock.now() + 2))
    )
    await until(lambda: participant.status()["report"] is not None)
    clock.advance(2)
    assert (await asyncio.wait_for(pending, 10))["report"]["ready"] is False
    clock.advance(GRACE_S)
    assert participant.status()["phase"] == "idle"
    assert participant.status()["phase"] == "idle"
    events = {p.attributes[ATTR.EVENT]: p.value for p in otel.points(METRIC.EVENTS)}
    assert events == {"prepare_not_ready": 1, "lease_expired": 1}


def test_without_an_sdk_telemetry_is_a_no_op() -> None:
    telemetry = Telemetry("agent", "a1")
    with telemetry.operation("prepare", "c1") as span:
        telemetry.event("refused", code="stale_checkpoint")
        assert not span.is_recording()
