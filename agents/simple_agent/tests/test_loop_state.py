"""``LoopState.to_json``: the state as plain JSON, an independent copy; ``LoopState.view``: the
snapshot a session's record carries, the same fields but the request's own, without a copy (the
record copies it itself); ``LoopState.resumed``: the state again, from a snapshot and its request."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from agents.simple_agent.app import AgentRequest, resumed_state
from agents.simple_agent.loop import REQUEST_FIELDS, LoopState, check_loop_state
from nemo_gym_ckpt.agent.sessions import Activation, AgentSession
from nemo_gym_ckpt.errors import InvalidCheckpointState
from nemo_gym_ckpt.identity import RolloutIdentity

pytestmark = pytest.mark.unit


def a_state() -> LoopState:
    call = {"type": "function_call", "name": "calculator", "arguments": '{"expression": "2+2"}', "call_id": "c1"}
    return LoopState([{"role": "user", "content": "2+2?"}], {"temperature": 0.0, "max_output_tokens": 16}, 4,
                     outputs=[call, {"type": "function_call_output", "call_id": "c1", "output": "4"}],
                     usage={"input_tokens": 3, "output_tokens": 1, "ratio": 0.25}, turns=1, pending=[call],
                     cookies={"s": "1"}, stop_reason="answer", model_calls=["mc_1", None])


def test_to_json_is_what_asdict_gives_field_for_field() -> None:
    state = a_state()
    data = state.to_json()
    assert list(data) == [field.name for field in dataclasses.fields(LoopState)]
    assert orjson.dumps(data) == orjson.dumps(dataclasses.asdict(state))
    assert LoopState.from_json(data) == state


def test_to_json_shares_nothing_with_the_live_state() -> None:
    state = a_state()
    data = state.to_json()
    data["outputs"][0]["name"] = "changed"
    data["pending"].append({})
    data["usage"]["input_tokens"] = 99
    assert state.outputs[0]["name"] == "calculator" and len(state.pending) == 1 and state.usage == {
        "input_tokens": 3, "output_tokens": 1, "ratio": 0.25}


def test_a_view_is_the_state_as_it_stands_and_the_record_made_of_it_a_copy() -> None:
    state = a_state()
    state.outputs[0]["generation_token_ids"] = [7, 8]
    view = state.view()
    whole = state.to_json()
    left = {k: v for k, v in whole.items() if k not in REQUEST_FIELDS}
    assert orjson.dumps(view) == orjson.dumps({**left, "echoed": []})
    assert view["outputs"] is state.outputs  # no copy
    session = AgentSession(RolloutIdentity("r1"), running=Activation(1, "0" * 64, snapshot=state.view))
    record = session.encoded()
    kept = orjson.dumps(record.data)
    state.outputs.append({"type": "message"})  # the work moves on after the commit
    state.outputs[0]["status"] = "completed"
    state.cookies["s"] = "2"
    assert orjson.dumps(record.data) == kept == record.raw  # the record copied what it keeps
    assert "generation_token_ids" not in record.raw.decode()  # and left the token arrays out


def test_a_snapshot_leaves_the_request_out_and_resumes_with_the_request_given_again() -> None:
    state = a_state()
    snapshot = orjson.loads(orjson.dumps(state.view()))
    assert "input" not in snapshot and "params" not in snapshot  # the request's tool list is not written
    check_loop_state(snapshot)
    request = {"input": [{"role": "user", "content": "2+2?"}], "params": {"temperature": 0.0, "max_output_tokens": 16}}
    assert LoopState.resumed(snapshot, request) == state


TOOLS = [{"type": "function", "name": "add", "description": "a + b", "strict": True,
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}]


def a_state_answered_with_echoes() -> LoopState:
    state = a_state()
    state.params = {**state.params, "tools": TOOLS, "instructions": "Use the tools."}
    state.last_response = {"id": "resp_1", "tools": [dict(TOOLS[0])], "instructions": "Other words.",
                           "temperature": 0.0, "status": "completed"}
    return state


def test_the_last_responses_echoes_of_the_request_are_left_out_and_resumed_in_place() -> None:
    state = a_state_answered_with_echoes()
    snapshot = orjson.loads(orjson.dumps(state.view()))
    assert snapshot["echoed"] == ["tools"]  # equal to the request's; the other instructions and scalars stay
    assert snapshot["last_response"] == {"id": "resp_1", "tools": None, "instructions": "Other words.",
                                         "temperature": 0.0, "status": "completed"}
    assert state.last_response is not None and state.last_response["tools"] == TOOLS  # the live state keeps them
    check_loop_state(snapshot)
    resumed = LoopState.resumed(snapshot, {"input": state.input, "params": state.params})
    assert resumed == state
    assert resumed.last_response is not None and list(resumed.last_response) == list(state.last_response)  # in place


def test_a_snapshot_naming_an_echo_the_request_lacks_is_refused() -> None:
    state = a_state_answered_with_echoes()
    snapshot = orjson.loads(orjson.dumps(state.view()))
    without_tools = {k: v for k, v in state.params.items() if k != "tools"}
    with pytest.raises(ValueError, match="echoes"):
        LoopState.resumed(snapshot, {"input": state.input, "params": without_tools})
    for bad in ("tools", ["id"], ["absent"]):  # not a list; a key whose value was kept; no such key
        with pytest.raises(ValueError):
            check_loop_state({**snapshot, "echoed": bad})
    check_loop_state(snapshot)


def test_a_state_written_whole_before_snapshots_left_the_request_out_keeps_its_own() -> None:
    state = a_state()
    whole = state.to_json()
    check_loop_state(whole)
    assert LoopState.resumed(whole, {"input": [], "params": {"other": 1}}) == state


@pytest.mark.parametrize("change", [lambda d: d.pop("input"), lambda d: d.update(extra=1),
                                    lambda d: d.update(turns="1"), lambda d: d.update(params=[])])
def test_a_state_neither_whole_nor_a_snapshot_is_refused(change: Callable[[dict[str, Any]], object]) -> None:
    data = a_state().to_json()
    change(data)
    with pytest.raises(ValueError):
        check_loop_state(data)


def test_a_restored_state_that_does_not_fit_its_request_is_a_structured_refusal() -> None:
    state = a_state_answered_with_echoes()
    snapshot = orjson.loads(orjson.dumps(state.view()))
    body = AgentRequest.model_validate({"input": state.input, "temperature": 0.0, "max_output_tokens": 16})
    with pytest.raises(InvalidCheckpointState, match="does not fit its request"):
        resumed_state(snapshot, body)  # the request has no tools for the echo to take


def test_a_sessions_record_does_not_grow_with_the_requests_tool_list() -> None:
    def record_bytes(tool_count: int) -> int:
        tools = [{**TOOLS[0], "name": f"tool_{n}", "description": "x" * 200} for n in range(tool_count)]
        state = a_state()
        state.params = {**state.params, "tools": tools}
        state.last_response = {"id": "resp_1", "tools": tools, "status": "completed"}  # as a Responses object echoes
        session = AgentSession(RolloutIdentity("r1"), running=Activation(1, "0" * 64, snapshot=state.view))
        return len(session.encoded().raw)

    one, fifty = record_bytes(1), record_bytes(50)
    assert fifty == one  # about 15 KB of tools, twice, in neither
