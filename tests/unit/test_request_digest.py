"""An agent activation's ``request_digest``: the SHA-256 of its canonical JSON without token arrays.

It skips the copy without token arrays when none can be in the request; the digest must be the
same as the one of the copy in every case.
"""

from __future__ import annotations

from typing import Any

import pytest

from nemo_gym_ckpt.agent.sessions import request_digest
from nemo_gym_ckpt.capture import without_token_arrays
from nemo_gym_ckpt.checkpoint.records import TOKEN_ARRAY_KEYS
from nemo_gym_ckpt.environment.episode import task_digest

pytestmark = pytest.mark.unit

TOOLS = [{"type": "function", "name": "add", "parameters": {"type": "object", "properties": {"a": {}, "b": {}}}}]
TOKENS = {"prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-0.5],
          "token_ids": [4], "logprobs": [-1.0]}


def stripped_digest(request: dict[str, Any]) -> str:
    return task_digest(without_token_arrays(request))


REQUESTS = [
    {"input": [{"role": "user", "content": "Compute 845 - 114."}], "tools": TOOLS},
    {"input": "hi", "temperature": 0.0},
    {"input": [{"role": "user", "content": "hi"}, {"type": "message", "content": "ok", **TOKENS}], "tools": TOOLS},
    {"input": [{"type": "function_call", "arguments": "{}", "nested": {"deeper": [{"logprobs": [0.1]}]}}]},
    {"input": [{"role": "user", "content": "prompt_token_ids"}]},  # a key's name as a value
    {"input": [{"role": "user", "content": 'say "token_ids": [1]'}]},  # and inside a text
    {"prompt_token_ids": [1], "input": "top level"},
]


@pytest.mark.parametrize("request_body", REQUESTS)
def test_the_digest_is_the_one_of_the_request_without_token_arrays(request_body: dict[str, Any]) -> None:
    assert request_digest(request_body) == stripped_digest(request_body)


@pytest.mark.parametrize("key", TOKEN_ARRAY_KEYS)
def test_token_arrays_do_not_change_the_digest(key: str) -> None:
    plain = {"input": [{"role": "assistant", "content": "ok"}], "tools": TOOLS}
    with_tokens = {"input": [{"role": "assistant", "content": "ok", key: [7, 8]}], "tools": TOOLS}
    assert request_digest(with_tokens) == request_digest(plain)


def test_anything_else_changes_the_digest() -> None:
    plain = {"input": [{"role": "assistant", "content": "ok"}], "tools": TOOLS}
    assert request_digest({**plain, "temperature": 0.5}) != request_digest(plain)
    changed = {"input": [{"role": "assistant", "content": "ok!"}], "tools": TOOLS}
    assert request_digest(changed) != request_digest(plain)
