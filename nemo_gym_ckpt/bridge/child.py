"""The process of one NeMo Gym server in our mesh, in NeMo Gym's own Python environment.

The launcher starts it with ``nemo_gym_ckpt.launch.child.bridge_command`` (only ``nemo_gym_ckpt`` is
imported from the project). ``main(instance)`` then does what NeMo Gym's launcher and its
``run_webserver`` would, and serves the result inside the participant shell:

1. reads the mesh config (the file ``NEMO_GYM_CKPT_CONFIG_FILE`` names), the instance's block and
   the ``checkpoint`` block;
2. finds the server's folder, ``resources_servers/<implementation>/`` of the installed ``nemo_gym``
   distribution, makes it the working directory and puts it first on the module path and in
   ``PYTHONPATH`` (NeMo Gym's servers import their sibling modules, and so do the processes they
   start), and sets ``NEMO_GYM_CONFIG_DICT`` / ``NEMO_GYM_CONFIG_PATH`` (``global_config``; a config
   over Linux's bound on one environment string, 128 KiB, is refused);
3. imports the entrypoint and finds the server class (the one ``SimpleResourcesServer`` subclass the
   module defines, or the one this project's table names), and its declaration (``declarations``);
4. builds the app with NeMo Gym's own ``run_webserver`` on its worker path, which sets the server up
   exactly as for serving (MCP exposure, liveness routes, middleware) and hands the app back;
5. exports its telemetry as the mesh's ``telemetry:`` block says (``checkpoint/otlp.py``; where NeMo
   Gym's environment lacks the SDK, one warning and no export), the final flush chained into the
   server's shutdown;
6. serves ``ResourcesShell(app).build_app(checkpoint)`` (request bodies capped at the block's
   ``max_body_bytes``) with uvicorn, with the settings our own servers run with
   (``launch.child.UVICORN_SETTINGS``: a 60 s keep-alive among them); its ``/health`` replies carry
   the launcher's instance token (``launch/instance_token.py``), until SIGTERM or the death of the
   launcher.

A config problem exits with status 2 and one line naming it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import Any

import uvicorn
from pydantic import ValidationError

from nemo_gym_ckpt.bridge.declarations import NEMO_GYM_VERIFIERS, declaration_of
from nemo_gym_ckpt.bridge.global_config import (
    CONFIG_DICT_ENV,
    CONFIG_PATH_ENV,
    WORKER_ENV,
    nemo_gym_config_env_value,
)
from nemo_gym_ckpt.checkpoint.otlp import flush_telemetry_at_shutdown, install_telemetry
from nemo_gym_ckpt.config import CheckpointConfig, NemoGymServerConfig, TelemetryConfig, default_host_of
from nemo_gym_ckpt.errors import ConfigError
from nemo_gym_ckpt.launch.child import (
    PARENT_ENV,
    UVICORN_SETTINGS,
    exit_orphaned,
    read_mesh_dict,
    watch_parent,
)
from nemo_gym_ckpt.launch.instance_token import read_instance_token, with_instance_token
from nemo_gym_ckpt.launch.startup_gc import settled_at_startup
from nemo_gym_ckpt.resources.shell import ResourcesShell

__all__ = ["ServerBlock", "main", "server_class_in", "server_folder"]

logger = logging.getLogger(__name__)
USAGE_EXIT = 2
TYPE_KEY = "resources_servers"


class ServerBlock:
    """The instance's block of the mesh config: implementation, entrypoint, host (the config's
    ``default_host`` where the block names none, as for every server), port and body limit."""

    def __init__(self, raw: dict[str, Any], instance: str) -> None:
        block = raw.get(instance)
        if not isinstance(block, dict) or set(block) != {TYPE_KEY}:
            raise ConfigError(f"{instance} is not a {TYPE_KEY} instance of the mesh", key=instance)
        impls = block[TYPE_KEY]
        if not isinstance(impls, dict) or len(impls) != 1:
            raise ConfigError("expected exactly one implementation block", key=f"{instance}.{TYPE_KEY}")
        self.implementation, settings = next(iter(impls.items()))
        self.settings: dict[str, Any] = settings if isinstance(settings, dict) else {}
        self.entrypoint = str(self.settings.get("entrypoint", "app.py"))
        self.host = str(self.settings.get("host", default_host_of(raw)))  # where the launcher polls it
        port = self.settings.get("port")
        if not isinstance(port, int) or isinstance(port, bool):
            raise ConfigError("the launcher gives every server a port; this one has none", key=instance)
        self.port = port
        self.max_body_bytes = _max_body_bytes(self.settings, instance)

    @property
    def module(self) -> str:
        parts = PurePosixPath(self.entrypoint).with_suffix("").parts
        return ".".join((TYPE_KEY, self.implementation, *parts))


def _max_body_bytes(settings: dict[str, Any], instance: str) -> int:
    """The block's ``max_body_bytes``, checked as the launcher checked the whole block."""
    try:
        return NemoGymServerConfig.model_validate(settings).max_body_bytes
    except ValidationError as error:
        raise ConfigError(f"invalid server block: {error.errors()[0]['msg']}", key=instance) from None


