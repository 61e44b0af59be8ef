"""Generation cuts on the policy model's side, in process over the scripted worker, with a fake clock.

The commit cuts the latest generating call of each episode in scope (half of the remaining
deadline), records each durable cut in the episode's record (coordinates and digests only),
answers the kept staging keys and settles them with the worker (in the background: the reply does
not wait for it); a failed or late cut never fails the checkpoint. After a restore, the re-issued
call with the same conversation continues from its staged prefix; nothing else does.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest

from model_servers.policy_model.chat_format import ChatFormat
from model_servers.policy_model.generation import MODEL_CALL_HEADER
from model_servers.policy_model.ids import sha256_of
from model_servers.policy_model.tests.policy_harness import TOKEN, ledger_records, serve_policy
from model_servers.policy_model.tests.scripted_worker import (
    Generate,
    ScriptedWorker,
    WorkerFails,
    staging_key,
    upstream_digest,
)
from model_servers.policy_model.tests.test_checkpoint_policy import WAIT_S, Policy, ledger_dir
from nemo_gym_ckpt.checkpoint.records import TOKEN_ARRAY_KEYS
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.conformance import Control, ParticipantUnderTest, unique

pytestmark = pytest.mark.unit

R1, R2, R3 = RolloutIdentity("r1"), RolloutIdentity("r2"), RolloutIdentity("r3")
CUTS = {"generation_cuts": True}
OpenPolicy = Callable[..., AbstractAsyncContextManager[Policy]]


@pytest.fixture
def policies(fmt: ChatFormat, tokenizer_dir: Path, root: Path) -> OpenPolicy:
    """``async with policies(**settings) as policy``: a fresh policy app over a fresh scripted worker."""

    @asynccontextmanager
    async def open_(**settings: Any) -> AsyncIterator[Policy]:
        worker = ScriptedWorker(fmt)
        worker.default = Generate("ok")
        clock = FakeClock(start=1_700_000_000.0)
        async with serve_policy(worker, tokenizer_dir, root=root, clock=clock, **settings) as http:
            pt = ParticipantUnderTest(http, TOKEN, root, now=clock.now, advance_clock=clock.advance)
            yield Policy(http, Control(pt), clock, worker, root)

    return open_


async def in_flight(
    policy: Policy, episode: RolloutIdentity, text: str, **extra: Any
) -> tuple[asyncio.Task[Any], asyncio.Event]:
    """A call of ``episode`` that reached the worker and is still generating (until the gate)."""
    started, gate = asyncio.Event(), asyncio.Event()
    policy.worker.will(Generate(text, started=started, gate=gate))
    task = asyncio.create_task(policy.call(episode, text, **extra))
    await asyncio.wait_for(started.wait(), WAIT_S)
    return task, gate


async def commit(policy: Policy, cid: str, seconds: float = 30.0, **extra: Any) -> dict[str, Any]:
    assert (await policy.control.ok("prepare", checkpoint_id=cid))["report"]["ready"]
    deadline = policy.clock.now() + seconds
    return await policy.control.ok("commit", checkpoint_id=cid, checkpoint_dir=unique(cid),
                                   deadline_ts=deadline, **extra)


async def keeps(policy: Policy, count: int) -> list[dict[str, Any]]:
    """The keep requests the worker got, once it got ``count`` of them (a bounded wait)."""
    deadline = time.monotonic() + WAIT_S
    while len(policy.worker.keep_requests) < count:
        assert time.monotonic() < deadline, f"{count} keeps never came: {policy.worker.keep_requests}"
        await asyncio.sleep(0.002)
    return [keep for _, keep in policy.worker.keep_requests]


def assert_staging_keys_by_episode(committed: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """NeMo RL's adapter check of a model commit reply, against the records the model wrote: one
    entry per exported record (capture key of its episode_id), each list sorted and the staging keys
    of that record's cut, the union equal to ``staging_keys`` (sorted, unique)."""
    by_episode = committed["staging_keys_by_episode"]
    keys = [(r["episode_id"]["rollout_id"], r["episode_id"]["attempt"]) for r in records]
    capture = {rid if attempt == 0 else f"{rid}-a{attempt}" for rid, attempt in keys}
    assert set(by_episode) == capture == set(committed["episode_ids"])
    for record in records:
        rid, attempt = record["episode_id"]["rollout_id"], record["episode_id"]["attempt"]
        expected = sorted(record["cut"]["staging_keys"]) if "cut" in record else []
        assert by_episode[rid if attempt == 0 else f"{rid}-a{attempt}"] == expected
    union = sorted({key for keys_ in by_episode.values() for key in keys_})
    assert committed["staging_keys"] == union and all(v == sorted(v) for v in by_episode.values())


