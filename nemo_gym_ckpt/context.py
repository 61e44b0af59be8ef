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

LONG_CALL_CONNECTIONS = 1024


@dataclass
class ServerContext(Generic[C]):
    """One server instance's view of the mesh."""

    name: str
    settings: C
    mesh: MeshConfig
    client: MeshClient = field(default_factory=MeshClient)
    long_calls: MeshClient | None = None
    """A pool of its own for calls that last a whole activation (an environment's call of its agent):
    held by thousands of them at once, the shared pool would queue every short call (a close, a
    seed, a verify) behind them. By default a pool of ``client``'s kind (``client`` itself when it
    has no pool: an in-process transport)."""

    def __post_init__(self) -> None:
        if self.long_calls is None:
            self.long_calls = self.client.with_own_pool(LONG_CALL_CONNECTIONS)

    @property
    def instance(self) -> ServerInstance:
        return self.mesh.instance(self.name)

    def url_of(self, ref: ServerRef | str) -> str:
        """Base URL of another server of the mesh."""
        return self.mesh.url_of(ref)

    async def aclose(self) -> None:
        await self.client.aclose()
        if self.long_calls is not None and self.long_calls is not self.client:
            await self.long_calls.aclose()
