"""Generation cuts on the worker's HTTP layer, over a scripted engine behind a gate.

A cut freezes each listed generation at a token boundary, stages it durably, answers a receipt per
ticket; the generation goes on as if nothing happened; a continuation answers prefix + new tokens
as one completion; keep deletes what a commit did not keep.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from model_servers.inference_worker.staging import StagedPrefix, token_digest
from model_servers.inference_worker.tests.conftest import WorkerClient
from model_servers.inference_worker.tests.cut_helpers import (
    AUTH,
    GatedEngine,
    batch_files,
    batch_of,
    complete_under,
    cut,
    cut_body,
    model_call,
    staged_line,
    start_under,
    status,
    until_tokens,
)
from model_servers.inference_worker.tests.scripted_engine import CharTokenizer, ScriptedEngine
from model_servers.inference_worker.tests.test_app import sse_events

pytestmark = pytest.mark.unit

TOK = CharTokenizer()
PROMPT = TOK.encode("Hello")
BODY = {"prompt": PROMPT, "max_tokens": 10, "seed": 5, "return_token_ids": True, "logprobs": 1}


def staged(root: Path, key: str) -> StagedPrefix:
    return StagedPrefix.decode(staged_line(root, key), key)


async def test_cut_freezes_at_a_token_boundary_and_the_generation_goes_on(
    worker_client: WorkerClient, tmp_path: Path
) -> None:
    engine = GatedEngine(ScriptedEngine.from_text("abcdefghijkl"))
    async with worker_client(engine, checkpoint=True, staging_dir=str(tmp_path), policy_version=3) as http:
        running = start_under(http, "r1", {**BODY, "model_call": model_call("mc_a", "mc_p", 2)})
        engine.release(4)
        await until_tokens(http, "mc_a", 4)
        reply = await cut(http, cut_body("c1", ("tk-1", "r1", 0, "mc_a")))
        files_at_receipt = batch_files(tmp_path)
        engine.open_gate()
        cut_run = (await running).json()["choices"][0]
        uncut = (await complete_under(http, "r2", {**BODY, "model_call": model_call("mc_b")})).json()
    [receipt] = reply["prefixes"]
    [key] = receipt["staging_keys"]
    assert receipt == {"ticket_id": "tk-1", "rollout_id": "r1", "attempt": 0, "model_call_id": "mc_a",
                       "admitted_at": 1.5, "disposition": "durable_prefix", "cut_kind": "active_prefix",
                       "frozen_buffer_id": key, "staging_keys": [key], "prefix_token_count": 4,
                       "prefix_digest": token_digest(TOK.encode("abcd")), "effective_output_limit": 10,
                       "terminal_finish_reason": None, "terminal_stop_reason": None}
    assert key.startswith("mc_a.") and files_at_receipt == [batch_of(tmp_path, key)]
    prefix = staged(tmp_path, key)
    assert prefix.token_ids == tuple(TOK.encode("abcd")) and prefix.logprobs == (-0.01, -0.02, -0.03, -0.04)
    lineage = (prefix.rollout_id, prefix.attempt, prefix.parent_call_id, prefix.previous_length)
    assert lineage == ("r1", 0, "mc_p", 2)
    assert prefix.policy_version == 3 and prefix.prompt_digest == token_digest(PROMPT)
    assert (prefix.sampling.seed, prefix.sampling.max_tokens) == (5, 10)
    assert (prefix.checkpoint_id, prefix.server_name, prefix.ticket_id) == ("c1", "policy_model", "tk-1")
    uncut_choice = uncut["choices"][0]
    assert {k: cut_run[k] for k in ("text", "token_ids", "logprobs", "finish_reason")} == {
        k: uncut_choice[k] for k in ("text", "token_ids", "logprobs", "finish_reason")}


async def test_a_finished_generation_is_cut_as_a_terminal_completion(
    worker_client: WorkerClient, tmp_path: Path
) -> None:
    engine = ScriptedEngine.from_text("abc<|end|>")
    async with worker_client(engine, checkpoint=True, staging_dir=str(tmp_path)) as http:
        done = await complete_under(http, "r1", {**BODY, "model_call": model_call("mc_a")})
        reply = await cut(http, cut_body("c1", ("tk-1", "r1", 0, "mc_a")))
    [receipt] = reply["prefixes"]
    assert done.json()["choices"][0]["finish_reason"] == "stop"
    assert receipt["cut_kind"] == "terminal_completion" and receipt["terminal_finish_reason"] == "stop"
    assert receipt["prefix_token_count"] == 4 and receipt["effective_output_limit"] == 10  # the whole budget
    prefix = staged(tmp_path, receipt["staging_keys"][0])
    assert prefix.last_step_finish == "stop" and prefix.finish_reason == "stop"


async def test_tickets_without_a_cuttable_generation_are_durable_failures(
    worker_client: WorkerClient, tmp_path: Path
) -> None:
    engine = GatedEngine(ScriptedEngine.from_text("abcdefghijkl"), apart=True)
    async with worker_client(engine, checkpoint=True, staging_dir=str(tmp_path)) as http:
        constrained = start_under(http, "r1", {**BODY, "model_call": model_call("mc_c", constrained=True)})
        await engine.until_admitted(1)
        waiting = start_under(http, "r2", {**BODY, "model_call": model_call("mc_w")})
        await engine.until_admitted(2)
        engine.release_nth(0, 1)  # one token each (a shared gate let the first take both)
        engine.release_nth(1, 1)
        await until_tokens(http, "mc_c", 1)
        await until_tokens(http, "mc_w", 1)
        body = cut_body("c1", ("t-none", "r3", 0, "mc_nobody"), ("t-other", "r9", 0, "mc_w"),
                        ("t-attempt", "r2", 1, "mc_w"), ("t-constrained", "r1", 0, "mc_c"))
        reply = await cut(http, body)
        failures = (await status(http))["cut_failures"]
        engine.open_gate()
        for task in (constrained, waiting):
            assert (await task).status_code == 200
    receipts = {r["ticket_id"]: r for r in reply["prefixes"]}
    evidence = ("cut_kind", "frozen_buffer_id", "prefix_token_count", "prefix_digest", "effective_output_limit",
                "terminal_finish_reason", "terminal_stop_reason")
    assert {r["disposition"] for r in receipts.values()} == {"durable_failure"}
    assert all(r["staging_keys"] == [] and all(r[k] is None for k in evidence) for r in receipts.values())
    reasons = sorted(failures)
    assert len(reasons) == 3 and sum(failures.values()) == 4
    assert any("no generation" in r for r in reasons) and failures["constrained decoding is never cut"] == 1
    assert failures["the call belongs to another rollout attempt"] == 2
    assert batch_files(tmp_path) == []


async def test_failures_of_other_attempts_calls_are_counted_under_one_reason(
    worker_client: WorkerClient, tmp_path: Path
) -> None:
    """A reason never names the call: ``cut_failures`` keeps one key however many calls mismatch."""
    engine = GatedEngine(ScriptedEngine.from_text("abcdefghijkl"))
    async with worker_client(engine, checkpoint=True, staging_dir=str(tmp_path)) as http:
        running = [start_under(http, "r1", {**BODY, "model_call": model_call(call_id)})
                   for call_id in ("mc_x", "mc_y", "mc_z")]
        for call_id in ("mc_x", "mc_y", "mc_z"):
            await until_tokens(http, call_id, 0)  # live (the attempt is checked before the tokens)
        await cut(http, cut_body("c1", ("t-x", "r1", 1, "mc_x"), ("t-y", "r1", 1, "mc_y")))
        await cut(http, cut_body("c2", ("t-z", "r9", 0, "mc_z")))
        failures = (await status(http))["cut_failures"]
        engine.open_gate()
        for task in running:
            assert (await task).status_code == 200
    assert failures == {"the call belongs to another rollout attempt": 3}
    assert batch_files(tmp_path) == []


async def test_nothing_generated_yet_is_a_durable_failure(
    worker_client: WorkerClient, tmp_path: Path
) -> None:
    engine = GatedEngine(ScriptedEngine.from_text("abc"))
    async with worker_client(engine, checkpoint=True, staging_dir=str(tmp_path)) as http:
        running = start_under(http, "r1", {**BODY, "model_call": model_call("mc_a")})
        await until_tokens(http, "mc_a", 0)
        reply = await cut(http, cut_body("c1", ("tk-1", "r1", 0, "mc_a")))
        failures = (await status(http))["cut_failures"]
        engine.open_gate()
        await running
    assert reply["prefixes"][0]["disposition"] == "durable_failure" and failures == {"nothing generated yet": 1}


async def test_the_same_cut_again_gets_the_same_reply_and_a_bad_digest_is_refused(
    worker_client: WorkerClient, tmp_path: Path
) -> None:
    engine = ScriptedEngine.from_text("abc<|end|>")
    async with worker_client(engine, checkpoint=True, staging_dir=str(tmp_path)) as http:
        await complete_under(http, "r1", {**BODY, "model_call": model_call("mc_a")})
        body = cut_body("c1", ("tk-1", "r1", 0, "mc_a"))
        first, again = await cut(http, body), await cut(http, body)
        forged = await http.post("/ng-control/v1/generation-cut", headers=AUTH,
                                 json={**body, "inventory_digest": "0" * 64})
        cuts = (await status(http))["cuts"]
    assert first == again and len(batch_files(tmp_path)) == 1 and cuts == 1
    assert forged.status_code == 422 and forged.json()["error"]["code"] == "invalid_checkpoint_state"


async def test_cut_routes_need_the_token_and_checkpointing(
    worker_client: WorkerClient, tmp_path: Path
) -> None:
    body = cut_body("c1", ("tk-1", "r1", 0, "mc_a"))
    keep = {"checkpoint_id": "c1", "server_name": "p", "staging_keys": []}
    engine = ScriptedEngine.from_text("abc")
    async with worker_client(engine, checkpoint=True, staging_dir=str(tmp_path)) as http:
        missing = await http.post("/ng-control/v1/generation-cut", json=body)
        wrong = await http.post("/ng-control/v1/generation-cut/keep", headers={"authorization": "Bearer no"},
                                json=keep)
        no_status = await http.get("/ng-control/v1/generation-cut/status")
        unknown_field = await http.post("/ng-control/v1/generation-cut", headers=AUTH, json={**body, "x": 1})
    async with worker_client(ScriptedEngine.from_text("abc"), staging_dir=str(tmp_path)) as http:
        off = await http.post("/ng-control/v1/generation-cut", json=body, headers=AUTH)
        named = await http.post("/v1/completions", json={**BODY, "model_call": model_call("mc_a")})
    assert [r.status_code for r in (missing, wrong, no_status)] == [401, 401, 401]
    assert unknown_field.status_code == 400 and off.status_code == 404
    assert named.status_code == 400 and "checkpointing" in named.json()["error"]["detail"]


async def test_keep_deletes_the_unkept_and_a_settled_checkpoint_stages_nothing(
    worker_client: WorkerClient, tmp_path: Path
) -> None:
    engine = ScriptedEngine.from_text("abc<|end|>")
    async with worker_client(engine, checkpoint=True, staging_dir=str(tmp_path)) as http:
        for call, key in (("mc_a", "r1"), ("mc_b", "r2"), ("mc_c", "r3")):
            await complete_under(http, key, {**BODY, "model_call": model_call(call)})
        reply = await cut(http, cut_body("c1", ("t1", "r1", 0, "mc_a"), ("t2", "r2", 0, "mc_b")))
        other = await cut(http, cut_body("c2", ("t3", "r3", 0, "mc_c")))
        kept_key, dropped_key = (r["staging_keys"][0] for r in reply["prefixes"])
        [other_key] = other["prefixes"][0]["staging_keys"]
        kept_file, other_file = batch_of(tmp_path, kept_key), batch_of(tmp_path, other_key)
        keys = [kept_key, "mc_x." + "0" * 64]
        keep = {"checkpoint_id": "c1", "server_name": "policy_model", "staging_keys": keys}
        settled = await http.post("/ng-control/v1/generation-cut/keep", json=keep, headers=AUTH)
        late = await cut(http, cut_body("c1", ("t4", "r1", 0, "mc_a")))
        keep_none = {"checkpoint_id": "c2", "server_name": "policy_model", "staging_keys": []}
        dropped = await http.post("/ng-control/v1/generation-cut/keep", json=keep_none, headers=AUTH)
        counters = await status(http)
        staging = counters["staging"]
        gone = await complete_under(http, "r2-a1", {**BODY, "model_call": model_call("mc_n"), "continuation": {
            **continuation_of(reply["prefixes"][1]), "source_call_id": "mc_b"}})
        missing = (await status(http))["continuations_missing"]
    assert settled.json() == {"kept": [kept_key], "deleted": 1, "missing": ["mc_x." + "0" * 64]}
    assert dropped.json() == {"kept": [], "deleted": 1, "missing": []}
    assert batch_files(tmp_path) == [kept_file] and kept_file != other_file and dropped_key != kept_key
    assert late["prefixes"][0]["disposition"] == "durable_failure"
    assert counters["cut_failures"] == {"the checkpoint was already settled": 1}
    assert staging == {"files": 1, "bytes": kept_file.stat().st_size, "prefixes": 1, "kept": 1}
    assert kept_file.with_suffix(".kept").exists()
    # the unkept prefix is gone: not a mismatch, the call is generated afresh (and counted)
    assert gone.status_code == 200, gone.text
    assert gone.json()["choices"][0]["token_ids"] == TOK.encode("abc<|end|>") and missing == 1


async def cut_after(http: Any, engine: GatedEngine, tokens: int, capture_key: str = "r1") -> dict[str, Any]:
    """A generation of call ``mc_a`` cut after ``tokens`` tokens, then finished; its receipt."""
    running = start_under(http, capture_key, {**BODY, "model_call": model_call("mc_a", "mc_p", 1)})
    engine.release(tokens)
    await until_tokens(http, "mc_a", tokens)
    reply = await cut(http, cut_body("c1", ("tk-1", "r1", 0, "mc_a")))
    engine.open_gate()
    assert (await running).status_code == 200
    receipt: dict[str, Any] = reply["prefixes"][0]
    return receipt


def continuation_of(receipt: dict[str, Any]) -> dict[str, Any]:
    return {"staging_keys": receipt["staging_keys"], "source_call_id": "mc_a",
            "prefix_token_count": receipt["prefix_token_count"], "prefix_digest": receipt["prefix_digest"],
            "effective_output_limit": receipt["effective_output_limit"]}


async def test_continuation_sends_prompt_plus_prefix_and_answers_one_completion(
    worker_client: WorkerClient, tmp_path: Path
) -> None:
    engine = GatedEngine(ScriptedEngine.from_text("abcdefghijkl"))
    async with worker_client(engine, checkpoint=True, staging_dir=str(tmp_path), policy_version=3) as http:
        receipt = await cut_after(http, engine, 4)
        await http.post("/ng-control/v1/policy-version", json={"policy_version": 4}, headers=AUTH)
        body = {**BODY, "model_call": model_call("mc_n", "mc_p", 1), "continuation": continuation_of(receipt)}
        reply = await complete_under(http, "r1-a1", body)
        counters = await status(http)
    out = reply.json()
    choice = out["choices"][0]
    sent = engine.admitted[-1]
    assert sent.prompt_token_ids == (*PROMPT, *TOK.encode("abcd")) and sent.max_tokens == 6 and sent.seed == 5
    assert choice["token_ids"] == TOK.encode("abcd") + TOK.encode("abcdef") and choice["text"] == "abcdabcdef"
    assert choice["logprobs"]["token_logprobs"] == [-0.01, -0.02, -0.03, -0.04, -0.01, -0.02, -0.03, -0.04,
                                                    -0.05, -0.06]
    assert choice["prompt_token_ids"] == PROMPT and choice["finish_reason"] == "length"
    assert out["policy_version"] == 3 and out["usage"]["completion_tokens"] == 10  # the prefix's version
    assert counters["tokens_from_staging"] == 4 and counters["tokens_generated"] == 10 + 6


async def test_streamed_continuation_starts_with_the_prefix(
    worker_client: WorkerClient, tmp_path: Path
) -> None:
    engine = GatedEngine(ScriptedEngine.from_text("abcdefghijkl"))
    async with worker_client(engine, checkpoint=True, staging_dir=str(tmp_path)) as http:
        receipt = await cut_after(http, engine, 3)
        body = {**BODY, "stream": True, "model_call": model_call("mc_n", "mc_p", 1),
                "continuation": continuation_of(receipt)}
        reply = await complete_under(http, "r1-a1", body)
    events = sse_events(reply.content)
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["token_ids"][:3] == TOK.encode("abc")
    ids = [i for event in events[:-1] for i in event["choices"][0]["token_ids"]]
    assert ids == TOK.encode("abc") + TOK.encode("abcdefg")


async def test_continuing_a_terminal_completion_generates_nothing(
    worker_client: WorkerClient, tmp_path: Path
) -> None:
    engine = GatedEngine(ScriptedEngine.from_text("ab<|end|>"))
    async with worker_client(engine, checkpoint=True, staging_dir=str(tmp_path)) as http:
        engine.open_gate()
        first = await complete_under(http, "r1", {**BODY, "model_call": model_call("mc_a", "mc_p", 1)})
        reply = await cut(http, cut_body("c1", ("tk-1", "r1", 0, "mc_a")))
        receipt = reply["prefixes"][0]
        admitted = len(engine.admitted)
        body = {**BODY, "model_call": model_call("mc_n", "mc_p", 1), "continuation": continuation_of(receipt)}
        again = await complete_under(http, "r1-a2", body)
    assert receipt["cut_kind"] == "terminal_completion" and len(engine.admitted) == admitted
    keys = ("text", "token_ids", "logprobs", "finish_reason", "stop_reason")
    before, after = first.json()["choices"][0], again.json()["choices"][0]
    assert {k: after[k] for k in keys} == {k: before[k] for k in keys}


async def test_a_restarted_worker_continues_what_an_earlier_process_staged(
    worker_client: WorkerClient, tmp_path: Path
) -> None:
    engine = GatedEngine(ScriptedEngine.from_text("abcdefghijkl"))
    async with worker_client(engine, checkpoint=True, staging_dir=str(tmp_path)) as http:
        receipt = await cut_after(http, engine, 5)
    (tmp_path / ".stg-0123456789abcdef.tmp").write_bytes(b"half a file")
    fresh = GatedEngine(ScriptedEngine.from_text("xyz"))
    fresh.open_gate()
    async with worker_client(fresh, checkpoint=True, staging_dir=str(tmp_path)) as http:
        staging = (await status(http))["staging"]
        body = {**BODY, "model_call": model_call("mc_n", "mc_p", 1), "continuation": continuation_of(receipt)}
        reply = await complete_under(http, "r1-a1", body)
    assert staging["files"] == 1 and not list(tmp_path.glob("*.tmp"))
    assert reply.json()["choices"][0]["text"] == "abcdexyzxy"
    content = staged_line(tmp_path, receipt["staging_keys"][0])
    assert orjson.loads(content)["prefix_token_count"] == 5
