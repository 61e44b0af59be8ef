"""A rollout identity's hash is computed once and never travels: equal identities hash alike, and one
sent to another process (another string hash seed) is hashed again there. Identities made before are
looked up (``known_identity``), within a bound, and a bad one is refused all the same."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import orjson
import pytest

from nemo_gym_ckpt import identity as identity_module
from nemo_gym_ckpt.checkpoint.records import Record
from nemo_gym_ckpt.errors import InvalidRequest
from nemo_gym_ckpt.identity import (
    RolloutIdentity,
    identities_of_episode_ids,
    identity_of_row,
    known_identity,
    parse_capture_key,
)

pytestmark = pytest.mark.unit

_UNPICKLE = """
import pickle, sys
from nemo_gym_ckpt.identity import RolloutIdentity
sent = pickle.loads(sys.stdin.buffer.read())
print(sent in {RolloutIdentity("rollout-7", 2)}, sent == RolloutIdentity("rollout-7", 2))
"""


def test_equal_identities_are_one_key_and_the_hash_is_the_fields() -> None:
    first, second = RolloutIdentity("rollout-7", 2), RolloutIdentity("rollout-7", 2)
    assert first == second and first is not second and {first: "x"}[second] == "x"
    assert hash(first) == hash(("rollout-7", 2))
    assert RolloutIdentity("rollout-7", 3) not in {first} and RolloutIdentity("rollout-8", 2) not in {first}
    assert repr(first) == "RolloutIdentity(rollout_id='rollout-7', attempt=2)"


def test_an_identity_sent_to_another_process_is_hashed_there() -> None:
    sent = pickle.dumps(RolloutIdentity("rollout-7", 2))
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # another seed: another hash of the same string
    done = subprocess.run([sys.executable, "-c", _UNPICKLE], input=sent, capture_output=True, env=env,
                          timeout=60, check=True)
    assert done.stdout.split() == [b"True", b"True"]


def test_identities_made_before_are_looked_up_and_a_bad_one_is_still_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    line = orjson.dumps({"episode_id": {"rollout_id": "rollout-9", "attempt": 1}, "state": {}})
    assert Record.from_raw(line).episode is Record.from_raw(line).episode  # one identity, not one per read
    assert known_identity("rollout-9", 1) is Record.from_raw(line).episode
    with pytest.raises(InvalidRequest, match="must match"):
        known_identity("no spaces allowed", 0)
    monkeypatch.setattr(identity_module, "KNOWN_LIMIT", 5)
    for number in range(12):
        known_identity(f"many-{number}", 0)
    assert len(identity_module._KNOWN) <= 5


def test_a_request_and_a_checkpoint_scope_name_one_identity_object() -> None:
    scope = identities_of_episode_ids([{"rollout_id": "7-3", "attempt": 2}, {"rollout_id": "7-4"}])
    assert parse_capture_key("7-3-a2") is scope[0] and parse_capture_key("7-4") is scope[1]
    assert identity_of_row({"_ng_task_index": 7, "_ng_rollout_index": 4}) is scope[1]
    assert identity_of_row({"_ng_rollout_id": "7-3", "_ng_attempt_index": 2}) is scope[0]
    assert parse_capture_key("7-3-a1").next_attempt() is scope[0]
    with pytest.raises(InvalidRequest):
        parse_capture_key("bad key")


def test_the_capture_key_is_made_once_with_the_identity_and_travels_rebuilt() -> None:
    first, later = RolloutIdentity("rollout-7"), RolloutIdentity("rollout-7", 2)
    assert (first.capture_key, later.capture_key) == ("rollout-7", "rollout-7-a2")
    assert later.capture_key is later.capture_key  # one string, not one per read
    assert parse_capture_key(later.capture_key) == later
    assert pickle.loads(pickle.dumps(later)).capture_key == "rollout-7-a2"
    assert RolloutIdentity("rollout-7", 2) == later and "capture_key" not in repr(later)
