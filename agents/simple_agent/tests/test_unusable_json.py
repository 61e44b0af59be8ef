"""What the simple agent cannot write again as JSON is refused where it comes in: a ``/run`` row nested
deeper than its reply (and, with checkpointing, its record) can hold is 400 ``invalid_request``, and
so is a ``/v1/responses`` request nested deeper than the agent keeps the policy model's answer that
echoes it (its ``tools``); a policy model's answer or a ``/verify`` answer nested that deep is 502
``upstream_error``; an activation header that is no 64-bit integer is 400. None of them is a 500,
and none a record that fails a commit later."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI, Request, Response

from agents.simple_agent import app as agent_app
from agents.simple_agent.tests.test_checkpointed_run import ROW as RUN_ROW
from agents.simple_agent.tests.test_checkpointed_run import WAIT_S, Resources, run_agent
from model_servers.inference_worker.default_model_data import make_problem
from nemo_gym_ckpt.agent.sessions import RECORD_LEVELS
from nemo_gym_ckpt.canonical import MAX_JSON_LEVELS, nested
from nemo_gym_ckpt.client import EncodedJson
from nemo_gym_ckpt.config import ServerConfig, ServerRef
from nemo_gym_ckpt.errors import InvalidRequest
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.server import create_app
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.conformance import Control
from nemo_gym_ckpt.testing.scripted_model import ScriptedModel, calculator_policy, function_call, message
from nemo_gym_ckpt.testing.transports import InProcessMesh
from resources_servers.calculator_tools import app as calculator_app

pytestmark = pytest.mark.unit

PROBLEM = make_problem(random.Random(3))
ROW = {"responses_create_params": {"input": PROBLEM["question"]}, "expected_answer": PROBLEM["answer"]}
RID = RolloutIdentity("deep-1")
ANSWER_OUTPUT_LEVELS = 3
"""A Responses object's levels down to its items' fields: the object, ``output``, the item."""


def deep_answer_model(levels: int) -> FastAPI:
    """A policy model whose first answer is a function call carrying ``x_deep``, a value ``levels``
    levels deep (written by hand: no encoder of the mesh writes it), then a message."""
    app = create_app("policy_model")

    async def responses(request: Request) -> Response:
        body = await request.json()
        answered = body["input"][-1].get("type") == "function_call_output"
        item = message("done") if answered else function_call(PROBLEM["tool"], PROBLEM["arguments"])
        deep = "" if answered else ',"x_deep":' + "[" * levels + "1" + "]" * levels
        text = (b'{"id":"resp_1","object":"response","status":"completed","incomplete_details":null,"output":['
                + orjson.dumps(item)[:-1] + deep.encode() + b"}]}")
        return Response(text, media_type="application/json")

    app.add_api_route("/v1/responses", responses, methods=["POST"])
    return app


def build(model: FastAPI | None = None) -> tuple[InProcessMesh, FastAPI]:
    mesh = InProcessMesh({
        "policy_model": ("responses_api_models", "scripted", ServerConfig()),
        "calculator_tools": ("resources_servers", "calculator_tools", calculator_app.Config()),
        "simple_agent": ("responses_api_agents", "simple_agent", agent_app.Config(
            model_server=ServerRef(type="responses_api_models", name="policy_model"),
            resources_server=ServerRef(type="resources_servers", name="calculator_tools"))),
    })
    mesh.serve("policy_model", model or ScriptedModel(calculator_policy({PROBLEM["question"]: PROBLEM})).app())
    mesh.build("calculator_tools", calculator_app.create_app)
    return mesh, mesh.build("simple_agent", agent_app.create_app)


async def post(mesh: InProcessMesh, path: str, body: Any) -> httpx.Response:
    return await mesh.client().request("POST", mesh.url_of("simple_agent") + path, json=body, identity=RID,
                                       check=False)


def expect_error(reply: httpx.Response, status: int, code: str) -> str:
    assert reply.status_code == status, reply.text
    error: dict[str, str] = reply.json()["error"]
    assert error["code"] == code
    return error["detail"]


async def test_a_run_row_nested_deeper_than_its_reply_holds_is_a_400() -> None:
    mesh, _ = build()
    fits = {**ROW, "extra": nested(1, MAX_JSON_LEVELS - 1)}  # the row: MAX_JSON_LEVELS levels
    reply = await post(mesh, "/run", fits)
    assert reply.status_code == 200, reply.text
    assert reply.json()["reward"] == 1.0
    for levels in (MAX_JSON_LEVELS, 300):  # the row: one level deeper than the mesh writes, and more
        detail = expect_error(await post(mesh, "/run", row_with_extra(levels)), 400, "invalid_request")
        assert "cannot be written again as JSON" in detail
    await mesh.aclose()


def row_with_extra(levels: int, row: dict[str, Any] = ROW) -> EncodedJson:
    """``row`` with ``extra``, a value ``levels`` levels deep, written by hand (no encoder of the mesh
    writes it)."""
    return EncodedJson(orjson.dumps(row)[:-1] + b',"extra":' + b"[" * levels + b"1" + b"]" * levels + b"}")


@pytest.mark.parametrize("path", ["/run", "/v1/responses"])
async def test_a_model_answer_nested_deeper_than_the_agent_keeps_it_is_a_502(path: str) -> None:
    body = ROW if path == "/run" else ROW["responses_create_params"]
    mesh, _ = build(deep_answer_model(300))
    detail = expect_error(await post(mesh, path, body), 502, "upstream_error")
    assert "the policy model's answer cannot be written again" in detail
    await mesh.aclose()


async def test_a_run_keeps_a_model_answer_one_level_deeper_than_it_came() -> None:
    """A ``/run``'s reply holds the answer's items in its ``response``: the deepest answer it takes."""
    deepest = MAX_JSON_LEVELS - ANSWER_OUTPUT_LEVELS - agent_app.ANSWER_LEVELS
    mesh, _ = build(deep_answer_model(deepest))
    reply = await post(mesh, "/run", ROW)
    assert reply.status_code == 200, reply.text
    assert [item["type"] for item in reply.json()["response"]["output"]] == [
        "function_call", "function_call_output", "message"]
    await mesh.aclose()
    mesh, _ = build(deep_answer_model(deepest + 1))
    expect_error(await post(mesh, "/run", ROW), 502, "upstream_error")
    await mesh.aclose()


@pytest.mark.parametrize("value", ["\xb2", "\u0663", "9" * 5000, "9" * 19, "+1", " 1", "0", ""])
def test_an_activation_index_is_ascii_digits_of_a_64_bit_integer(value: str) -> None:
    with pytest.raises(InvalidRequest, match="x-ng-agent-activation must be an integer >= 1"):
        agent_app.parse_activation(value)


def test_activation_indexes_parse() -> None:
    assert [agent_app.parse_activation(v) for v in (None, "1", "007", "9" * 18)] == [None, 1, 7, int("9" * 18)]


@pytest.mark.parametrize("value", [b"\xb2", b"9" * 5000])
async def test_an_activation_header_that_int_refuses_is_a_400(value: bytes) -> None:
    mesh, app = build()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent")
    reply = await http.post("/ng-rollout/r1/v1/responses", json=ROW["responses_create_params"],
                            headers=[(b"x-ng-agent-activation", value)])
    detail = expect_error(reply, 400, "invalid_request")
    assert len(detail) < 200  # 5,000 digits are not echoed back
    await http.aclose()
    await mesh.aclose()


async def run_then_commit(root: Path, name: str, body: EncodedJson | dict[str, Any],
                          model_app: FastAPI | None = None, *, path: str = "/run",
                          resources: Resources | None = None) -> tuple[httpx.Response, list[dict[str, Any]]]:
    """One ``/run`` (or a call of ``path``) of the simple agent with checkpointing on, then a
    checkpoint of it in ``root/name``: the reply and the records written."""
    directory = root / name
    resources = resources or Resources(hold_close=False)
    async with run_agent(root, FakeClock(start=1_700_000_000.0), resources, model_app) as (pt, _):
        content = body.content if isinstance(body, EncodedJson) else orjson.dumps(body)
        reply = await pt.client.post(f"/ng-rollout/r{path}", content=content,
                                     headers={"content-type": "application/json"})
        control = Control(pt)
        await control.ok("prepare", checkpoint_id="c1")
        await control.ok("commit", checkpoint_id="c1", checkpoint_dir=str(directory),
                         episode_ids=[{"rollout_id": "r"}])
        await control.ok("resume", checkpoint_id="c1")
    records = [orjson.loads(line) for path in directory.rglob("records-*.jsonl")
               for line in path.read_bytes().splitlines()]
    return reply, records


async def test_with_checkpointing_a_run_row_must_fit_the_record_of_its_reply(root: Path) -> None:
    deepest = MAX_JSON_LEVELS - RECORD_LEVELS - 1  # the row's own level, then its field
    reply, records = await run_then_commit(root, "fits", {**RUN_ROW, "extra": nested(1, deepest)})
    assert reply.status_code == 200, reply.text
    [record] = records
    assert record["session"]["reply"]["response"]["extra"] == nested(1, deepest)  # the reply, in its record
    reply, records = await run_then_commit(root, "deeper", row_with_extra(deepest + 1, RUN_ROW))
    expect_error(reply, 400, "invalid_request")


async def test_with_checkpointing_a_model_answer_must_fit_the_records_that_keep_it(root: Path) -> None:
    deepest = MAX_JSON_LEVELS - ANSWER_OUTPUT_LEVELS - agent_app.ANSWER_LEVELS - RECORD_LEVELS
    reply, records = await run_then_commit(root, "fits", RUN_ROW, deep_answer_model(deepest))
    assert reply.status_code == 200, reply.text
    [record] = records
    assert record["session"]["reply"]["response"]["response"]["output"][0]["x_deep"] == nested(1, deepest)
    reply, _ = await run_then_commit(root, "deeper", RUN_ROW, deep_answer_model(deepest + 1))
    expect_error(reply, 502, "upstream_error")


# ---- a request's fields the policy model's answer echoes ------------------------------------------

TOOL_LEVELS = 4
"""A request's levels down to its tool's ``parameters`` fields: the body, ``tools``, the tool, ``parameters``."""


def request_with_deep_tool(levels: int) -> EncodedJson:
    """A ``/v1/responses`` body whose tool's ``parameters`` hold ``x``, a value ``levels`` levels deep
    (written by hand: no encoder of the mesh writes one too deep); the policy model echoes its tools."""
    deep = b"[" * levels + b"1" + b"]" * levels
    return EncodedJson(b'{"input":' + orjson.dumps(PROBLEM["question"])
                       + b',"tools":[{"type":"function","name":"f","parameters":{"x":' + deep + b"}}]}")


async def test_a_request_nested_deeper_than_the_agent_keeps_its_echo_is_a_400() -> None:
    deepest = MAX_JSON_LEVELS - agent_app.ANSWER_LEVELS - TOOL_LEVELS
    mesh, _ = build()
    reply = await post(mesh, "/v1/responses", request_with_deep_tool(deepest))
    assert reply.status_code == 200, reply.text
    assert reply.json()["tools"][0]["parameters"]["x"] == nested(1, deepest)  # the policy model's echo
    detail = expect_error(await post(mesh, "/v1/responses", request_with_deep_tool(deepest + 1)),
                          400, "invalid_request")  # before: 502, the policy model's echo of it refused
    assert "the request body cannot be written again" in detail
    await mesh.aclose()


async def test_with_checkpointing_a_request_must_fit_the_records_that_keep_its_echo(root: Path) -> None:
    deepest = MAX_JSON_LEVELS - agent_app.ANSWER_LEVELS - RECORD_LEVELS - TOOL_LEVELS
    reply, records = await run_then_commit(root, "fits", request_with_deep_tool(deepest), path="/v1/responses")
    assert reply.status_code == 200, reply.text
    [record] = records
    assert record["session"]["reply"]["response"]["tools"][0]["parameters"]["x"] == nested(1, deepest)
    reply, records = await run_then_commit(root, "deeper", request_with_deep_tool(deepest + 1), path="/v1/responses")
    expect_error(reply, 400, "invalid_request")  # before: 502 upstream_error, blaming the policy model
    assert records == []


def request_with_deep_input(levels: int) -> EncodedJson:
    """A ``/v1/responses`` body whose one input message carries ``x``, a value ``levels`` levels deep
    (the input is sent to the policy model, never echoed in its answer nor kept in a record)."""
    deep = b"[" * levels + b"1" + b"]" * levels
    message = orjson.dumps({"role": "user", "content": PROBLEM["question"]})[:-1]
    return EncodedJson(b'{"input":[' + message + b',"x":' + deep + b"}]}")


async def test_a_deep_input_the_agent_never_echoes_is_not_refused_as_an_echo(root: Path) -> None:
    deepest = MAX_JSON_LEVELS - 3  # the body, the input list and the message hold it: 254 levels in all
    reply, records = await run_then_commit(root, "input", request_with_deep_input(deepest), path="/v1/responses")
    assert reply.status_code == 200, reply.text  # the echo's bound is for what is echoed: the tools
    assert len(records) == 1


# ---- a /verify answer ------------------------------------------------------------------------------


class DeepVerdict(Resources):
    """``Resources`` whose verify answers ``x``, a value ``levels`` levels deep (no echo of its request)."""

    def __init__(self, levels: int, *, hold_close: bool = False) -> None:
        super().__init__(hold_close=hold_close)
        self.levels = levels

    def app(self) -> FastAPI:
        app = super().app()
        app.router.routes = [route for route in app.router.routes if getattr(route, "path", None) != "/verify"]

        async def verify(request: Request) -> Response:
            self.verifies += 1
            deep = b"[" * self.levels + b"1" + b"]" * self.levels
            return Response(b'{"reward":1.0,"x":' + deep + b"}", media_type="application/json")

        app.add_api_route("/verify", verify, methods=["POST"])
        return app


VERDICT_OWN_LEVELS = 1
"""A verdict's own level above its ``x``."""