def no_token_arrays(records: list[dict[str, Any]]) -> bool:
    text = orjson.dumps(records).decode()
    return not any(f'"{key}"' in text for key in TOKEN_ARRAY_KEYS)


async def test_commit_cuts_the_calls_in_flight_and_records_them(policies: OpenPolicy) -> None:
    async with policies(**CUTS) as policy:
        first = await policy.call(R1, "one")
        r1_call, r1_gate = await in_flight(policy, R1, "two")
        r2_call, r2_gate = await in_flight(policy, R2, "first of r2")
        r3_call, r3_gate = await in_flight(policy, R3, "out of scope")
        committed = await commit(policy, "c1", episode_ids=[R1.to_json(), R2.to_json()])
        records = ledger_records(policy.root, committed)
        await policy.control.ok("resume", checkpoint_id="c1")
        for gate in (r1_gate, r2_gate, r3_gate):
            gate.set()
        replies = [await asyncio.wait_for(call, WAIT_S) for call in (r1_call, r2_call, r3_call)]
        await keeps(policy, 1)
    [(auth, cut)] = policy.worker.cut_requests
    by_key = {r["episode_id"]["rollout_id"]: r for r in records}
    sent = {entry["rollout_id"]: entry for entry in cut["active_prefixes"]}
    assert auth == f"Bearer {TOKEN}" and set(sent) == {"r1", "r2"}  # r3 is out of the commit's scope
    # upstream's inventory, field for field: its keys, prefixes sorted by ticket, upstream's digest
    assert set(cut) == {"checkpoint_id", "server_name", "active_prefixes", "inventory_digest"}
    tickets = [entry["ticket_id"] for entry in cut["active_prefixes"]]
    assert tickets == sorted(tickets) and all(isinstance(e["admitted_at"], float) for e in sent.values())
    assert cut["inventory_digest"] == upstream_digest("c1", "policy_model", cut["active_prefixes"])
    assert cut["server_name"] == "policy_model"
    assert sent["r1"]["model_call_id"] == replies[0].headers[MODEL_CALL_HEADER]
    r1_cut, r2_cut = by_key["r1"]["cut"], by_key["r2"]["cut"]
    assert r1_cut == {
        "source_call_id": sent["r1"]["model_call_id"], "conversation_digest": r1_cut["conversation_digest"],
        "parent_call_id": first.headers[MODEL_CALL_HEADER], "previous_length": 1, "cut_kind": "active_prefix",
        "staging_keys": [staging_key(sent["r1"]["model_call_id"], "c1")], "prefix_token_count": 5,
        "prefix_digest": sha256_of([0, 1, 2, 3, 4]), "effective_output_limit": 100,
        "terminal_finish_reason": None,
    }
    assert by_key["r2"]["ledger"] == [] and (r2_cut["parent_call_id"], r2_cut["previous_length"]) == (None, 0)
    assert committed["staging_keys"] == sorted([*r1_cut["staging_keys"], *r2_cut["staging_keys"]])
    assert_staging_keys_by_episode(committed, records)
    assert committed["staging_keys_by_episode"] == {"r1": r1_cut["staging_keys"], "r2": r2_cut["staging_keys"]}
    [(_, keep)] = policy.worker.keep_requests
    assert keep == {"checkpoint_id": "c1", "server_name": "policy_model",
                    "staging_keys": committed["staging_keys"]}
    assert no_token_arrays(records) and all(reply.status_code == 200 for reply in replies)


