"""The capture ledger's records and checks, the active-call registry's cut inventory, the config."""

from __future__ import annotations

from typing import Any

import pytest

from model_servers.policy_model.active_calls import ActiveCalls, CallState
from model_servers.policy_model.app import Config
from model_servers.policy_model.generation import ChatCall, Sampling, TokenCapture
from model_servers.policy_model.ids import sha256_of
from model_servers.policy_model.ledger import ROW_FIELDS, LedgerBook
from model_servers.policy_model.tests.policy_harness import WORKER_REF
from model_servers.policy_model.token_sidecar import CallTokens, TokenedRecord
from nemo_gym_ckpt.checkpoint.records import Record
from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.errors import ConfigError, InvalidCheckpointState
from nemo_gym_ckpt.identity import RolloutIdentity

pytestmark = pytest.mark.unit

DIGEST = "ab" * 32
CALL = ChatCall(messages=[{"role": "user", "content": "hi"}], tools=None, sampling=Sampling(1.0, 1.0, 8))


def row(call_id: str, parent: str | None, attempt: int = 0, **changes: Any) -> dict[str, Any]:
    data = {
        "call_id": call_id, "parent_call_id": parent, "attempt": attempt, "prompt_length": 12,
        "prompt_digest": DIGEST, "output_length": 3, "output_digest": DIGEST, "finish_reason": "stop",
        "policy_version": 7, "admitted_at": 1_700_000_000.5, "conversation_digest": DIGEST, "token_digest": None,
    }
    return {**data, **changes}


def record(attempt: int, rows: list[dict[str, Any]], **extra: Any) -> Record:
    return Record.from_data({"episode_id": {"rollout_id": "r1", "attempt": attempt}, "ledger": rows, **extra})


def test_a_good_record_installs_under_the_next_attempt_and_is_exported_as_it_came() -> None:
    book = LedgerBook()
    source = record(1, [row("a", None), row("b", "a", attempt=1)])
    assert book.install([source]) == [RolloutIdentity("r1", 2)]
    ledger = book.get(RolloutIdentity("r1", 2))
    assert ledger is not None and ledger.head == "b" and book.row_count == 2
    assert book.records(frozenset({RolloutIdentity("r1", 1)})) == [source]
    assert book.records(frozenset({RolloutIdentity("r2")})) == []
    assert list(ROW_FIELDS) == list(row("a", None))


BROKEN = {
    "a first row with a parent": [row("a", "x")],
    "a broken chain": [row("a", None), row("b", "x")],
    "a call twice": [row("a", None), row("a", "a")],
    "attempts out of order": [row("a", None, attempt=1), row("b", "a", attempt=0)],
    "an attempt after the record's": [row("a", None, attempt=3)],
    "a missing field": [{k: v for k, v in row("a", None).items() if k != "policy_version"}],
    "an unknown field": [row("a", None, token_count=3)],
    "a negative length": [row("a", None, prompt_length=-1)],
    "a digest that is not SHA-256": [row("a", None, output_digest="abc")],
    "an unknown finish reason": [row("a", None, finish_reason="cut")],
    "a boolean version": [row("a", None, policy_version=True)],
    "a row that is not an object": ["a"],
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_record_installs_nothing(case: str) -> None:
    book = LedgerBook()
    good = record(0, [row("g", None)]).data | {"episode_id": {"rollout_id": "r0", "attempt": 0}}
    with pytest.raises(InvalidCheckpointState):
        book.install([Record.from_data(good), record(2, BROKEN[case])])
    assert len(book) == 0


def test_a_record_with_other_keys_or_twice_is_refused() -> None:
    with pytest.raises(InvalidCheckpointState):
        LedgerBook().install([record(0, [], extra=1)])
    with pytest.raises(InvalidCheckpointState):
        LedgerBook().install([record(0, []), record(0, [])])


def test_the_cut_inventory_lists_the_latest_generating_call_per_episode_in_scope() -> None:
    calls = ActiveCalls()
    r1, r2, r3 = RolloutIdentity("r1"), RolloutIdentity("r2", 1), RolloutIdentity("r3")
    calls.open(r1, CALL, 10.0)
    latest = calls.open(r1, CALL, 11.0)
    calls.mark(calls.open(r2, CALL, 12.0), CallState.HELD)
    calls.open(r3, CALL, 13.0)
    inventory = calls.cut_inventory(frozenset({r1, r2}))
    assert inventory == [{"ticket_id": latest.ticket_id, "rollout_id": "r1", "attempt": 0,
                          "model_call_id": latest.model_call_id, "admitted_at": 11.0}]
    assert {entry["rollout_id"] for entry in calls.cut_inventory(None)} == {"r1", "r3"}
    assert latest.conversation_digest == calls.open(r3, CALL, 14.0).conversation_digest


@pytest.mark.parametrize("settings", [{"generation_cuts": True},
                                      {"generation_cuts": True, "checkpoint_policy": False}])
def test_generation_cuts_need_the_policy_participant(settings: dict[str, Any]) -> None:
    raw = {
        "inference_worker": {"responses_api_models": {"inference_worker": {}}},
        "policy_model": {"responses_api_models": {"policy_model": {"worker": WORKER_REF, **settings}}},
    }
    with pytest.raises(ConfigError, match="generation_cuts"):
        load_config_dict(raw)
    raw["policy_model"]["responses_api_models"]["policy_model"]["checkpoint_policy"] = True
    policy = load_config_dict(raw).instance("policy_model").settings
    assert isinstance(policy, Config) and policy.generation_cuts is True


def restored_with_tokens(rollout_id: str, ids: list[int]) -> TokenedRecord:
    """A checkpointed ledger of one call that delivered token ids, as a restore reads it."""
    tokens = CallTokens.of(f"mc_{rollout_id}", TokenCapture(ids, [9], [-0.5]))
    rows = [row(f"mc_{rollout_id}", None, prompt_digest=sha256_of(ids), output_digest=sha256_of([9]),
                token_digest=tokens.digest)]
    read = Record.from_data({"episode_id": {"rollout_id": rollout_id, "attempt": 0}, "ledger": rows})
    return TokenedRecord(read.raw, read.data, read.episode, {tokens.call_id: tokens})


def test_an_export_names_the_token_lines_of_the_records_in_scope_only() -> None:
    book = LedgerBook()
    first, second = restored_with_tokens("r1", [1, 2]), restored_with_tokens("r2", [3, 4])
    book.install([first, second])
    items, lines = book.export(frozenset({RolloutIdentity("r1", 0)}))
    assert items == [first] and lines == list(first.tokens.values())
    items, lines = book.export(None)
    assert items == [first, second] and lines == [*first.tokens.values(), *second.tokens.values()]
    assert book.export(frozenset({RolloutIdentity("r3")})) == ([], [])
