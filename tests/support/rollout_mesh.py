"""An in-process rollout mesh whose environment and agent are checkpoint participants.

``rollout_mesh(environment, root, model)`` serves, behind one routing transport: ``model`` (a
``DeterministicModel``), a plain calculator (``single_agent_turn`` only), the agent
(``simple_agent`` or ``restart_only_agent``, asking for token ids) and the environment, both with
checkpointing on (or off with ``checkpoint=False``), and a head-server stand-in listing them, so
a ``Coordinator`` drives it exactly as it drives real processes. Leaving the context is a crash:
whatever is still running is cancelled and every app is gone; a new ``rollout_mesh`` over the same
root is the fresh set of processes a restore runs on.

``DeterministicModel`` answers the policy model's ``POST /v1/responses`` with output that depends
only on the request (ids are digests of it, never counters), so two runs of the same rollout give
equal rows (with token capture fields, derived too, when the request asks for them: one set per
call, on each of its items, as the policy model stamps them), and can hold the replies a predicate
picks until ``release()``. It also answers the policy model's ``GET /v1/capture/tokens``: the calls
it delivered under the request's rollout id, attempts up to the request's, in order, with their
token arrays. It is no participant: a test that reuses one ``DeterministicModel`` across a crash
stands it in for the policy model's token sidecar, and must deliver no call after the commit.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request

from agents.restart_only_agent import app as restart_only_app
from agents.simple_agent import app as agent_app
from environment_servers.nim import app as nim_app
from environment_servers.single_agent_turn import app as sat_app
from nemo_gym_ckpt.capture import without_token_arrays
from nemo_gym_ckpt.checkpoint.coordinator import Coordinator
from nemo_gym_ckpt.config import CheckpointConfig, ServerConfig
from nemo_gym_ckpt.config import ServerRef as Ref
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.identity import RolloutIdentity, current_identity
from nemo_gym_ckpt.server import create_app
from nemo_gym_ckpt.testing.minimal import create_head_stub
from nemo_gym_ckpt.testing.placement import InProcess, closing_ctx, instance_at, mesh_of
from nemo_gym_ckpt.testing.scripted_model import ModelCall, last_user_text
from resources_servers.calculator_tools import app as calculator_app
from tests.support.episode_participants import TOKEN, checkpoint_config

__all__ = [
    "DeterministicModel",
    "RolloutMesh",
    "calculator_answers",
    "calculator_row",
    "nim_moves",
    "nim_row",
    "rollout_mesh",
]

Policy = Callable[[dict[str, Any]], list[dict[str, Any]]]
Hold = Callable[[str | None, dict[str, Any]], bool]
NIM_RULES = "Nim: take 1 to 3 stones; whoever takes the last one wins. Reply with a number."


def _digest(value: Any) -> str:
    return hashlib.sha256(orjson.dumps(value, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def _message(text: str) -> dict[str, Any]:
    return {"id": f"msg_{_digest(text)}", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _function_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    digest = _digest([name, arguments])
    return {"id": f"fc_{digest}", "type": "function_call", "call_id": f"call_{digest}", "name": name,
            "arguments": json.dumps(arguments), "status": "completed"}


def _token_fields(output: list[dict[str, Any]]) -> dict[str, Any]:
    """Token capture fields of one call, derived from its output (as the policy model stamps them)."""
    seed = int(_digest(output[0] if len(output) == 1 else output)[:6], 16)
    return {"prompt_token_ids": [1, 2, seed % 97], "generation_token_ids": [seed % 89, 7],
            "generation_log_probs": [-0.5, -0.25], "policy_version": 0}


def calculator_answers(problems: dict[str, dict[str, Any]]) -> Policy:
    """Calls the problem's tool, then answers with the tool's output."""

    def policy(body: dict[str, Any]) -> list[dict[str, Any]]:
        last = body["input"][-1]
        if last.get("type") == "function_call_output":
            return [_message(f"The answer is {last['output']}.")]
        problem = problems[last_user_text(body)]
        return [_function_call(problem["tool"], problem["arguments"])]

    return policy


def nim_moves(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Plays Nim for max_take 3: leaves a multiple of 4 when it can, else takes 1."""
    stones = int(re.findall(r"(\d+) stones left", last_user_text(body))[-1])
    return [_message(f"I take {stones % 4 or 1}.")]


def calculator_row(problem: dict[str, Any]) -> dict[str, Any]:
    tools = [spec.definition() for spec in calculator_app.CalculatorTools.tool_specs.values()]
    return {"responses_create_params": {"input": [{"role": "user", "content": problem["question"]}],
                                        "tools": tools, "temperature": 0.0},
            "expected_answer": problem["answer"]}


def nim_row(stones: int, seed: int) -> dict[str, Any]:
    params = {"input": [{"role": "system", "content": NIM_RULES}], "temperature": 0.0}
    return {"responses_create_params": params,
            "nim": {"stones": stones, "max_take": 3, "seed": seed, "opponent_skill": 0.5}}


