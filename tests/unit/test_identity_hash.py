"""A rollout identity's hash is computed once and never travels: equal identities hash alike, and one
sent to another process (another string hash seed) is hashed again there."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

from nemo_gym_ckpt.identity import RolloutIdentity

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
