"""nemo-gym-ckpt: a NeMo Gym style mesh of HTTP servers where every server is a checkpoint participant.

The public API is ``__all__`` below. Names are imported on first use, so that ``import nemo_gym_ckpt``
(and the CLI's ``--help``) stays fast; ``from nemo_gym_ckpt import MeshLauncher`` works as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nemo_gym_ckpt.client import MeshClient
    from nemo_gym_ckpt.config import MeshConfig, ServerConfig, ServerInstance, ServerRef, load_config
    from nemo_gym_ckpt.context import ServerContext
    from nemo_gym_ckpt.errors import ConfigError, GymError
    from nemo_gym_ckpt.identity import RolloutIdentity
    from nemo_gym_ckpt.launch.launcher import LaunchError, MeshLauncher
    from nemo_gym_ckpt.server import create_app

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "GymError",
    "LaunchError",
    "MeshClient",
    "MeshConfig",
    "MeshLauncher",
    "RolloutIdentity",
    "ServerConfig",
    "ServerContext",
    "ServerInstance",
    "ServerRef",
    "__version__",
    "create_app",
    "load_config",
]

_HOMES = {
    "ConfigError": "errors",
    "GymError": "errors",
    "LaunchError": "launch.launcher",
    "MeshClient": "client",
    "MeshConfig": "config",
    "MeshLauncher": "launch.launcher",
    "RolloutIdentity": "identity",
    "ServerConfig": "config",
    "ServerContext": "context",
    "ServerInstance": "config",
    "ServerRef": "config",
    "create_app": "server",
    "load_config": "config",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
