"""The simple agent's loop, as explicit JSON state that advances one call at a time.

    model call ──function calls──> tool call ... tool call ──> model call ──> ... ──> stop
             └──message without calls: "answer"; incomplete_details: "incomplete"; nothing: "no_action"
    after the tool calls of the max_steps-th model call: "max_steps"

``LoopState`` holds everything the loop needs to go on: the original input and the request's
other parameters (the request's own fields, ``REQUEST_FIELDS``), every output item so far (passed
back verbatim as the next model input, so token ids are reused), the summed usage, the model calls
made (``turns``, and ``model_calls``: the policy model's ids of them in order, the call lineage),
the function calls still to run, the cookies of the resources and model servers, and the last model
response. ``advance`` makes exactly one call and updates the state after it returns, without
awaiting anything else, so a state taken between two calls, or while a call is in flight, is a
point the loop can continue from (the agent's checkpoint boundary).

A checkpoint's snapshot of the state (``view``) leaves out what the request gives: after a
restore the activation is invoked again with the same request (its digest checked), and the
resumed state takes it from there (``resumed``). That is the request's own fields, and the last
response's echoes of its parameters (a Responses object repeats the request's tools and
instructions). The tool list, written once per session and checkpoint, would otherwise be most of
the agent's bytes.

Tool calls that cannot be made (a name that is not a tool route, arguments that are not a JSON
object, or one nested deeper than the mesh writes) and tools that answer an error become the tool
output text the model sees; so do the calls of one model turn past ``max_tool_calls_per_turn``
(``MAX_TOOL_CALLS_PER_TURN`` by default): they are answered in order, after the calls that run,
without calling anything. A model call that fails, or a resources server that cannot be reached,
fails the loop.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Protocol

import orjson
from pydantic import TypeAdapter

from nemo_gym_ckpt.echoes import echoed_keys, with_echoes, without_echoes
from nemo_gym_ckpt.errors import UpstreamError
from nemo_gym_ckpt.responses import add_usage

__all__ = [
    "MAX_TOOL_CALLS_PER_TURN",
    "POLICY_VERSIONS",
    "REQUEST_FIELDS",
    "LoopCalls",
    "LoopState",
    "ModelReply",
    "StopReason",
    "advance",
    "call_policy_versions",
    "check_loop_state",
    "response_object",
    "run_loop",
    "tool_request",
]

StopReason = Literal["answer", "incomplete", "no_action", "max_steps"]
MAX_TOOL_CALLS_PER_TURN = 64
"""Tool calls of one model turn that run, by default; the turn's later calls are answered with an error."""
_TOOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")


@dataclass(frozen=True)
class ModelReply:
    """One model call's answer: the Responses object, the cookies it set, and the call's id in the
    policy model's capture ledger (its ``x-nemo-gym-model-call-id``; None when it has none)."""

    response: dict[str, Any]
    cookies: dict[str, str]
    call_id: str | None = None


class LoopCalls(Protocol):
    """The two calls the loop makes (the agent implements them over HTTP)."""

    async def call_model(self, body: dict[str, Any], cookies: dict[str, str]) -> ModelReply:
        """One policy-model ``/v1/responses`` call."""
        ...

    async def call_tool(
        self, name: str, arguments: dict[str, Any], cookies: dict[str, str]
    ) -> tuple[str, dict[str, str]]:
        """One tool call on the resources server: the reply text and the cookies it set."""
        ...


