"""The project's environment and agent servers as checkpoint participants under test.

A *stack* is the server under test (checkpointing on) plus the plain servers it calls, placed as the
test kit's ``Placement`` says (``nemo_gym_ckpt.testing.placement``): environments
(``single_agent_turn``, ``nim``) over the kit's ``GateAgent`` and a calculator; agents
(``simple_agent``, ``restart_only_agent``) over a scripted ``hold_policy`` model and a calculator with
the kit's ``hold`` tool.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

from agents.restart_only_agent import app as restart_only_app
from agents.simple_agent import app as agent_app
from environment_servers.nim import app as nim_app
from environment_servers.single_agent_turn import app as sat_app
from nemo_gym_ckpt.checkpoint.clock import Clock
from nemo_gym_ckpt.config import CheckpointConfig, ServerConfig
from nemo_gym_ckpt.config import ServerRef as Ref
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.resources.base import ResourcesServer
from nemo_gym_ckpt.testing.agents import AgentHooks, hold_policy
from nemo_gym_ckpt.testing.environments import EnvHooks, GateAgent
from nemo_gym_ckpt.testing.placement import Placement, Stack, closing_ctx, instance_at, mesh_of
from nemo_gym_ckpt.testing.placement import checkpoint_config as kit_checkpoint_config
from nemo_gym_ckpt.testing.resources import held
from nemo_gym_ckpt.testing.scripted_model import ScriptedModel
from resources_servers.calculator_tools import app as calculator_app

__all__ = [
    "ENVIRONMENTS",
    "TOKEN",
    "WAIT_S",
    "agent_stack",
    "checkpoint_config",
    "env_row",
    "env_stack",
]

TOKEN = "episodes-token-4321"
WAIT_S = 10.0
ENVIRONMENTS = ("single_agent_turn", "nim")


def checkpoint_config(root: Path, grace_s: float = 600.0) -> CheckpointConfig:
    """Checkpointing on with this module's ``TOKEN``."""
    return kit_checkpoint_config(root, TOKEN, grace_s)


# ---- placing apps -----------------------------------------------------------------------------


# ---- environments -----------------------------------------------------------------------------


def env_row(implementation: str, payload: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A task row of the environment; ``payload`` rides along as a field of the row."""
    question = [{"role": "user", "content": "Compute 0 + 1."}]
    row: dict[str, Any] = {"responses_create_params": {"input": question}, "payload": payload or {}, **extra}
    if implementation == "nim":
        row.setdefault("nim", {"stones": 1, "max_take": 1, "seed": 3})
    else:
        row.setdefault("expected_answer", 1)
    return row


@asynccontextmanager
async def _calculator(
    placement: Placement, server_class: type[ResourcesServer[Any]] = calculator_app.CalculatorTools
) -> AsyncIterator[str]:
    """A plain calculator (checkpointing off), its context closed with it."""
    ctx = ServerContext("calculator_tools", calculator_app.Config(), mesh_of([], CheckpointConfig()),
                        placement.mesh_client())
    async with placement.run(closing_ctx(server_class(ctx).build_app(), ctx)) as url:
        yield url


def _env_module(implementation: str) -> Any:
    return {"single_agent_turn": sat_app, "nim": nim_app}[implementation]


def _env_settings(implementation: str, **settings: Any) -> ServerConfig:
    agent = Ref(type="responses_api_agents", name="gate_agent")
    if implementation == "nim":
        return nim_app.Config(agent_server=agent, **settings)
    resources = Ref(type="resources_servers", name="calculator_tools")
    return sat_app.Config(agent_server=agent, resources_server=resources, **settings)


@asynccontextmanager
async def env_stack(
    implementation: str, placement: Placement, checkpoint: CheckpointConfig, clock: Clock,
    *, gate: GateAgent | None = None, resources_url: str | None = None, **settings: Any,
) -> AsyncIterator[Stack]:
    """An environment server (checkpointing as ``checkpoint`` says) over a gate agent and a calculator
    (or the resources server at ``resources_url``)."""
    gate = gate or GateAgent()
    async with AsyncExitStack() as stack:
        agent_url = await stack.enter_async_context(placement.run(gate.app()))
        calculator_url = resources_url or await stack.enter_async_context(_calculator(placement))
        mesh = mesh_of([
            instance_at("env", "environment_servers", implementation,
                        _env_settings(implementation, **settings), "http://127.0.0.1:1"),
            instance_at("gate_agent", "responses_api_agents", "gate", ServerConfig(), agent_url),
            instance_at("calculator_tools", "resources_servers", "calculator_tools", calculator_app.Config(),
                      calculator_url),
        ], checkpoint)
        ctx = ServerContext("env", mesh.instance("env").settings, mesh, placement.mesh_client())
        app = closing_ctx(_env_module(implementation).create_app(ctx, clock=clock), ctx)
        url = await stack.enter_async_context(placement.run(app))
        agent = await stack.enter_async_context(placement.client(agent_url))
        hooks = EnvHooks(partial(env_row, implementation), agent)
        stack.push_async_callback(hooks.aclose)
        yield Stack(app, url, gate, hooks, {"agent": agent})


# ---- agents -----------------------------------------------------------------------------------


HeldCalculator = held(calculator_app.CalculatorTools)


@asynccontextmanager
async def agent_stack(
    implementation: str, placement: Placement, checkpoint: CheckpointConfig, clock: Clock,
    *, model: Any = None, **settings: Any,
) -> AsyncIterator[Stack]:
    """An agent (checkpointing as ``checkpoint`` says) over a scripted model and a held calculator."""
    model = model or ScriptedModel(hold_policy)
    async with AsyncExitStack() as stack:
        model_url = await stack.enter_async_context(placement.run(model.app()))
        calculator_url = await stack.enter_async_context(_calculator(placement, HeldCalculator))
        agent_settings = agent_app.Config(
            model_server=Ref(type="responses_api_models", name="policy_model"),
            resources_server=Ref(type="resources_servers", name="calculator_tools"), **settings)
        mesh = mesh_of([
            instance_at("agent", "responses_api_agents", implementation, agent_settings, "http://127.0.0.1:1"),
            instance_at("policy_model", "responses_api_models", "scripted", ServerConfig(), model_url),
            instance_at("calculator_tools", "resources_servers", "calculator_tools", calculator_app.Config(),
                      calculator_url),
        ], checkpoint)
        ctx = ServerContext("agent", agent_settings, mesh, placement.mesh_client())
        module = {"simple_agent": agent_app, "restart_only_agent": restart_only_app}[implementation]
        app = closing_ctx(module.create_app(ctx, clock=clock), ctx)
        url = await stack.enter_async_context(placement.run(app))
        resources = await stack.enter_async_context(placement.client(calculator_url))
        hooks = AgentHooks(resources, restart_only=implementation == "restart_only_agent")
        stack.push_async_callback(hooks.aclose)
        yield Stack(app, url, model, hooks, {"resources": resources})


