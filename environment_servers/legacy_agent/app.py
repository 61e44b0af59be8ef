"""legacy_agent: NeMo Gym's agent relay, here the single_agent_turn episode on the agent's resources server.

NeMo Gym's configs front an agent with an environment server of implementation ``legacy_agent``
whose ``agent_server`` names the agent: its collector reaches agents only through an environment
server, and this one hands the row to the agent, which seeds, runs and verifies on the resources
server it names. Here the same block runs the ``single_agent_turn`` episode (seed, agent, close the
agent, verify, close the session; checkpointing as there) against that resources server, so a
NeMo Gym config that declares the relay runs unchanged and its rows are rewarded the same way.

``resources_server`` may be set to use another resources server than the agent's; when it is
unset, the agent must name one (a config error otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import FastAPI

from environment_servers.single_agent_turn.app import SingleAgentTurn
from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK, Clock
from nemo_gym_ckpt.config import ServerInstance, ServerRef
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.environment.base import EnvironmentConfig, mount_environment
from nemo_gym_ckpt.errors import ConfigError
from nemo_gym_ckpt.server import close_on_shutdown
from nemo_gym_ckpt.server import create_app as create_app_base

__all__ = ["Config", "create_app"]


class Config(EnvironmentConfig):
    resources_server: ServerRef | None = None
    """Where seed and verify go; unset: the resources server the agent names."""

    def resources_in(self, instances: Mapping[str, ServerInstance]) -> ServerRef:
        """This block's ``resources_server``, else the agent's; ``ValueError`` when neither names one."""
        if self.resources_server is not None:
            return self.resources_server
        agent = instances.get(self.agent_server.name)
        ref = getattr(agent.settings, "resources_server", None) if agent is not None else None
        if not isinstance(ref, ServerRef):
            raise ValueError(f"agent {self.agent_server.name!r} names no resources_server, so the relay has "
                             "nowhere to seed and verify: set resources_server here or on the agent")
        return ref

    def validate_in_mesh(self, instances: Mapping[str, ServerInstance]) -> None:
        self.resources_in(instances)


def create_app(ctx: ServerContext[Config], *, clock: Clock = SYSTEM_CLOCK) -> FastAPI:
    try:
        resources = ctx.settings.resources_in(ctx.mesh.instances)
    except ValueError as error:
        raise ConfigError(str(error), key=ctx.name) from None
    turn = SingleAgentTurn(ctx, resources)
    app = create_app_base(ctx.name)
    mount_environment(app, ctx, turn.program, clock=clock)
    return close_on_shutdown(app, ctx.aclose)
