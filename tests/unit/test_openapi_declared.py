"""Every server's OpenAPI declares what its routes take and answer, and every request field is bounded.

Built with checkpointing on (so the control and cut routes are there) for every implementation of
the project. For every operation: the structured error replies (``ErrorBody``) for each error
status instead of FastAPI's default 422; for every POST that reads a body, its request body; and in
every declared body, no integer or number without a maximum, no string without a length bound (or
a pattern, or a fixed set), no list without a maximum size. Then the body limit (413 before the
handler runs, or while the body arrives) and ``Allow`` on 405 on the served apps.
"""

from __future__ import annotations

import asyncio
import importlib
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from nemo_gym_ckpt import server as server_module
from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.launch.child import build_app
from nemo_gym_ckpt.server import ERROR_STATUSES
from tests.unit.test_every_route_refuses_garbage import MESH as GARBAGE_MESH

pytestmark = pytest.mark.unit

MESH: dict[str, Any] = {
    **GARBAGE_MESH,
    "math_verify": {"resources_servers": {"math_verify": {}}},
    "python_repl": {"resources_servers": {"python_repl": {}}},
    "restart_only_agent": {"responses_api_agents": {"restart_only_agent": {
        "model_server": {"type": "responses_api_models", "name": "policy_model"},
        "resources_server": {"type": "resources_servers", "name": "calculator_tools"}}}},
}
BODILESS = {"/close_session", "/close"}  # POSTs that read no body (the session is the cookie or the prefix)
INSTANCES = [name for name in MESH if name != "checkpoint"]


def app_of(name: str, mesh: dict[str, Any] = MESH) -> FastAPI:
    config = load_config_dict(mesh)
    instance = config.instance(name)
    module = importlib.import_module(instance.module)
    return module.create_app(ServerContext(name=name, settings=instance.settings, mesh=config))  # type: ignore[no-any-return]


def unbounded(schema: Any, defs: dict[str, Any], where: str = "", seen: frozenset[str] = frozenset()) -> list[str]:
    """The places in ``schema`` where a number, string or list from outside has no bound."""
    if not isinstance(schema, dict):
        return []
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return [] if name in seen else unbounded(defs[name], defs, f"{where}<{name}>", seen | {name})
    found = [place for key in ("anyOf", "oneOf", "allOf") for sub in schema.get(key, ())
             for place in unbounded(sub, defs, where, seen)]
    kind = schema.get("type")
    if kind in ("integer", "number") and not ({"maximum", "exclusiveMaximum"} & set(schema)):
        found.append(f"{where} ({kind})")
    if kind == "string" and not ({"maxLength", "pattern", "enum", "const"} & set(schema)):
        found.append(f"{where} (string)")
    if kind == "array":
        if "maxItems" not in schema:
            found.append(f"{where} (array)")
        found += unbounded(schema.get("items"), defs, f"{where}[]", seen)
    for key, sub in schema.get("properties", {}).items():
        found += unbounded(sub, defs, f"{where}.{key}", seen)
    if isinstance(schema.get("additionalProperties"), dict):
        found += unbounded(schema["additionalProperties"], defs, f"{where}.*", seen)
    return found


@pytest.mark.parametrize("name", INSTANCES)
def test_every_operation_declares_its_body_and_its_structured_errors(name: str) -> None:
    spec = app_of(name).openapi()
    defs = spec["components"]["schemas"]
    assert "HTTPValidationError" not in defs and set(defs["ErrorBody"]["properties"]) == {"error"}
    problems = []
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            where = f"{method.upper()} {path}"
            declared = {int(status) for status in operation["responses"] if status.isdigit()}
            if not set(ERROR_STATUSES) <= declared:
                problems.append(f"{where}: errors {sorted(set(ERROR_STATUSES) - declared)} undeclared")
            error = operation["responses"]["400"]["content"]["application/json"]["schema"]
            if error != {"$ref": "#/components/schemas/ErrorBody"}:
                problems.append(f"{where}: 400 is not an ErrorBody")
            body = operation.get("requestBody")
            if method == "post" and body is None and path.split("/ng-rollout")[-1] not in BODILESS:
                problems.append(f"{where}: no request body declared")
            if body is not None:
                problems += [f"{where}: {place} unbounded"
                             for place in unbounded(body["content"]["application/json"]["schema"], defs)]
    assert problems == [], "\n".join(problems)