@dataclass
class LoopState:
    """Where one agent loop stands; plain JSON data (``to_json``/``from_json``)."""

    input: list[dict[str, Any]]
    params: dict[str, Any]
    max_steps: int
    outputs: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    turns: int = 0
    pending: list[dict[str, Any]] = field(default_factory=list)
    """What the last model turn still waits for, in call order: function calls to run, then the
    ``function_call_output`` items answering its calls past the turn's bound (``_answers_of``)."""
    cookies: dict[str, str] = field(default_factory=dict)
    model_cookies: dict[str, str] = field(default_factory=dict)
    last_response: dict[str, Any] | None = None
    stop_reason: StopReason | None = None
    model_calls: list[str | None] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """An independent copy as plain JSON data, fields in order (a JSON round trip: the state is
        JSON already; ``dataclasses.asdict`` deep-copies every leaf one by one: about 100x slower on a 3 KB state)."""
        data: dict[str, Any] = orjson.loads(orjson.dumps(self))
        return data

    def view(self) -> dict[str, Any]:
        """The snapshot a checkpoint keeps: the fields as they stand, in order, sharing their lists
        and dicts with this state (for a caller that copies what it keeps, as an agent's record does:
        it copies every container and leaves the token arrays out, so a copy of them first, as
        ``to_json`` makes, is wasted), but what the request gives: the request's own fields
        (``REQUEST_FIELDS``) are left out, and so are the last response's echoes of the request's
        parameters (its tools, its instructions: a value equal to the parameter of the same name),
        null there and named in ``echoed``."""
        snapshot = {name: getattr(self, name) for name in _SNAPSHOT_ORDER}
        response = self.last_response
        echoed = echoed_keys(response, self.params) if response else []
        if response and echoed:
            snapshot["last_response"] = without_echoes(response, echoed)
        snapshot["echoed"] = echoed
        return snapshot

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LoopState:
        """A state read back (an independent copy); ``ValueError`` when it is not one."""
        if set(data) != _STATE_FIELDS:
            raise ValueError(f"a loop state has the fields {sorted(_STATE_FIELDS)}, got {sorted(data)}")
        _STATE_ADAPTER.validate_json(json.dumps(data), strict=True)
        return cls(**copy.deepcopy(data))

    @classmethod
    def resumed(cls, snapshot: dict[str, Any], request: dict[str, Any]) -> LoopState:
        """The state a snapshot (``view``) was taken of, what it left out taken from ``request`` (the
        activation's request, invoked again); a whole state (written before snapshots left anything
        out) is read as it is. ``ValueError`` when it is not one, or names an echo the request lacks."""
        if "echoed" not in snapshot:
            return cls.from_json(snapshot)
        data = {**{name: request[name] for name in REQUEST_FIELDS}, **snapshot}
        echoed, response = data.pop("echoed"), data["last_response"]
        if echoed:
            if not isinstance(response, dict) or not isinstance(data["params"], dict):
                raise ValueError("a snapshot that names echoes has a last response and the request parameters")
            data["last_response"] = with_echoes(response, echoed, data["params"])
        return cls.from_json(data)


REQUEST_FIELDS = ("input", "params")
"""The state's fields that are its activation's request: a snapshot leaves them out."""
_FIELD_ORDER = tuple(f.name for f in fields(LoopState))
_SNAPSHOT_ORDER = tuple(name for name in _FIELD_ORDER if name not in REQUEST_FIELDS)
_STATE_FIELDS = frozenset(_FIELD_ORDER)
_SNAPSHOT_FIELDS = frozenset({*_SNAPSHOT_ORDER, "echoed"})
_STATE_ADAPTER = TypeAdapter(LoopState)
_ECHOED_ADAPTER = TypeAdapter(list[str])


def check_loop_state(data: dict[str, Any]) -> None:
    """``ValueError`` unless ``data`` is a ``LoopState`` as ``to_json`` writes it, or a snapshot of
    one as ``view`` answers it (without what the request gives)."""
    keys = set(data)
    if keys == _STATE_FIELDS:
        _STATE_ADAPTER.validate_json(json.dumps(data), strict=True)
        return
    if keys != _SNAPSHOT_FIELDS:
        raise ValueError(f"a loop state has the fields {sorted(_STATE_FIELDS)} (a snapshot: all but "
                         f"{list(REQUEST_FIELDS)}, and echoed), got {sorted(data)}")
    snapshot = dict(data)
    echoed = _ECHOED_ADAPTER.validate_python(snapshot.pop("echoed"), strict=True)
    stand_ins: dict[str, Any] = {"input": [], "params": {}}  # the request brings them
    _STATE_ADAPTER.validate_json(json.dumps({**stand_ins, **snapshot}), strict=True)
    response = snapshot["last_response"] or {}
    if any(response.get(key, ...) is not None for key in echoed):
        raise ValueError(f"a snapshot's echoes {echoed} are keys of its last response, each null there")


def tool_request(call: dict[str, Any]) -> tuple[str, dict[str, Any]] | str:
    """The (name, arguments) of a function call, or the error text the model gets instead."""
    name = call.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.match(name):
        return _error_text(f"unknown tool {name!r}")
    try:
        arguments = json.loads(call.get("arguments") or "{}")
    except RecursionError:  # the standard library's reader gives up on deep nesting this way
        return _error_text(f"arguments of {name} are nested too deeply")
    except (TypeError, ValueError) as error:
        return _error_text(f"arguments of {name} are not valid JSON: {error}")
    if not isinstance(arguments, dict):
        return _error_text(f"arguments of {name} must be a JSON object")
    try:
        orjson.dumps(arguments)  # what the tool call sends: nesting past MAX_JSON_LEVELS, a 65-bit integer
    except orjson.JSONEncodeError as error:
        return _error_text(f"arguments of {name} cannot be sent as JSON: {error}")
    return name, arguments


def _error_text(detail: str, code: str = "invalid_tool_call") -> str:
    return json.dumps({"error": {"code": code, "detail": detail}})


