"""A control body's scope (``episode_ids``) read straight into identities: NeMo Gym's ``EpisodeId``
rules for every entry, a scope read again answered from the entries read before (the same
identities), a bad entry refused however many good ones came first, and the memory of them bounded."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from nemo_gym_ckpt import identity as identity_module
from nemo_gym_ckpt.checkpoint import models
from nemo_gym_ckpt.checkpoint.models import CommitRequest, RetireRequest, parse_body
from nemo_gym_ckpt.errors import InvalidRequest
from nemo_gym_ckpt.identity import RolloutIdentity

pytestmark = pytest.mark.unit


def commit_body(episode_ids: Any) -> bytes:
    body = {"checkpoint_id": "c1", "deadline_ts": 1.0, "checkpoint_dir": "/x", "episode_ids": episode_ids}
    return orjson.dumps(body)


def test_a_scope_reads_into_identities_and_again_into_the_same_ones() -> None:
    entries = [{"rollout_id": f"r{n}", "attempt": n % 3} for n in range(100)] + [{"rollout_id": "plain"}]
    first = parse_body(CommitRequest, commit_body(entries)).episodes()
    again = parse_body(CommitRequest, commit_body(entries)).episodes()
    assert first == [RolloutIdentity(f"r{n}", n % 3) for n in range(100)] + [RolloutIdentity("plain")]
    assert first is not None and again is not None and all(a is b for a, b in zip(first, again, strict=True))


@pytest.mark.parametrize("bad", [
    {"rollout_id": "r1-a3"}, {"rollout_id": 7}, {"rollout_id": "r1", "attempt": True},
    {"rollout_id": "r1", "attempt": -1}, {"rollout_id": "r1", "extra": 0}, {"attempt": 1}, ["r1"], "r1",
    {"rollout_id": ["r1"]},
])
def test_a_bad_entry_is_refused_after_good_ones(bad: Any) -> None:
    good = [{"rollout_id": "r1"}, {"rollout_id": "r1", "attempt": 1}]
    parse_body(CommitRequest, commit_body(good))
    with pytest.raises(InvalidRequest, match="entry 2"):
        parse_body(CommitRequest, commit_body([*good, bad]))


def test_a_retire_needs_one_entry_and_a_scope_has_a_bound() -> None:
    with pytest.raises(InvalidRequest, match="1 to"):
        parse_body(RetireRequest, orjson.dumps({"checkpoint_id": "c1", "deadline_ts": 1.0, "episode_ids": []}))
    with pytest.raises(InvalidRequest, match="entries"):
        parse_body(CommitRequest, commit_body([{"rollout_id": "r"}] * (models.MAX_LIST_ITEMS + 1)))


def test_the_entries_remembered_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(identity_module, "KNOWN_LIMIT", 10)
    parse_body(CommitRequest, commit_body([{"rollout_id": f"b{n}"} for n in range(25)]))
    assert len(identity_module._KNOWN) <= 10


BODIES = [
    b'{"checkpoint_id": "c1", "deadline_ts": 5, "checkpoint_dir": "/x"}',
    b'{"checkpoint_id": "c1", "deadline_ts": 5.5, "checkpoint_dir": "/x", "stop": true, "incremental": false}',
    b'{"checkpoint_id": "c1", "deadline_ts": "5", "checkpoint_dir": "/x"}',
    b'{"checkpoint_id": "c1", "deadline_ts": 5, "checkpoint_dir": "/x", "stop": 1}',
    b'{"checkpoint_id": "c1", "deadline_ts": 5, "checkpoint_dir": "/x", "extra": null}',
    b'{"checkpoint_id": "c1", "deadline_ts": 5, "checkpoint_dir": "/x", "checkpoint_id": "c2"}',
    b'{"checkpoint_id": "bad id", "deadline_ts": 5, "checkpoint_dir": "/x"}',
    b'{"checkpoint_id": "c1", "deadline_ts": -1, "checkpoint_dir": "/x"}',
    b'{"checkpoint_id": "c1", "deadline_ts": 5, "checkpoint_dir": ""}',
    b'{"checkpoint_id": "c1", "deadline_ts": 5, "checkpoint_dir": "/x", "episode_ids": [{"rollout_id": "r"}]}',
    b'{"checkpoint_id": "c1", "deadline_ts": 5, "checkpoint_dir": "/x", "episode_ids": {"rollout_id": "r"}}',
    b'[{"checkpoint_id": "c1"}]', b'"c1"', b"null",
]


@pytest.mark.parametrize("content", BODIES)
def test_a_body_read_by_orjson_is_accepted_or_refused_as_pydantic_reading_it_would(content: bytes) -> None:
    """Every field is a JSON type, so strict validation of the object orjson read gives what
    validating the JSON text itself gives: the same body, or a refusal naming the same fields."""
    try:
        expected: Any = CommitRequest.model_validate_json(content)
    except ValidationError as error:
        expected = sorted(".".join(str(part) for part in item["loc"]) or "body" for item in error.errors())
    try:
        got: Any = parse_body(CommitRequest, content)
    except InvalidRequest as error:
        got = sorted(problem.split(": ")[0] for problem in error.detail.split("; "))
    assert got == expected


@pytest.mark.parametrize("content", [b'{"checkpoint_id": "c1",', b"", b'{"deadline_ts": 1e400}', b"\xff"])
def test_bytes_that_are_not_json_are_refused_as_such(content: bytes) -> None:
    with pytest.raises(InvalidRequest, match=r"^body: not valid JSON"):
        parse_body(CommitRequest, content)
