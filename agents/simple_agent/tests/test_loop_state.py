"""``LoopState.to_json``: the state a session's record carries, as plain JSON, an independent copy;
``LoopState.view``: the same fields without a copy, which a session's record copies itself."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from agents.simple_agent.loop import LoopState
from nemo_gym_ckpt.agent.sessions import Activation, AgentSession
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
    assert orjson.dumps(view) == orjson.dumps(state.to_json()) and view["outputs"] is state.outputs  # no copy
    session = AgentSession(RolloutIdentity("r1"), running=Activation(1, "0" * 64, snapshot=state.view))
    record = session.encoded()
    kept = orjson.dumps(record.data)
    state.outputs.append({"type": "message"})  # the work moves on after the commit
    state.outputs[0]["status"] = "completed"
    state.cookies["s"] = "2"
    assert orjson.dumps(record.data) == kept == record.raw  # the record copied what it keeps
    assert "generation_token_ids" not in record.raw.decode()  # and left the token arrays out