async def advance(
    state: LoopState, calls: LoopCalls, *, max_tool_calls_per_turn: int = MAX_TOOL_CALLS_PER_TURN
) -> None:
    """Make the next call of the loop (a pending tool call first, else a model call): at most
    ``max_tool_calls_per_turn`` of a model turn's function calls run, the rest are answered with an error."""
    if state.stop_reason is not None:
        raise ValueError(f"the loop has stopped ({state.stop_reason})")
    if state.pending:
        await _next_tool_call(state, calls)
    else:
        await _model_call(state, calls, max_tool_calls_per_turn)


async def run_loop(
    state: LoopState, calls: LoopCalls, *, max_tool_calls_per_turn: int = MAX_TOOL_CALLS_PER_TURN
) -> LoopState:
    """Advance until the loop stops; answers the same (updated) state."""
    while state.stop_reason is None:
        await advance(state, calls, max_tool_calls_per_turn=max_tool_calls_per_turn)
    return state


async def _model_call(state: LoopState, calls: LoopCalls, max_tool_calls: int) -> None:
    body = {**state.params, "input": [*state.input, *state.outputs]}
    reply = await calls.call_model(body, state.model_cookies)
    response = reply.response
    output = response.get("output")
    if not isinstance(output, list) or not all(isinstance(item, dict) for item in output):
        raise UpstreamError("the policy model answered a response without an output list")
    state.model_cookies.update(reply.cookies)
    state.outputs.extend(output)
    state.usage = add_usage(state.usage, response.get("usage"))
    state.turns += 1
    state.model_calls.append(reply.call_id)
    state.last_response = {key: value for key, value in response.items() if key != "output"}
    function_calls = [item for item in output if item.get("type") == "function_call"]
    if response.get("incomplete_details"):
        state.stop_reason = "incomplete"
    elif function_calls:
        state.pending = _answers_of(function_calls, max_tool_calls)
    else:
        has_message = any(item.get("type") == "message" for item in output)
        state.stop_reason = "answer" if has_message else "no_action"


def _answers_of(function_calls: list[dict[str, Any]], max_tool_calls: int) -> list[dict[str, Any]]:
    """A turn's pending list: its first ``max_tool_calls`` calls, then each later call's error output
    (answered in order after the calls that run, so every call has its output and none runs)."""
    refused = [_output(call, _error_text(
        f"{call.get('name')!r} was not called: at most {max_tool_calls} tool calls run per model turn",
        "too_many_tool_calls")) for call in function_calls[max_tool_calls:]]
    return [*function_calls[:max_tool_calls], *refused]


def _output(call: dict[str, Any], text: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call.get("call_id"), "output": text}


async def _next_tool_call(state: LoopState, calls: LoopCalls) -> None:
    call = state.pending[0]
    if call.get("type") == "function_call_output":  # a call past the turn's bound, answered already
        state.outputs.append(call)
    else:
        state.outputs.append(_output(call, await _tool_output(state, calls, call)))
    state.pending.pop(0)
    if not state.pending and state.turns >= state.max_steps:
        state.stop_reason = "max_steps"


async def _tool_output(state: LoopState, calls: LoopCalls, call: dict[str, Any]) -> str:
    """The text answering ``call``: the tool's reply, or why it could not be called."""
    request = tool_request(call)
    if isinstance(request, str):
        return request
    text, cookies = await calls.call_tool(*request, state.cookies)
    state.cookies.update(cookies)
    return text


POLICY_VERSIONS = "policy_versions"
"""The ``metadata`` key of the agent's answer listing each model call's policy version (JSON text)."""


def response_object(state: LoopState) -> dict[str, Any]:
    """The agent's answer: the last model response with the whole trajectory and the summed usage.

    When its model calls carried ``policy_version``, ``metadata.policy_versions`` lists them, one per
    call in order, as JSON text: NeMo Gym's response model keeps ``metadata`` (string values) and
    drops unknown item fields, so this is where a row keeps its versions for NeMo Gym's readers.
    """
    answer = {**(state.last_response or {}), "output": state.outputs, "usage": state.usage}
    versions = call_policy_versions(state.outputs)
    if versions is not None:
        metadata = answer.get("metadata")
        answer["metadata"] = {**(metadata if isinstance(metadata, dict) else {}),
                              POLICY_VERSIONS: json.dumps(versions, separators=(",", ":"))}
    return answer


def call_policy_versions(outputs: list[dict[str, Any]]) -> list[Any] | None:
    """Each model call's ``policy_version`` (a call is a run of items between tool outputs); None when
    no item carries one."""
    versions: list[Any] = []
    in_call = False
    for item in outputs:
        if item.get("type") == "function_call_output":
            in_call = False
            continue
        if not in_call:
            versions.append(None)
            in_call = True
        if "policy_version" in item and versions[-1] is None:
            versions[-1] = item["policy_version"]
    return versions if any("policy_version" in item for item in outputs) else None
