"""The policy model as the checkpoint participant, in process over the scripted worker.

Admission, held replies, streams that block a prepare, the capture ledger across a restore, retire
and forget, the derived seed, and checkpointing off. Events are ordered by the scripted worker's
``started``/``gate`` events and by the participant's ``/status``, never by sleeping.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from model_servers.policy_model.chat_format import ChatFormat
from model_servers.policy_model.generation import MODEL_CALL_HEADER
from model_servers.policy_model.ids import call_seed, sha256_of
from model_servers.policy_model.tests.policy_harness import (
    TOKEN,
    PolicyHooks,
    chat_body,
    chat_url,
    ledger_records,
    serve_policy,
)
from model_servers.policy_model.tests.scripted_worker import Generate, ScriptedWorker
from nemo_gym_ckpt.checkpoint.router import CONTROL_PREFIX
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.conformance import Control, ParticipantUnderTest, expect_error, unique

pytestmark = pytest.mark.unit

WAIT_S = 10.0
R1, R2 = RolloutIdentity("r1"), RolloutIdentity("r2")


@dataclass
class Policy:
    http: httpx.AsyncClient
    control: Control
    clock: FakeClock
    worker: ScriptedWorker
    root: Path

    async def call(self, episode: RolloutIdentity | None, text: str, **extra: Any) -> httpx.Response:
        return await self.http.post(chat_url(episode), json=chat_body(text, **extra))

    async def extras(self) -> dict[str, Any]:
        extras: dict[str, Any] = (await self.control.status())["extras"]
        return extras

    async def until(self, condition: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """Poll ``/status`` until ``condition`` holds (a bounded wait for a state, not an ordering)."""
        deadline = time.monotonic() + WAIT_S
        while not condition(status := await self.control.status()):
            assert time.monotonic() < deadline, f"status never matched: {status}"
            await asyncio.sleep(0.002)
        return status

    async def checkpoint(self, cid: str, **commit: Any) -> list[dict[str, Any]]:
        """Prepare, commit and resume; the records written."""
        assert (await self.control.ok("prepare", checkpoint_id=cid))["report"]["ready"]
        committed = await self.control.ok("commit", checkpoint_id=cid, checkpoint_dir=unique(cid), **commit)
        await self.control.ok("resume", checkpoint_id=cid)
        return ledger_records(self.root, committed)


@pytest.fixture
def open_policy(fmt: ChatFormat, tokenizer_dir: Path, root: Path) -> Callable[..., Any]:
    @asynccontextmanager
    async def open_(**settings: Any) -> AsyncIterator[Policy]:
        worker = ScriptedWorker(fmt)
        worker.default = Generate("ok")
        clock = FakeClock(start=1_700_000_000.0)
        async with serve_policy(worker, tokenizer_dir, root=root, clock=clock, **settings) as http:
            pt = ParticipantUnderTest(http, TOKEN, root, now=clock.now, advance_clock=clock.advance)
            yield Policy(http, Control(pt), clock, worker, root)

    return open_


def streamed_text(body: bytes) -> str:
    """The content deltas of an SSE chat stream, joined."""
    events = [line[len(b"data: "):] for line in body.splitlines() if line.startswith(b"data: {")]
    deltas = (orjson.loads(event)["choices"] for event in events)
    return "".join(choices[0]["delta"].get("content") or "" for choices in deltas if choices)


# ---- checkpointing off ----------------------------------------------------------------------


async def test_nothing_is_mounted_when_off_and_replies_are_unchanged(
    fmt: ChatFormat, tokenizer_dir: Path, root: Path
) -> None:
    bodies = []
    workers = []
    for settings in ({"checkpoint_policy": True}, {"checkpoint_policy": False}):
        worker = ScriptedWorker(fmt)
        worker.default = Generate("same reply")
        async with serve_policy(worker, tokenizer_dir, root=None, **settings) as http:
            assert (await http.get(f"{CONTROL_PREFIX}/status")).status_code == 404
            for episode in (None, R1):
                reply = await http.post(chat_url(episode), json=chat_body("hi", return_token_ids=True))
                assert reply.status_code == 200, reply.text
                assert MODEL_CALL_HEADER not in reply.headers
                bodies.append({k: v for k, v in reply.json().items() if k != "created"})
        workers.append(worker.requests)
    assert bodies[:2] == bodies[2:]
    assert workers[0] == workers[1] and {request["seed"] for request in workers[0]} == {None}


async def test_a_model_server_that_is_not_the_policy_is_no_participant(
    fmt: ChatFormat, tokenizer_dir: Path, root: Path
) -> None:
    worker = ScriptedWorker(fmt)
    worker.default = Generate("judge")
    async with serve_policy(worker, tokenizer_dir, root=root, checkpoint_policy=False) as http:
        expect_error(await http.get(f"{CONTROL_PREFIX}/status"), "not_found", "status of a judge")
        assert (await http.post(chat_url(None), json=chat_body("hi"))).status_code == 200


# ---- admission ------------------------------------------------------------------------------


async def test_model_calls_need_a_rollout_identity(open_policy: Callable[..., Any]) -> None:
    async with open_policy() as policy:
        expect_error(await policy.call(None, "hi"), "rollout_id_required", "chat without identity")
        responses = await policy.http.post("/v1/responses", json={"model": "m", "input": "hi"})
        expect_error(responses, "rollout_id_required", "responses without identity")
        assert (await policy.http.get("/v1/models")).status_code == 200
        assert (await policy.call(R1, "hi")).status_code == 200
        assert policy.worker.capture_keys == ["r1"]


async def test_new_calls_wait_during_a_checkpoint_and_go_on_after_resume(
    open_policy: Callable[..., Any],
) -> None:
    async with open_policy() as policy:
        await policy.control.ok("prepare", checkpoint_id="c1")
        call = asyncio.create_task(policy.call(R1, "hi"))
        await policy.until(lambda s: s["waiting_requests"] == 1)
        assert policy.worker.requests == [] and not call.done()
        await policy.control.ok("resume", checkpoint_id="c1")
        reply = await asyncio.wait_for(call, WAIT_S)
        assert reply.status_code == 200, reply.text
        assert (await policy.extras())["rows"] == 1


# ---- held replies and streams ---------------------------------------------------------------


async def test_a_reply_finished_during_a_checkpoint_is_held_and_left_out(
    open_policy: Callable[..., Any],
) -> None:
    async with open_policy() as policy:
        first_reply = await policy.call(R1, "one", return_token_ids=True)
        first = first_reply.json()["choices"][0]["message"]
        started, gate = asyncio.Event(), asyncio.Event()
        policy.worker.will(Generate("two", started=started, gate=gate))
        call = asyncio.create_task(policy.call(R1, "two"))
        await asyncio.wait_for(started.wait(), WAIT_S)
        prepared = await policy.control.ok("prepare", checkpoint_id="c1")
        assert prepared["report"]["ready"] and prepared["report"]["counts"]["active_calls"] == 1
        gate.set()
        await policy.until(lambda s: s["extras"]["held_responses"] == 1)
        assert not call.done()
        committed = await policy.control.ok("commit", checkpoint_id="c1", checkpoint_dir=unique("c1"))
        [record] = ledger_records(policy.root, committed)
        await policy.control.ok("resume", checkpoint_id="c1")
        reply = await asyncio.wait_for(call, WAIT_S)
        assert reply.json()["choices"][0]["message"]["content"] == "two"
        assert (await policy.extras())["rows"] == 2
    [row] = record["ledger"]
    assert row == {
        "call_id": row["call_id"],
        "parent_call_id": None,
        "attempt": 0,
        "prompt_length": len(first["prompt_token_ids"]),
        "prompt_digest": sha256_of(first["prompt_token_ids"]),
        "output_length": len(first["generation_token_ids"]),
        "output_digest": sha256_of(first["generation_token_ids"]),
        "finish_reason": "stop",
        "policy_version": 7,
        "admitted_at": policy.clock.now(),
        "conversation_digest": row["conversation_digest"],
        "token_digest": hashlib.sha256(orjson.dumps({
            "call_id": row["call_id"], "prompt_token_ids": first["prompt_token_ids"],
            "generation_token_ids": first["generation_token_ids"],
            "generation_log_probs": first["generation_log_probs"]})).hexdigest(),
    }
    assert row["call_id"] == first_reply.headers[MODEL_CALL_HEADER] and row["call_id"].startswith("mc_")
    assert len(row["conversation_digest"]) == 64


async def test_a_stream_not_yet_delivered_is_held_whole(open_policy: Callable[..., Any]) -> None:
    async with open_policy() as policy:
        started, gate, headers = asyncio.Event(), asyncio.Event(), asyncio.Event()
        policy.worker.will(Generate("streamed", started=started, gate=gate, gate_first=True))

        async def read_stream() -> bytes:
            async with policy.http.stream("POST", chat_url(R1), json=chat_body("s", stream=True)) as response:
                headers.set()
                return await response.aread()

        stream = asyncio.create_task(read_stream())
        await asyncio.wait_for(started.wait(), WAIT_S)
        assert (await policy.control.ok("prepare", checkpoint_id="c1"))["report"]["ready"]
        gate.set()
        await policy.until(lambda s: s["extras"]["held_responses"] == 1)
        assert not headers.is_set()
        committed = await policy.control.ok("commit", checkpoint_id="c1", checkpoint_dir=unique("c1"))
        assert ledger_records(policy.root, committed) == []
        await policy.control.ok("resume", checkpoint_id="c1")
        body = await asyncio.wait_for(stream, WAIT_S)
        assert streamed_text(body) == "streamed" and body.endswith(b"data: [DONE]\n\n")
        assert (await policy.extras())["rows"] == 1


async def test_a_started_stream_blocks_prepare_until_it_drains(open_policy: Callable[..., Any]) -> None:
    async with open_policy() as policy:
        hooks = PolicyHooks(policy.worker)
        await hooks.block(policy.http, R1, True)
        deadline = policy.clock.now() + 5
        pending = asyncio.create_task(policy.control.ok("prepare", checkpoint_id="c1", deadline_ts=deadline))
        await policy.until(lambda s: s["report"] is not None)
        policy.clock.advance(6)
        report = (await asyncio.wait_for(pending, WAIT_S))["report"]
        assert (report["ready"], report["blockers"]) == (False, ["r1"])
        assert report["counts"]["delivering_streams"] == 1
        pending = asyncio.create_task(policy.control.ok("prepare", checkpoint_id="c1"))
        await hooks.block(policy.http, R1, False)
        assert (await asyncio.wait_for(pending, WAIT_S))["report"]["ready"]
        committed = await policy.control.ok("commit", checkpoint_id="c1", checkpoint_dir=unique("c1"))
        [record] = ledger_records(policy.root, committed)
        assert [row["call_id"] for row in record["ledger"]] == hooks.call_ids


# ---- the ledger across a restore ------------------------------------------------------------


async def test_the_lineage_goes_on_under_the_next_attempt_in_a_fresh_app(
    open_policy: Callable[..., Any],
) -> None:
    async with open_policy() as first:
        for text in ("one", "two"):
            assert (await first.call(R1, text)).status_code == 200
        assert (await first.call(R2, "other")).status_code == 200
        records = await first.checkpoint("c1")
    rows = {record["episode_id"]["rollout_id"]: record["ledger"] for record in records}
    assert [row["parent_call_id"] for row in rows["r1"]] == [None, rows["r1"][0]["call_id"]]
    async with open_policy() as fresh:
        restored = await fresh.control.ok("restore", checkpoint_id="back", checkpoint_dir=str(
            ledger_dir(first.root, "c1")), episode_ids=[R1.to_json(), R2.to_json()])
        assert restored["restored"] == ["r1-a1", "r2-a1"]
        await fresh.control.ok("resume", checkpoint_id="back")
        next_attempt = R1.next_attempt()
        unchanged = await fresh.checkpoint("c2", episode_ids=[next_attempt.to_json()])
        assert unchanged == [{"episode_id": next_attempt.to_json(), "ledger": rows["r1"]}]
        assert (await fresh.extras())["ledgers"] == 1  # r2-a1, restored and left out, is dropped
        assert (await fresh.call(next_attempt, "three")).status_code == 200
        [record] = await fresh.checkpoint("c3", episode_ids=[next_attempt.to_json()])
        assert (await fresh.extras())["ledgers"] == 1
    assert record["ledger"][:2] == rows["r1"]
    third = record["ledger"][2]
    assert (third["parent_call_id"], third["attempt"]) == (rows["r1"][1]["call_id"], 1)


def ledger_dir(root: Path, cid: str) -> Path:
    """The directory of the checkpoint ``Policy.checkpoint(cid)`` committed."""
    [manifest] = [path for path in root.glob(f"{cid}-*/gym/model/*/manifest.json")]
    return manifest.parents[3]


async def test_a_call_without_seed_gets_one_from_its_rollout_and_prompt(
    open_policy: Callable[..., Any],
) -> None:
    async with open_policy() as policy:
        for episode, extra in ((R1, {}), (R1.next_attempt(), {}), (R2, {}), (R1, {"seed": 5})):
            assert (await policy.call(episode, "same words", **extra)).status_code == 200
    seeds = [request["seed"] for request in policy.worker.requests]
    prompt = policy.worker.requests[0]["prompt"]
    assert seeds[0] == seeds[1] == call_seed("r1", sha256_of(prompt))
    assert seeds[2] == call_seed("r2", sha256_of(prompt)) != seeds[0]
    assert seeds[3] == 5


# ---- retire and forget ----------------------------------------------------------------------


async def test_retire_is_cumulative(open_policy: Callable[..., Any]) -> None:
    attempts = [RolloutIdentity("r1", n) for n in range(3)]
    async with open_policy() as policy:
        for episode in (*attempts, R2):
            assert (await policy.call(episode, "hi")).status_code == 200
        retired = await policy.control.ok("retire", checkpoint_id="h1", episode_ids=[attempts[1].to_json()])
        assert retired == {"retired": ["r1-a1"]}
        expect_error(await policy.call(attempts[1], "hi"), "stale_attempt", "a call of a retired attempt")
        records = await policy.checkpoint("c1")
    assert sorted(episode_of(record).capture_key for record in records) == ["r1-a2", "r2"]


def episode_of(record: dict[str, Any]) -> RolloutIdentity:
    return RolloutIdentity(record["episode_id"]["rollout_id"], record["episode_id"]["attempt"])


async def test_retire_is_refused_while_a_checkpoint_is_open(open_policy: Callable[..., Any]) -> None:
    async with open_policy() as policy:
        assert (await policy.call(R1, "hi")).status_code == 200
        await policy.control.ok("prepare", checkpoint_id="c1")
        scope = [R1.to_json()]
        await policy.control.refused("invalid_phase", "retire", checkpoint_id="c1", episode_ids=scope)
        assert (await policy.extras())["ledgers"] == 1
        await policy.control.ok("resume", checkpoint_id="c1")
        await policy.control.ok("retire", checkpoint_id="h1", episode_ids=[R1.to_json()])
        assert (await policy.extras())["ledgers"] == 0


async def test_retire_stops_a_call_in_flight_and_forget_leaves_nothing(
    open_policy: Callable[..., Any],
) -> None:
    async with open_policy() as policy:
        assert (await policy.call(R2, "done")).status_code == 200
        started = asyncio.Event()
        policy.worker.will(Generate("never", started=started, gate=asyncio.Event()))
        call = asyncio.create_task(policy.call(R1, "long"))
        await asyncio.wait_for(started.wait(), WAIT_S)
        await policy.control.ok("retire", checkpoint_id="h1", episode_ids=[R1.to_json()])
        expect_error(await asyncio.wait_for(call, WAIT_S), "stale_attempt", "the call of a retired attempt")
        assert (await policy.extras())["active_calls"] == 0
        await policy.control.ok("forget", checkpoint_id="h2", rollout_ids=["r1", "r2"])
        status = await policy.control.status()
    assert status["retired_rollouts"] == 0 and status["waiting_requests"] == 0
    counts = {key: status["extras"][key] for key in ("ledgers", "rows", "held_responses", "active_calls")}
    assert counts == {"ledgers": 0, "rows": 0, "held_responses": 0, "active_calls": 0}


async def test_status_declares_the_policy_and_generation_cuts(open_policy: Callable[..., Any]) -> None:
    async with open_policy(generation_cuts=True) as policy:
        status = await policy.control.status()
    assert status["kind"] == "model"
    assert status["extras"] == {"checkpoint_policy": True, "generation_cuts": True, "active_calls": 0,
                                "held_responses": 0, "delivering_streams": 0, "ledgers": 0, "rows": 0,
                                  "token_bytes_in_memory": 0, "token_lines_spilled": 0}


async def test_retire_stops_a_stream_being_delivered(open_policy: Callable[..., Any]) -> None:
    async with open_policy() as policy:
        gate, headers = asyncio.Event(), asyncio.Event()
        policy.worker.will(Generate("a long stream", gate=gate))

        async def read_stream() -> bytes:
            async with policy.http.stream("POST", chat_url(R1), json=chat_body("s", stream=True)) as response:
                headers.set()
                return await response.aread()

        stream = asyncio.create_task(read_stream())
        await asyncio.wait_for(headers.wait(), WAIT_S)
        scope = [R1.to_json()]
        retire = asyncio.create_task(policy.control.ok("retire", checkpoint_id="h1", episode_ids=scope))
        await policy.until(lambda s: s["retired_rollouts"] == 1)
        gate.set()
        body = await asyncio.wait_for(stream, WAIT_S)
        assert (await asyncio.wait_for(retire, WAIT_S)) == {"retired": ["r1"]}
        assert b'"code":"stale_attempt"' in body and not body.endswith(b"data: [DONE]\n\n")
        assert (await policy.extras())["ledgers"] == 0


async def test_a_stream_stopped_by_a_retire_past_its_deadline_stays_stopped_after_a_forget(
    open_policy: Callable[..., Any],
) -> None:
    """The forget clears the retire mark, but the call the retire stopped still answers
    ``stale_attempt`` at its next event and writes no row (no ledger comes back)."""
    async with open_policy() as policy:
        gate, headers = asyncio.Event(), asyncio.Event()
        policy.worker.will(Generate("a long stream", gate=gate))

        async def read_stream() -> bytes:
            async with policy.http.stream("POST", chat_url(R1), json=chat_body("s", stream=True)) as response:
                headers.set()
                return await response.aread()

        stream = asyncio.create_task(read_stream())
        await asyncio.wait_for(headers.wait(), WAIT_S)
        retire = asyncio.create_task(policy.control.send("retire", {
            "checkpoint_id": "h1", "episode_ids": [R1.to_json()], "deadline_ts": policy.clock.now() + 1.0}))
        await policy.until(lambda s: s["retired_rollouts"] == 1)
        policy.clock.advance(2.0)  # the retire's wait for the stream runs past its deadline
        expect_error(await asyncio.wait_for(retire, WAIT_S), "deadline_exceeded", "a retire past its deadline")
        await policy.control.ok("forget", checkpoint_id="h2", rollout_ids=["r1"])
        assert (await policy.control.status())["retired_rollouts"] == 0
        gate.set()
        body = await asyncio.wait_for(stream, WAIT_S)
        extras = await policy.extras()
    assert b'"code":"stale_attempt"' in body and not body.endswith(b"data: [DONE]\n\n")
    assert {key: extras[key] for key in ("ledgers", "rows", "active_calls")} == {
        "ledgers": 0, "rows": 0, "active_calls": 0}
