"""``nemo_gym_ckpt.echoes``: a reply's echoes of its request left out (nulled in place, named) and
put back from the request, as canonical JSON decides what is an echo."""

from __future__ import annotations

import orjson
import pytest

from nemo_gym_ckpt.echoes import echoed_keys, with_echoes, without_echoes

pytestmark = pytest.mark.unit

TOOLS = [{"type": "function", "name": "add", "parameters": {"type": "object", "properties": {}}, "strict": True}]
REQUEST = {"input": "2+2?", "tools": TOOLS, "instructions": "Be brief.", "temperature": 0.5,
           "text": {"format": {"type": "text"}}}


def test_only_equal_objects_arrays_and_strings_are_echoes() -> None:
    reply = {"id": "r1", "tools": [{"strict": True, "parameters": {"properties": {}, "type": "object"},
                                    "name": "add", "type": "function"}],  # the same, keys in another order
             "instructions": "Be briefer.", "temperature": 0.5, "text": {"format": {"type": "json"}}, "input": "2+2?"}
    assert echoed_keys(reply, REQUEST) == ["tools", "input"]  # a scalar is never one; unequal values are not


@pytest.mark.parametrize(("mine", "theirs"), [([1], [1.0]), ([True], [1]), ({"a": None}, {}), ("x", ["x"])])
def test_json_values_that_python_calls_equal_are_not_echoes_unless_their_json_is(mine: object, theirs: object) -> None:
    assert echoed_keys({"v": mine}, {"v": theirs}) == []


def test_a_reply_without_its_echoes_is_the_same_reply_again_key_order_included() -> None:
    reply = {"id": "r1", "tools": TOOLS, "status": "completed", "instructions": "Be brief."}
    echoed = echoed_keys(reply, REQUEST)
    kept = without_echoes(reply, echoed)
    assert kept == {"id": "r1", "tools": None, "status": "completed", "instructions": None}
    again = with_echoes(orjson.loads(orjson.dumps(kept)), echoed, REQUEST)
    assert orjson.dumps(again) == orjson.dumps(reply)


@pytest.mark.parametrize(("reply", "request_"), [({"id": "r1"}, REQUEST), ({"tools": None}, {"input": "x"})])
def test_an_echo_that_the_reply_or_its_request_lacks_is_refused(reply: dict, request_: dict) -> None:
    with pytest.raises(ValueError, match="lacks"):
        with_echoes(reply, ["tools"], request_)