def served(name: str, **settings: Any) -> httpx.AsyncClient:
    """The app of instance ``name`` as its server process runs it, ``settings`` added to its block."""
    mesh = dict(MESH)
    if settings:
        block = dict(mesh[name])
        kind = next(iter(block))
        impl = next(iter(block[kind]))
        block[kind] = {impl: {**block[kind][impl], **settings}}
        mesh[name] = block
    app = build_app(load_config_dict(mesh), name)  # what a server process runs
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def test_a_body_over_the_configured_limit_is_413_before_or_while_it_arrives() -> None:
    big = b'{"responses_create_params": {"input": "' + b"x" * 8192 + b'"}}'

    async def chunks() -> Any:
        for start in range(0, len(big), 1000):
            yield big[start : start + 1000]

    json_type = {"content-type": "application/json"}
    async with served("single_agent_turn", max_body_bytes=4096) as http:
        declared = await http.post("/ng-rollout/r1/run", content=big, headers=json_type)
        streamed = await http.post("/ng-rollout/r1/run", content=chunks(), headers=json_type)
        control = await http.post("/ng-control/v1/checkpoint/prepare", content=big,
                                  headers={"authorization": "Bearer t0ken"})
        small = await http.post("/ng-rollout/r1/run", content=b"[]", headers=json_type)
    for reply in (declared, streamed, control):
        assert reply.status_code == 413, reply.text
        assert reply.json()["error"]["code"] == "payload_too_large" and "4096" in reply.json()["error"]["detail"]
    assert small.status_code == 400  # under the limit: the body itself is judged


async def test_a_body_that_stops_arriving_is_408_and_holds_no_run_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "BODY_PART_TIMEOUT_S", 0.3)
    never = asyncio.Event()

    async def stalled() -> Any:
        yield b'{"responses_create_params": '
        await never.wait()  # the rest never comes, the connection stays open

    json_type = {"content-type": "application/json"}
    async with served("single_agent_turn", max_rollouts_in_flight=1) as http:
        waiting = asyncio.create_task(http.post("/ng-rollout/r1/run", content=stalled(), headers=json_type))
        await asyncio.sleep(0.1)
        meanwhile = await http.post("/ng-rollout/r2/run", content=b"[]", headers=json_type)
        timed_out = await asyncio.wait_for(waiting, 10)
        after = await http.post("/ng-rollout/r3/run", content=b"[]", headers=json_type)
    assert meanwhile.status_code == 429  # the stalled body held the one slot...
    assert timed_out.status_code == 408, timed_out.text
    assert timed_out.json()["error"]["code"] == "request_timeout"
    assert after.status_code == 400  # ...and let it go at its deadline: this body is judged


async def test_a_body_that_stops_arriving_is_408_on_a_route_whose_body_fastapi_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server_module, "BODY_PART_TIMEOUT_S", 0.3)
    never = asyncio.Event()

    async def stalled() -> Any:
        yield b'{"input": '
        await never.wait()

    async with served("simple_agent") as http:  # its /v1/responses takes a pydantic model
        timed_out = await asyncio.wait_for(http.post("/ng-rollout/r1/v1/responses", content=stalled(),
                                                     headers={"content-type": "application/json"}), 10)
    assert timed_out.status_code == 408, timed_out.text
    assert timed_out.json()["error"]["code"] == "request_timeout"


async def test_a_405_names_the_allowed_methods() -> None:
    async with served("inference_worker") as http:
        wrong = await http.put("/ng-control/v1/policy-version")
    async with served("policy_model") as http:
        control = await http.get("/ng-control/v1/checkpoint/prepare")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "GET, POST"
    assert wrong.json()["error"]["code"] == "method_not_allowed"
    assert control.status_code == 405 and control.headers["allow"] == "POST"


HUGE = "18446744073709551616"  # 2**64: no encoder of the mesh (orjson) writes it back
FREE_FORM_FIELDS = [
    ("simple_agent", "/v1/responses", '{"input": "hi", "passed_through": {"n": %s}}'),
    ("policy_model", "/v1/responses",
     '{"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"x": %s}}]}'),
    ("policy_model", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}],'
     ' "tools": [{"type": "function", "function": {"name": "f", "parameters": {"x": %s}}}]}'),
]


@pytest.mark.parametrize(("name", "path", "body"), FREE_FORM_FIELDS)
async def test_an_integer_outside_64_bits_in_a_free_form_field_is_a_400(name: str, path: str, body: str) -> None:
    async with served(name) as http:  # these once raised TypeError (a 500) while hashing the request
        reply = await http.post(f"/ng-rollout/fz-1{path}", content=(body % HUGE).encode(),
                                headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"] == {"code": "invalid_request",
                                     "detail": "an integer of 20 digits is outside the 64-bit range"}


class _Part(BaseModel):
    n: int


class _Body(BaseModel):
    part: _Part


def test_a_declared_body_is_made_once_per_model_and_each_route_gets_its_own_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[str] = []
    schema_of = _Body.model_json_schema

    def counted(*args: Any, **kwargs: Any) -> dict[str, Any]:
        made.append(_Body.__name__)
        return schema_of(*args, **kwargs)

    monkeypatch.setattr(_Body, "model_json_schema", counted)
    first = server_module.declare_body(_Body)
    schema = first["requestBody"]["content"]["application/json"]["schema"]
    assert schema["properties"]["part"] == {"$ref": "#/components/schemas/_Part"} and "_Part" in schema["$defs"]
    schema.pop("$defs")  # what the OpenAPI document does with it
    second = server_module.declare_body(_Body)
    assert "_Part" in second["requestBody"]["content"]["application/json"]["schema"]["$defs"]
    assert made == ["_Body"]