async def test_calls_name_themselves_and_their_lineage_only_with_cuts_on(policies: OpenPolicy) -> None:
    async with policies(**CUTS) as policy:
        first = await policy.call(R1, "one")
        second = await policy.call(R1, "two")
    async with policies() as plain:
        await plain.call(R1, "one")
    calls = [request["model_call"] for request in policy.worker.requests]
    assert calls == [
        {"model_call_id": first.headers[MODEL_CALL_HEADER], "parent_call_id": None, "previous_length": 0},
        {"model_call_id": second.headers[MODEL_CALL_HEADER],
         "parent_call_id": first.headers[MODEL_CALL_HEADER], "previous_length": 1},
    ]
    assert "model_call" not in plain.worker.requests[0] and "continuation" not in policy.worker.requests[0]


@pytest.mark.parametrize("failure", ["error", "late", "refused", "inventory", "missing_ticket", "identity"])
async def test_a_failed_or_late_cut_never_fails_the_checkpoint(
    policies: OpenPolicy, failure: str
) -> None:
    async with policies(**CUTS) as policy:
        assert (await policy.call(R1, "delivered")).status_code == 200
        call, gate = await in_flight(policy, R1, "long")
        if failure == "error":
            policy.worker.cuts.fail = WorkerFails(503, {"error": {"code": "unavailable", "detail": "down"}})
        elif failure == "late":
            policy.worker.cuts.gate = asyncio.Event()  # never set: the cut outlives its half of the deadline
        elif failure == "refused":
            policy.worker.cuts.refuse.add(policy.worker.requests[-1]["model_call"]["model_call_id"])
        else:  # a receipt that does not answer the inventory sent is not trusted: no cut at all
            policy.worker.cuts.tamper = failure
        committed = await commit(policy, "c1", seconds=0.4)
        [record] = ledger_records(policy.root, committed)
        await policy.control.ok("resume", checkpoint_id="c1")
        gate.set()
        assert (await asyncio.wait_for(call, WAIT_S)).status_code == 200
        settled = await keeps(policy, 1)
    assert committed["staging_keys"] == [] and "cut" not in record and len(record["ledger"]) == 1
    assert committed["staging_keys_by_episode"] == {"r1": []}  # one entry per exported record
    assert len(policy.worker.cut_requests) >= 1
    assert settled == [{"checkpoint_id": "c1", "server_name": "policy_model", "staging_keys": []}]


async def test_an_unsettled_cut_is_settled_before_the_next_one(policies: OpenPolicy) -> None:
    async with policies(**CUTS) as policy:
        call, gate = await in_flight(policy, R1, "long")
        await policy.control.ok("prepare", checkpoint_id="c1")
        policy.worker.cuts.gate = asyncio.Event()
        commit_call = asyncio.create_task(policy.control.ok(
            "commit", checkpoint_id="c1", checkpoint_dir=unique("c1"), deadline_ts=policy.clock.now() + 30))
        await policy.until(lambda _: len(policy.worker.cut_requests) == 1)
        await policy.control.ok("resume", checkpoint_id="c1")  # aborts the commit during its cut
        with pytest.raises(AssertionError, match="stale_checkpoint"):
            await asyncio.wait_for(commit_call, WAIT_S)
        policy.worker.cuts.gate = None
        committed = await commit(policy, "c2")
        await policy.control.ok("resume", checkpoint_id="c2")
        gate.set()
        await asyncio.wait_for(call, WAIT_S)
        settled = await keeps(policy, 2)
    assert settled[0] == {"checkpoint_id": "c1", "server_name": "policy_model", "staging_keys": []}
    assert settled[1]["checkpoint_id"] == "c2" and settled[1]["staging_keys"] == committed["staging_keys"] != []


async def test_the_commit_replies_before_the_worker_answers_its_keep(policies: OpenPolicy) -> None:
    async with policies(**CUTS) as policy:
        call, gate = await in_flight(policy, R1, "long")
        policy.worker.keep_gate = hang = asyncio.Event()
        first = await commit(policy, "c1")  # a commit that waited for its keep would wait here
        hung = await keeps(policy, 1)
        hang.set()  # the worker answers the keep of c1 only once the commit has replied
        await policy.control.ok("resume", checkpoint_id="c1")
        second = await commit(policy, "c2")  # awaits c1's keep (answered): nothing to send again
        await policy.control.ok("resume", checkpoint_id="c2")
        gate.set()
        await asyncio.wait_for(call, WAIT_S)
        settled = await keeps(policy, 2)
    assert hung == [{"checkpoint_id": "c1", "server_name": "policy_model", "staging_keys": first["staging_keys"]}]
    assert [keep["checkpoint_id"] for keep in settled] == ["c1", "c2"] and first["staging_keys"] != []
    assert settled[1]["staging_keys"] == second["staging_keys"] != []


