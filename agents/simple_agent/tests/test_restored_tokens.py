"""Token arrays put back on a restored loop's output items (the policy model's capture route answer)."""

from __future__ import annotations

from typing import Any

import pytest

from agents.simple_agent.loop import LoopState
from agents.simple_agent.restored_tokens import missing_calls, model_call_items, reattach
from nemo_gym_ckpt.capture import without_token_arrays

pytestmark = pytest.mark.unit


def tokens(seed: int) -> dict[str, Any]:
    return {"prompt_token_ids": [seed, seed + 1], "generation_token_ids": [seed + 2],
            "generation_log_probs": [-0.5 * seed], "policy_version": 3}


def item(kind: str, seed: int, **fields: Any) -> dict[str, Any]:
    return {"id": f"{kind}_{seed}", "type": kind, "status": "completed", **fields, **tokens(seed)}


def uninterrupted() -> LoopState:
    """Two model calls: a message and a function call, then the tool's output, then the second."""
    outputs = [
        item("message", 1, role="assistant", content=[]),
        item("function_call", 1, call_id="c1", name="add", arguments="{}"),
        {"type": "function_call_output", "call_id": "c1", "output": "3"},
        item("function_call", 5, call_id="c2", name="add", arguments="{}"),
    ]
    state = LoopState(input=[{"role": "user", "content": "q"}], params={}, max_steps=4, outputs=outputs,
                      turns=2, model_calls=["mc_a", "mc_b"], pending=[outputs[3]])
    return state


def restored() -> LoopState:
    """The same state as a checkpoint record gives it back: without the token arrays."""
    return LoopState.from_json(without_token_arrays(uninterrupted().to_json()))


def answer() -> list[dict[str, Any]]:
    """The capture route's answer for the rollout: every call of the lineage, with its arrays."""
    return [{"call_id": "mc_a", "attempt": 0, **tokens(1)}, {"call_id": "mc_b", "attempt": 0, **tokens(5)}]


def test_model_items_group_by_call() -> None:
    assert model_call_items(uninterrupted().outputs) == [[0, 1], [3]]
    assert model_call_items([]) == []


def test_reattached_items_equal_the_uninterrupted_ones_key_order_included() -> None:
    state = restored()
    assert missing_calls(state) == ["mc_a", "mc_b"]
    assert reattach(state, answer()) == 3
    expected = uninterrupted().outputs
    assert state.outputs == expected
    assert [list(a) for a in state.outputs] == [list(b) for b in expected]
    assert missing_calls(state) == []
    assert reattach(state, answer()) == 0  # nothing lacks them any more


def test_a_call_the_model_has_no_ids_of_is_left_without_them() -> None:
    state = restored()
    assert reattach(state, [answer()[0], {"call_id": "mc_b", "attempt": 0, "policy_version": 3}]) == 2
    assert "generation_token_ids" not in state.outputs[3] and missing_calls(state) == ["mc_b"]


def test_a_state_whose_items_do_not_line_up_with_its_calls_is_left_alone() -> None:
    state = restored()
    state.model_calls = ["mc_b"]
    assert missing_calls(state) == []
    assert reattach(state, answer()) == 0
    assert all("generation_token_ids" not in output for output in state.outputs)
