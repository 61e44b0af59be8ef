"""Garbage posted to every route of every server kind gets a structured 4xx, never a 500.

The apps are built from the quickstart config plus every other implementation in the project, with
checkpointing on (so the control routes are mounted too), and walked through their OpenAPI paths.

NeMo Gym's own verifiers, wrapped in our participant shell, get the same garbage on real processes
(they run in NeMo Gym's Python 3.13 environment: ``$NEMO_GYM_PYTHON``, else built by
``scripts/nemo_gym_env.sh``; never skipped): one of each family (rule ``string_match``, judge
``equivalence_llm_judge`` with its judge model, code ``nvarc`` inductive, cohort ``genrm_compare``),
every route of their OpenAPI and our control routes.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from nemo_gym_ckpt.checkpoint.router import CONTROL_PREFIX
from nemo_gym_ckpt.config import NEMO_GYM_PYTHON_ENV, load_config_dict
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.launch.launcher import MeshLauncher
from tests.support.nemo_gym_env import nemo_gym_python
from tests.support.verifier_cases import verifier_mesh

REF = {"type": "responses_api_models", "name": "policy_model"}
MESH: dict[str, Any] = {
    "checkpoint": {"enabled": True, "control_auth_token": "t0ken", "root": "/tmp/ngc-garbage"},
    "inference_worker": {"responses_api_models": {"inference_worker": {}}},
    "policy_model": {"responses_api_models": {"policy_model": {
        "worker": {"type": "responses_api_models", "name": "inference_worker"}, "checkpoint_policy": True}}},
    "calculator_tools": {"resources_servers": {"calculator_tools": {}}},
    "string_match": {"resources_servers": {"string_match": {}}},
    "mcqa": {"resources_servers": {"mcqa": {}}},
    "kv_store": {"resources_servers": {"kv_store": {}}},
    "simple_agent": {"responses_api_agents": {"simple_agent": {
        "model_server": REF, "resources_server": {"type": "resources_servers", "name": "calculator_tools"}}}},
    "single_agent_turn": {"environment_servers": {"single_agent_turn": {
        "agent_server": {"type": "responses_api_agents", "name": "simple_agent"},
        "resources_server": {"type": "resources_servers", "name": "calculator_tools"}}}},
    "nim": {"environment_servers": {"nim": {
        "agent_server": {"type": "responses_api_agents", "name": "simple_agent"}}}},
}
GARBAGE: list[tuple[str, dict[str, str]]] = [
    ("{not json", {"content-type": "application/json"}),
    ("[1, 2, 3]", {"content-type": "application/json"}),
    ('{"unexpected": {"deeply": [null, 1e999]}}', {"content-type": "application/json"}),
    ("\x00\xff binary", {"content-type": "application/octet-stream"}),
]


def _app(name: str) -> FastAPI:
    mesh = load_config_dict(MESH)
    instance = mesh.instance(name)
    module = importlib.import_module(instance.module)
    return module.create_app(ServerContext(name=name, settings=instance.settings, mesh=mesh))  # type: ignore[no-any-return]


def _routes(app: FastAPI) -> list[tuple[str, str, bool]]:
    """(method, path, takes a body) for every route without path parameters."""
    paths = app.openapi()["paths"]
    return [(method.upper(), path, "requestBody" in op)
            for path, ops in paths.items() for method, op in ops.items() if "{" not in path]


def _instances() -> list[str]:
    return [name for name in MESH if name != "checkpoint"]


@pytest.mark.unit
@pytest.mark.parametrize("name", _instances())
async def test_garbage_on_every_route_gets_a_structured_4xx(name: str) -> None:
    app = _app(name)
    routes = _routes(app)
    assert routes, f"{name} exposes no route"
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as http:
        await _post_garbage(http, name, routes)


async def _post_garbage(http: httpx.AsyncClient, name: str, routes: list[tuple[str, str, bool]],
                        takes_any_object: tuple[str, ...] = ()) -> None:
    """POST every garbage body to every route (bare and under a rollout prefix). A route named in
    ``takes_any_object`` may accept a JSON object with unknown keys (2xx), as its server declares."""
    headers_auth = {"authorization": "Bearer t0ken"}
    for method, path, takes_body in routes:
        if method != "POST":
            continue
        for prefix in ("", "/ng-rollout/garbage-r1"):
            for body, headers in GARBAGE:
                reply = await http.post(prefix + path, content=body, headers={**headers, **headers_auth})
                where = (name, prefix + path, body, reply.status_code, reply.text)
                assert reply.status_code < 500, where
                if path in takes_any_object and body.startswith("{\"") and reply.status_code < 300:
                    continue
                if takes_body:
                    assert 400 <= reply.status_code < 500, where
                if reply.status_code >= 400:
                    error = reply.json()["error"]
                    assert isinstance(error["code"], str) and isinstance(error["detail"], str), where


UNWRITABLE = {  # JSON the readers take and orjson cannot write again
    "nested 300 deep": b'{"responses_create_params": {"input": "hi"}, "deep": ' + b"[" * 300 + b"]" * 300 + b"}",
    "a lone surrogate": b'{"responses_create_params": {"input": "hi"}, "note": "\\ud800"}',
}


@pytest.mark.unit
@pytest.mark.parametrize("case", sorted(UNWRITABLE))
@pytest.mark.parametrize(("name", "path"), [("single_agent_turn", "/run"), ("simple_agent", "/v1/responses")])
async def test_a_body_the_mesh_could_not_write_again_is_a_400_not_a_500(name: str, path: str, case: str) -> None:
    body = UNWRITABLE[case]
    if name == "simple_agent":  # an agent's request is the Responses body itself
        body = body.replace(b'"responses_create_params": {"input": "hi"}', b'"input": "hi"')
    transport = httpx.ASGITransport(app=_app(name), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as http:
        reply = await http.post(f"/ng-rollout/deep-r1{path}", content=body,
                                headers={"content-type": "application/json", "x-ng-agent-activation": "1"})
    assert (reply.status_code, reply.json()["error"]["code"]) == (400, "invalid_request"), reply.text


WRAPPED = ("string_match", "equivalence_llm_judge", "nvarc_inductive_resources_server",
           "genrm_compare_resources_server")
"""One NeMo Gym verifier of each family: rule, judge, code, cohort."""


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshLauncher]:
    """The four verifiers and the judges' model, launched (checkpointing on, our token)."""
    raw = verifier_mesh(WRAPPED, tmp_path_factory.mktemp("garbage"), "t0ken")
    for name in [key for key in raw if key.startswith(("env_", "policy_")) or key == "simple_agent"]:
        del raw[name]
    raw["head_server"] = {"port": 0}
    launcher = MeshLauncher(load_config_dict(raw), env={**os.environ, NEMO_GYM_PYTHON_ENV: nemo_gym_python()})
    with launcher:
        launcher.start(ready_timeout_s=600)
        yield launcher


def _control_routes() -> list[tuple[str, str, bool]]:
    return [route for route in _routes(_app("string_match")) if route[1].startswith(CONTROL_PREFIX)]


@pytest.mark.e2e
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", WRAPPED)
async def test_garbage_on_every_route_of_a_wrapped_nemo_gym_server_gets_a_structured_4xx(
        wrapped: MeshLauncher, name: str) -> None:
    async with httpx.AsyncClient(base_url=wrapped.url_of(name), timeout=60) as http:
        served = (await http.get("/openapi.json")).json()["paths"]
        routes = [(method.upper(), path, "requestBody" in op)
                  for path, ops in served.items() for method, op in ops.items() if "{" not in path]
        assert ("POST", "/verify", True) in routes, sorted(routes)
        # NeMo Gym's /seed_session reads a BaseSeedSessionRequest, which ignores unknown keys
        await _post_garbage(http, name, routes + _control_routes(), takes_any_object=("/seed_session",))
