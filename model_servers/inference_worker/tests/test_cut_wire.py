"""An upstream-shaped cut request against our worker: the digest and the receipt, field by field.

The request is built as a NeMo RL front builds it (upstream's ``GenerationCutInventory.build``: the
prefixes sorted by ticket, the digest of ``upstream_digest``, a formula written out in the test
helpers from upstream's definition and checked here against the worked examples of the research
notes). The receipt must be upstream's ``GenerationCutReceipt``: exactly its fields, the inventory
echoed equal, one ack per ticket with its identity, a durable ack with all its evidence, a failed
one with none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from model_servers.inference_worker.staging import token_digest
from model_servers.inference_worker.tests.conftest import WorkerClient
from model_servers.inference_worker.tests.cut_helpers import (
    AUTH,
    GatedEngine,
    cut,
    model_call,
    start_under,
    until_tokens,
    upstream_digest,
)
from model_servers.inference_worker.tests.scripted_engine import CharTokenizer, ScriptedEngine

pytestmark = pytest.mark.unit

TOK = CharTokenizer()
BODY = {"prompt": TOK.encode("Hello"), "max_tokens": 12, "seed": 5, "return_token_ids": True, "logprobs": 1}
RECEIPT_FIELDS = {"checkpoint_id", "cut_id", "inventory_digest", "inventory", "backend_snapshot_id", "prefixes"}
ACK_FIELDS = {"ticket_id", "rollout_id", "attempt", "model_call_id", "admitted_at", "disposition", "cut_kind",
              "frozen_buffer_id", "staging_keys", "prefix_token_count", "prefix_digest", "effective_output_limit",
              "terminal_finish_reason", "terminal_stop_reason"}


def test_the_digest_formula_gives_the_worked_examples() -> None:
    unsorted = [
        {"ticket_id": "t-b", "rollout_id": "r1", "attempt": 1, "model_call_id": "c7", "admitted_at": 1700000001.5},
        {"ticket_id": "t-a", "rollout_id": "r0", "attempt": 0, "model_call_id": "c3", "admitted_at": 1700000000.25},
    ]
    worked = "d95884b757f2cc5306dfc79063886e34e04d2a2524c686bdb6d430baf7dc0a7c"
    assert upstream_digest("ckpt-1", "policy_model", unsorted) == worked
    empty = "8dfe19ef9ee10dfc1ff0435f67e0ce365f342bfbde2c4f64616ecfd4ecc1f0e8"
    assert upstream_digest("ckpt-1", "policy_model", []) == empty
    single = [{"ticket_id": "t", "rollout_id": "r", "attempt": 0, "model_call_id": "m", "admitted_at": 1700000000.0}]
    assert upstream_digest("c", "s", single) == "c12285e8d0fa6a99f91f1a2f4e9fe2bb3744babc745d40693020f4b1d0829f47"


def inventory(checkpoint_id: str, server: str, prefixes: list[dict[str, Any]]) -> dict[str, Any]:
    """What upstream's requester posts: the prefixes sorted by ticket, then the digest."""
    ordered = sorted(prefixes, key=lambda prefix: prefix["ticket_id"])
    return {"checkpoint_id": checkpoint_id, "server_name": server, "active_prefixes": ordered,
            "inventory_digest": upstream_digest(checkpoint_id, server, ordered)}