@dataclass
class DeterministicModel:
    """The policy model's route; the output depends only on the request; replies may be held."""

    policy: Policy
    hold: Hold | None = None
    calls: list[ModelCall] = field(default_factory=list)
    holding: Counter[str] = field(default_factory=Counter)
    delivered: list[tuple[RolloutIdentity, dict[str, Any]]] = field(default_factory=list)
    _released: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> FastAPI:
        app = create_app("policy_model")
        app.add_api_route("/v1/responses", self.responses, methods=["POST"])
        app.add_api_route("/v1/capture/tokens", self.capture_tokens, methods=["GET"])
        return app

    async def capture_tokens(self) -> dict[str, Any]:
        identity = current_identity()
        assert identity is not None, "the capture route is rollout-scoped"
        calls = [{"call_id": f"mc_{index}", "attempt": who.attempt, **fields}
                 for index, (who, fields) in enumerate(self.delivered)
                 if who.rollout_id == identity.rollout_id and who.attempt <= identity.attempt]
        return {"capture_key": identity.capture_key, "calls": calls}

    def release(self) -> None:
        self._released.set()

    def capture_keys(self) -> list[str | None]:
        return [call.capture_key for call in self.calls]

    async def responses(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        identity = current_identity()
        key = identity.capture_key if identity else None
        self.calls.append(ModelCall(key, body))
        if self.hold is not None and self.hold(key, body):
            self.holding[key or "-"] += 1
            try:
                await self._released.wait()
            finally:
                self.holding[key or "-"] -= 1
        output = self.policy(body)
        if body.get("return_token_ids"):
            fields = _token_fields(output)
            output = [{**item, **fields} for item in output]
            if identity is not None:
                self.delivered.append((identity, fields))
        digest = _digest(without_token_arrays(body["input"]))
        return {"id": f"resp_{digest}", "object": "response", "model": "deterministic",
                "created_at": 0, "status": "completed", "incomplete_details": None, "output": output,
                "usage": {"input_tokens": 10, "output_tokens": 3, "total_tokens": 13}}


@dataclass
class RolloutMesh:
    """The served mesh: URLs, a client over the routing transport, the model."""

    placement: InProcess
    model: DeterministicModel
    urls: dict[str, str]
    client: Any
    dispatched: list[asyncio.Task[httpx.Response]] = field(default_factory=list)

    def coordinator(self) -> Coordinator:
        return Coordinator(self.urls["head"], TOKEN, client=self.placement.mesh_client())

    def dispatch(self, row: dict[str, Any], identity: RolloutIdentity) -> asyncio.Task[httpx.Response]:
        """``POST /ng-rollout/<key>/run`` in the background (as a controller dispatches)."""
        run = asyncio.create_task(self.client.request(
            "POST", self.urls["env"] + "/run", json=row, identity=identity, check=False, timeout_s=30))
        self.dispatched.append(run)
        return run

    async def status(self, name: str) -> dict[str, Any]:
        reply = await self.client.request("GET", self.urls[name] + "/ng-control/v1/checkpoint/status",
                                          headers={"authorization": f"Bearer {TOKEN}"}, rollout_prefix=False)
        status: dict[str, Any] = reply.json()
        return status


def _env_settings(environment: str, env_settings: dict[str, Any]) -> ServerConfig:
    agent = Ref(type="responses_api_agents", name="agent")
    if environment == "nim":
        return nim_app.Config(agent_server=agent, **env_settings)
    resources = Ref(type="resources_servers", name="calculator_tools")
    return sat_app.Config(agent_server=agent, resources_server=resources, **env_settings)


def _agent_settings(environment: str) -> agent_app.Config:
    resources = None if environment == "nim" else Ref(type="resources_servers", name="calculator_tools")
    return agent_app.Config(model_server=Ref(type="responses_api_models", name="policy_model"),
                            resources_server=resources, max_steps=1 if environment == "nim" else 4,
                            return_token_ids=True)


@asynccontextmanager
async def rollout_mesh(
    environment: str, root: Path, model: DeterministicModel, *, checkpoint: bool = True,
    agent: str = "simple_agent", **env_settings: Any,
) -> AsyncIterator[RolloutMesh]:
    placement = InProcess()
    config = checkpoint_config(root) if checkpoint else CheckpointConfig()
    plain = mesh_of([], CheckpointConfig())
    async with AsyncExitStack() as stack:
        urls = {"policy_model": await stack.enter_async_context(placement.run(model.app()))}
        calculator_ctx = ServerContext("calculator_tools", calculator_app.Config(), plain,
                                       placement.mesh_client())
        calculator = closing_ctx(calculator_app.create_app(calculator_ctx), calculator_ctx)
        urls["calculator_tools"] = await stack.enter_async_context(placement.run(calculator))
        urls["agent"], urls["env"] = placement.reserve(), placement.reserve()
        mesh = mesh_of([
            instance_at("policy_model", "responses_api_models", "deterministic", ServerConfig(),
                        urls["policy_model"]),
            instance_at("calculator_tools", "resources_servers", "calculator_tools", calculator_app.Config(),
                        urls["calculator_tools"]),
            instance_at("agent", "responses_api_agents", agent, _agent_settings(environment), urls["agent"]),
            instance_at("env", "environment_servers", environment, _env_settings(environment, env_settings),
                        urls["env"]),
        ], config)
        agent_module = {"simple_agent": agent_app, "restart_only_agent": restart_only_app}[agent]
        env_module = {"single_agent_turn": sat_app, "nim": nim_app}[environment]
        for name, module in (("agent", agent_module), ("env", env_module)):
            ctx = ServerContext(name, mesh.instance(name).settings, mesh, placement.mesh_client())
            app = closing_ctx(module.create_app(ctx), ctx)
            await stack.enter_async_context(placement.run(app, urls[name]))
        listing = [{"name": name, "type": "x", "implementation": "x", "url": url}
                   for name, url in urls.items()]
        urls["head"] = await stack.enter_async_context(placement.run(create_head_stub(listing)))
        client = await stack.enter_async_context(placement.mesh_client())
        served = RolloutMesh(placement, model, urls, client)
        try:
            yield served
        finally:
            for run in served.dispatched:
                run.cancel()
            await asyncio.gather(*served.dispatched, return_exceptions=True)