async def test_the_commit_does_not_wait_for_the_keep_and_the_next_cut_sends_it_again(
    policies: OpenPolicy,
) -> None:
    async with policies(**CUTS) as policy:
        call, gate = await in_flight(policy, R1, "long")
        policy.worker.keep_gate = hang = asyncio.Event()  # the worker does not answer the keep of c1
        first = await commit(policy, "c1", seconds=2.0)  # replies although its keep hangs
        await policy.control.ok("resume", checkpoint_id="c1")
        hung = await keeps(policy, 1)
        policy.worker.keep_gate = None
        second = await commit(policy, "c2", seconds=2.0)  # waits a bounded while, then sends c1's again
        await policy.control.ok("resume", checkpoint_id="c2")
        gate.set()
        await asyncio.wait_for(call, WAIT_S)
        settled = await keeps(policy, 3)
        hang.set()
    assert first["staging_keys"] != [] and hung == [{"checkpoint_id": "c1", "server_name": "policy_model",
                                                      "staging_keys": first["staging_keys"]}]
    assert settled[1] == hung[0] and settled[2]["checkpoint_id"] == "c2"
    assert settled[2]["staging_keys"] == second["staging_keys"] != []


async def test_a_cut_whose_lineage_moved_since_admission_is_dropped(policies: OpenPolicy) -> None:
    async with policies(**CUTS) as policy:
        slow, gate = await in_flight(policy, R1, "slow")
        assert (await policy.call(R1, "fast")).status_code == 200  # delivered after the slow one's admission
        committed = await commit(policy, "c1")
        [record] = ledger_records(policy.root, committed)
        await policy.control.ok("resume", checkpoint_id="c1")
        gate.set()
        await asyncio.wait_for(slow, WAIT_S)
    assert len(policy.worker.cut_requests) == 1 and "cut" not in record and committed["staging_keys"] == []


async def restored(policy: Policy, source: Policy, cid: str, *episodes: RolloutIdentity) -> dict[str, Any]:
    directory = str(ledger_dir(source.root, cid))
    reply = await policy.control.ok("restore", checkpoint_id="back", checkpoint_dir=directory,
                                    episode_ids=[episode.to_json() for episode in episodes])
    await policy.control.ok("resume", checkpoint_id="back")
    return reply


async def test_the_reissued_call_continues_from_its_staged_prefix(policies: OpenPolicy) -> None:
    async with policies(**CUTS) as first:
        await first.call(R1, "one")
        call, gate = await in_flight(first, R1, "two")
        committed = await commit(first, "c1")
        [record] = ledger_records(first.root, committed)
        await first.control.ok("resume", checkpoint_id="c1")
        gate.set()
        await asyncio.wait_for(call, WAIT_S)
    async with policies(**CUTS) as fresh:
        await restored(fresh, first, "c1", R1)
        assert (await fresh.call(R1.next_attempt(), "something else")).status_code == 200
        assert (await fresh.call(R1.next_attempt(), "two")).status_code == 200
    async with policies(**CUTS) as again:
        await restored(again, first, "c1", R1)
        reissued = await again.call(R1.next_attempt(), "two")
        after = await again.call(R1.next_attempt(), "two")
    cut = record["cut"]
    sent = again.worker.requests[0]
    # another conversation never continues the cut, and once the rollout delivered a call, nothing does
    assert [("continuation" in request) for request in fresh.worker.requests] == [False, False]
    assert sent["continuation"] == {
        "staging_keys": cut["staging_keys"], "source_call_id": cut["source_call_id"],
        "prefix_token_count": 5, "prefix_digest": cut["prefix_digest"], "effective_output_limit": 100}
    assert sent["model_call"] == {"model_call_id": reissued.headers[MODEL_CALL_HEADER],
                                  "parent_call_id": cut["parent_call_id"], "previous_length": 1}
    assert "continuation" not in again.worker.requests[1] and after.status_code == 200  # delivered: cut used