async def test_a_verdict_nested_deeper_than_the_reply_holds_is_a_502() -> None:
    deepest = MAX_JSON_LEVELS - VERDICT_OWN_LEVELS
    for levels, status in ((deepest, 200), (deepest + 1, 502)):  # before: a 500 at the route
        mesh, _ = build()
        mesh.serve("calculator_tools", DeepVerdict(levels).app())
        reply = await post(mesh, "/run", ROW)
        assert reply.status_code == status, reply.text
        if status == 502:
            assert "the resources server's /verify answer cannot be written again" in expect_error(
                reply, 502, "upstream_error")
        await mesh.aclose()


async def test_with_checkpointing_a_verdict_must_fit_the_running_state_that_keeps_it(root: Path) -> None:
    """A checkpoint that lands while the ``/run`` closes its resources session keeps the verdict in its
    running state, ``VERDICT_LEVELS`` deeper: the deepest verdict that fits there commits; one level
    deeper is a 502 for the ``/run`` (before: 200, and the commit failed with an unusable record)."""
    in_running_state = RECORD_LEVELS + 1  # the record holds the running state that deep, the state its verdict
    deepest = MAX_JSON_LEVELS - in_running_state - VERDICT_OWN_LEVELS
    resources = DeepVerdict(deepest, hold_close=True)
    directory = root / "fits"
    async with run_agent(root, FakeClock(start=1_700_000_000.0), resources) as (pt, _):
        run = asyncio.create_task(pt.client.post("/ng-rollout/r/run", json=RUN_ROW))
        await asyncio.wait_for(resources.close_arrived.wait(), WAIT_S)  # verified; closing
        control = Control(pt)
        await control.ok("prepare", checkpoint_id="c1")
        await control.ok("commit", checkpoint_id="c1", checkpoint_dir=str(directory),
                         episode_ids=[{"rollout_id": "r"}])
        await control.ok("resume", checkpoint_id="c1")
        resources.release_close.set()
        reply = await asyncio.wait_for(run, WAIT_S)
    assert reply.status_code == 200, reply.text
    [record] = [orjson.loads(line) for path in directory.rglob("records-*.jsonl")
                for line in path.read_bytes().splitlines()]
    assert record["session"]["running"]["state"]["verdict"]["x"] == nested(1, deepest)
    reply, _ = await run_then_commit(root, "deeper", RUN_ROW, resources=DeepVerdict(deepest + 1))
    assert "the resources server's /verify answer" in expect_error(reply, 502, "upstream_error")
