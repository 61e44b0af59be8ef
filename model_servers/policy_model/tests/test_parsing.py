"""Tool-call parsing and where visible text ends (pure functions)."""

from __future__ import annotations

import pytest

from model_servers.policy_model.text_cut import cut_at_markers
from model_servers.policy_model.tool_calls import ParsedCall, parse_turn

pytestmark = pytest.mark.unit

END = "<|end|>"
CALL_OPEN = "<tool_call>"


def test_one_call_no_content() -> None:
    turn = parse_turn('<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>')
    assert turn.content == ""
    assert turn.calls == [ParsedCall("add", '{"a":1,"b":2}')]


def test_several_calls_with_text_around_them() -> None:
    text = (
        'Let me see. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        ' and <tool_call>{"name":"multiply","arguments":{"b":3,"a":4}}</tool_call> done'
    )
    turn = parse_turn(text)
    assert [call.name for call in turn.calls] == ["add", "multiply"]
    assert turn.calls[0].arguments == '{"a":1,"b":2}'  # compact, as the chat template writes it
    assert turn.calls[1].arguments == '{"b":3,"a":4}'  # key order kept
    assert turn.content == "Let me see.  and  done"


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>{"name":"add","arguments":{"a":1,</tool_call>',  # malformed JSON
        '<tool_call>["add"]</tool_call>',  # not an object
        '<tool_call>{"arguments":{}}</tool_call>',  # no name
        '<tool_call>{"name":"add","arguments":[1,2]}</tool_call>',  # arguments not an object
        '<tool_call>{"name":"add","arguments":{"a":1}',  # unclosed (cut by max_tokens)
    ],
)
def test_a_bad_block_is_no_call_and_stays_in_the_content(block: str) -> None:
    turn = parse_turn(f"before {block}")
    assert turn.calls == []
    assert turn.content == f"before {block}"


def test_a_bad_block_does_not_spoil_a_good_one() -> None:
    good = '<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>'
    bad = "<tool_call>{oops}</tool_call>"
    turn = parse_turn(good + bad)
    assert turn.calls == [ParsedCall("add", '{"a":1,"b":2}')]
    assert turn.content == bad


def test_arguments_given_as_a_json_string_are_accepted() -> None:
    turn = parse_turn('<tool_call>{"name":"add","arguments":"{\\"a\\": 5}"}</tool_call>')
    assert turn.calls == [ParsedCall("add", '{"a":5}')]


def test_cut_at_the_earliest_marker() -> None:
    assert cut_at_markers("abc<|end|>", [END]) == "abc"
    assert cut_at_markers("one STOP two<|end|>", [END, "STOP"]) == "one "
    assert cut_at_markers("plain", [END, ""]) == "plain"