def agent_conversation(tokens: bool) -> list[dict[str, Any]]:
    """A question, the policy's answer (with the token fields it returned, or without them as a
    restored agent has it), and the next question."""
    capture = {"prompt_token_ids": [3, 4], "generation_token_ids": [5, 6], "generation_log_probs": [-0.5, -0.25],
               "policy_version": 0} if tokens else {}
    return [{"role": "user", "content": "one"}, {"role": "assistant", "content": "ok", **capture},
            {"role": "user", "content": "two"}]


async def test_a_restored_agent_without_token_arrays_continues_the_cut(policies: OpenPolicy) -> None:
    async with policies(**CUTS) as first:
        call, gate = await in_flight(first, R1, "two", messages=agent_conversation(tokens=True))
        committed = await commit(first, "c1")
        [record] = ledger_records(first.root, committed)
        await first.control.ok("resume", checkpoint_id="c1")
        gate.set()
        await asyncio.wait_for(call, WAIT_S)
    async with policies(**CUTS) as again:
        await restored(again, first, "c1", R1)
        reply = await again.call(R1.next_attempt(), "two", messages=agent_conversation(tokens=False))
    assert reply.status_code == 200 and "cut" in record
    assert again.worker.requests[0]["continuation"]["staging_keys"] == record["cut"]["staging_keys"]


async def test_a_restored_cut_is_kept_until_the_rollout_delivers(policies: OpenPolicy) -> None:
    async with policies(**CUTS) as first:
        call, gate = await in_flight(first, R1, "only")
        committed = await commit(first, "c1")
        [record] = ledger_records(first.root, committed)
        await first.control.ok("resume", checkpoint_id="c1")
        gate.set()
        await asyncio.wait_for(call, WAIT_S)
    async with policies(**CUTS) as fresh:
        await restored(fresh, first, "c1", R1)
        again = await commit(fresh, "c2", episode_ids=[R1.to_json()], incremental=False)  # written in full
        [same] = ledger_records(fresh.root, again)
        await fresh.control.ok("resume", checkpoint_id="c2")
        settled = await keeps(fresh, 1)
    assert same == record and again["staging_keys"] == record["cut"]["staging_keys"]
    assert fresh.worker.cut_requests == []  # nothing was in flight
    assert [keep["staging_keys"] for keep in settled] == [again["staging_keys"]]


@pytest.mark.parametrize("damage", ["lineage", "field", "extra"])
async def test_a_damaged_cut_in_a_record_fails_the_restore(
    policies: OpenPolicy, root: Path, damage: str
) -> None:
    async with policies(**CUTS) as first:
        call, gate = await in_flight(first, R1, "only")
        committed = await commit(first, "c1")
        await first.control.ok("resume", checkpoint_id="c1")
        gate.set()
        await asyncio.wait_for(call, WAIT_S)
    [record] = ledger_records(first.root, committed)
    cut = record["cut"]
    if damage == "lineage":
        cut["previous_length"] = 3
    elif damage == "field":
        cut["prefix_digest"] = "not a digest"
    else:
        cut["token_count"] = 5
    forged = unique("forged").removeprefix("@")
    write_records(root / forged / "gym" / "model" / "policy_model", [record], "c1")
    async with policies(**CUTS) as fresh:
        await fresh.control.refused("invalid_checkpoint_state", "restore", checkpoint_id="back",
                                    checkpoint_dir=str(root / forged), episode_ids=[R1.to_json()])


def write_records(directory: Path, records: list[dict[str, Any]], checkpoint_id: str) -> None:
    """A committed checkpoint holding ``records`` (a valid manifest over them)."""
    content = b"".join(orjson.dumps(record) + b"\n" for record in records)
    digest = hashlib.sha256(content).hexdigest()
    directory.mkdir(parents=True)
    (directory / f"records-{digest}.jsonl").write_bytes(content)
    manifest = {"schema_version": 1, "kind": "model", "instance": "policy_model",
                "checkpoint_id": checkpoint_id, "records_file": f"records-{digest}.jsonl",
                "records_sha256": digest, "record_count": len(records)}
    (directory / "manifest.json").write_bytes(orjson.dumps(manifest))
