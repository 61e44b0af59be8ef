"""What a server instance is given: its name, typed settings, the whole mesh config and a client.

Every ``<type>/<implementation>/app.py`` declares ``Config(ServerConfig)`` and
``create_app(ctx: ServerContext[Config]) -> FastAPI``. Dependencies are passed in here, never read
from globals or ``app.state``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import MeshConfig, ServerConfig, ServerInstance, ServerRef

__all__ = ["ServerContext"]

C = TypeVar("C", bound=ServerConfig)


@dataclass
class ServerContext(Generic[C]):
    """One server instance's view of the mesh."""

    name: str
    settings: C
    mesh: MeshConfig
    client: MeshClient = field(default_factory=MeshClient)

    @property
    def instance(self) -> ServerInstance:
        return self.mesh.instance(self.name)

    def url_of(self, ref: ServerRef | str) -> str:
        """Base URL of another server of the mesh."""
        return self.mesh.url_of(ref)

    async def aclose(self) -> None:
        await self.client.aclose()