async def test_an_upstream_shaped_request_gets_upstream_receipts(
    worker_client: WorkerClient, tmp_path: Path
) -> None:
    engine = GatedEngine(ScriptedEngine.from_text("abcdefghijklmnop"))
    prefixes = [
        {"ticket_id": "tk-live", "rollout_id": "r1", "attempt": 2, "model_call_id": "mc_live",
         "admitted_at": 1700000001.5},
        {"ticket_id": "tk-absent", "rollout_id": "r0", "attempt": 0, "model_call_id": "nemo-rl/call 7",
         "admitted_at": 1700000000.25},
    ]
    body = inventory("ckpt-1", "nemo_rl_front", prefixes)
    async with worker_client(engine, checkpoint=True, staging_dir=str(tmp_path)) as http:
        running = start_under(http, "r1-a2", {**BODY, "model_call": model_call("mc_live")})
        engine.release(3)
        await until_tokens(http, "mc_live", 3)
        receipt = await cut(http, body)
        again = await cut(http, body)
        engine.open_gate()
        assert (await running).status_code == 200
        other = inventory("ckpt-3", "nemo_rl_front", prefixes)
        sent_unsorted = {**other, "active_prefixes": list(reversed(other["active_prefixes"]))}
        unsorted = await http.post("/ng-control/v1/generation-cut", json=sent_unsorted, headers=AUTH)
        digested = inventory("ckpt-2", "nemo_rl_front", [{**prefixes[0], "admitted_at": 1700000000.0}])
        sent_int = {**digested, "active_prefixes": [{**prefixes[0], "admitted_at": 1700000000}]}
        whole = await http.post("/ng-control/v1/generation-cut", headers=AUTH, json=sent_int)
    assert set(receipt) == RECEIPT_FIELDS and again == receipt  # a retry gets the same receipt
    assert receipt["checkpoint_id"] == "ckpt-1" and receipt["cut_id"] and receipt["backend_snapshot_id"]
    assert receipt["inventory"] == body  # echoed equal, field for field
    assert receipt["inventory_digest"] == body["inventory_digest"] == upstream_digest(
        "ckpt-1", "nemo_rl_front", prefixes)
    acks = {ack["ticket_id"]: ack for ack in receipt["prefixes"]}
    assert [ack["ticket_id"] for ack in receipt["prefixes"]] == ["tk-absent", "tk-live"]  # inventory order
    assert all(set(ack) == ACK_FIELDS for ack in acks.values())
    for prefix in prefixes:
        assert {k: acks[prefix["ticket_id"]][k] for k in prefix} == prefix
    failed = acks["tk-absent"]
    assert failed == {**prefixes[1], "disposition": "durable_failure", "cut_kind": None, "frozen_buffer_id": None,
                      "staging_keys": [], "prefix_token_count": None, "prefix_digest": None,
                      "effective_output_limit": None, "terminal_finish_reason": None, "terminal_stop_reason": None}
    live = acks["tk-live"]
    [key] = live["staging_keys"]
    assert live == {**prefixes[0], "disposition": "durable_prefix", "cut_kind": "active_prefix",
                    "frozen_buffer_id": key, "staging_keys": [key], "prefix_token_count": 3,
                    "prefix_digest": token_digest(TOK.encode("abc")), "effective_output_limit": 12,
                    "terminal_finish_reason": None, "terminal_stop_reason": None}
    # the digest is order-free: prefixes sent in another order are the same inventory (echoed as sent)
    assert unsorted.status_code == 200 and unsorted.json()["inventory"] == sent_unsorted
    # an integer admitted_at is the float upstream's digest writes (1700000000.0), and is echoed so
    assert whole.status_code == 200, whole.text
    assert whole.json()["inventory"]["active_prefixes"][0]["admitted_at"] == 1700000000.0


async def test_an_inventory_that_does_not_hash_to_its_digest_is_refused(
    worker_client: WorkerClient, tmp_path: Path
) -> None:
    prefix = {"ticket_id": "t", "rollout_id": "r", "attempt": 0, "model_call_id": "m", "admitted_at": 1.0}
    body = inventory("c1", "policy_model", [prefix])
    bad_bodies = [
        {**body, "server_name": "another"},  # the digest covers the server name and the checkpoint id
        {**body, "checkpoint_id": "c2"},
        {**body, "active_prefixes": [{**prefix, "attempt": 1}]},
    ]
    async with worker_client(ScriptedEngine.from_text("abc"), checkpoint=True, staging_dir=str(tmp_path)) as http:
        replies = [await http.post("/ng-control/v1/generation-cut", json=b, headers=AUTH) for b in bad_bodies]
        twice = await http.post("/ng-control/v1/generation-cut", headers=AUTH, json=inventory(
            "c1", "policy_model", [prefix, {**prefix, "model_call_id": "m2"}]))
    assert [reply.status_code for reply in replies] == [422, 422, 422]
    assert all(reply.json()["error"]["code"] == "invalid_checkpoint_state" for reply in replies)
    assert twice.status_code == 400 and "unique" in twice.json()["error"]["detail"]  # one ack per ticket