def server_folder(implementation: str, entrypoint: str) -> Path:
    """``resources_servers/<implementation>/`` of the installed nemo_gym distribution."""
    spec = importlib.util.find_spec(TYPE_KEY)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        folder = Path(location) / implementation
        if (folder / entrypoint).is_file():
            return folder
    raise ConfigError(f"nemo_gym has no server {TYPE_KEY}/{implementation}/{entrypoint} in this environment "
                      f"(looked in {', '.join(locations) or 'nothing'})")


def server_class_in(module: ModuleType, implementation: str) -> type:
    """The server class of an entrypoint module (the table's name for NeMo Gym's verifiers)."""
    from nemo_gym.base_resources_server import SimpleResourcesServer

    known = NEMO_GYM_VERIFIERS.get(implementation)
    if known is not None and isinstance(getattr(module, known.server_class, None), type):
        return getattr(module, known.server_class)
    defined = [value for value in vars(module).values()
               if isinstance(value, type) and issubclass(value, SimpleResourcesServer)
               and value.__module__ == module.__name__]
    if len(defined) != 1:
        names = ", ".join(cls.__name__ for cls in defined) or "none"
        raise ConfigError(f"{module.__name__} must define exactly one SimpleResourcesServer subclass, got {names}")
    return defined[0]


def _prepare_process(raw: dict[str, Any], instance: str, folder: Path) -> None:
    config_dict = nemo_gym_config_env_value(raw)
    os.chdir(folder)
    sys.path.insert(0, str(folder))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(folder), os.environ.get("PYTHONPATH"))))
    os.environ[CONFIG_DICT_ENV] = config_dict
    os.environ[CONFIG_PATH_ENV] = instance
    os.environ[WORKER_ENV] = "1"




def main(instance: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if PARENT_ENV in os.environ:
        watch_parent(int(os.environ[PARENT_ENV]), exit_orphaned)
    try:
        raw = read_mesh_dict()
        block = ServerBlock(raw, instance)
        checkpoint = CheckpointConfig.model_validate(raw.get("checkpoint") or {})
        telemetry = TelemetryConfig.model_validate(raw.get("telemetry") or {})
        folder = server_folder(block.implementation, block.entrypoint)
        _prepare_process(raw, instance, folder)
        module = importlib.import_module(block.module)
        server_class = server_class_in(module, block.implementation)
        token = read_instance_token()
    except ConfigError as error:
        logger.error("config error: %s", error)
        raise SystemExit(USAGE_EXIT) from None
    declaration = declaration_of(server_class, module.__name__)
    logger.info("%s: NeMo Gym's %s.%s, declared %s / %s", instance, module.__name__, server_class.__name__,
                declaration.checkpoint_mode, declaration.checkpoint_verify)
    exporting = install_telemetry(telemetry, instance, sdk_required=False)  # NeMo Gym's env may lack the SDK
    app = flush_telemetry_at_shutdown(server_class.run_webserver(), exporting)  # type: ignore[attr-defined]
    shell = ResourcesShell(app, instance, declaration, inner_strips_prefix=True)
    served = shell.build_app(checkpoint if checkpoint.enabled else None, max_body_bytes=block.max_body_bytes)
    uvicorn.run(settled_at_startup(with_instance_token(served, token)), host=block.host, port=block.port,
                **UVICORN_SETTINGS)
