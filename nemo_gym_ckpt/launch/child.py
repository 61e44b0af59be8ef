"""One server child of the launcher: what it is given, how it builds its app, how it dies with its parent.

The launcher starts ``python -m nemo_gym_ckpt.cli.serve <instance>`` (``SERVE_MODULE``) with the
path of the resolved mesh config (ports assigned, a private JSON file: ``launch/config_file.py``) in
``CONFIG_FILE_ENV`` and its own pid in ``PARENT_ENV``.
An instance of NeMo Gym's own servers runs in NeMo Gym's Python environment instead:
``<its python> -c BRIDGE_BOOT <project root> <instance>`` (``bridge_command``), which imports only
``nemo_gym_ckpt`` from the project (the project's own server folders would shadow NeMo Gym's of the
same names) and hands over to ``nemo_gym_ckpt.bridge.child``.
``load_mesh`` reads the config back, ``build_app`` asks the instance's ``app`` module for its FastAPI
app. A child exits by itself when its parent dies: a ``PR_SET_PDEATHSIG`` on Linux and a watchdog on
the parent pid everywhere; if a graceful shutdown does not end the process within
``ORPHAN_GRACE_S``, the watchdog kills it. Every child, ours or a bridged NeMo Gym server, runs
uvicorn with ``UVICORN_SETTINGS`` (among them a keep-alive of ``SERVER_KEEPALIVE_S``).
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from fastapi import FastAPI

from nemo_gym_ckpt.config import MeshConfig, load_config_dict
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.errors import ConfigError
from nemo_gym_ckpt.launch.config_file import CONFIG_FILE_ENV, read_config_file
from nemo_gym_ckpt.launch.workers import BACKLOG
from nemo_gym_ckpt.server import close_on_shutdown, set_max_body_bytes

__all__ = [
    "BRIDGE_BOOT",
    "CONFIG_FILE_ENV",
    "ORPHAN_GRACE_S",
    "PARENT_ENV",
    "SERVER_KEEPALIVE_S",
    "SERVE_MODULE",
    "UVICORN_SETTINGS",
    "bridge_command",
    "build_app",
    "exit_orphaned",
    "load_mesh",
    "read_mesh_dict",
    "watch_parent",
]

PARENT_ENV = "NEMO_GYM_CKPT_PARENT_PID"
SERVE_MODULE = "nemo_gym_ckpt.cli.serve"
ORPHAN_GRACE_S = 5.0
BRIDGE_BOOT = """\
import importlib.machinery, importlib.util, os, sys
root, instance = sys.argv[1], sys.argv[2]
sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.abspath(p) != os.path.abspath(root)]
spec = importlib.machinery.PathFinder.find_spec("nemo_gym_ckpt", [root])
package = importlib.util.module_from_spec(spec)
sys.modules["nemo_gym_ckpt"] = package
spec.loader.exec_module(package)
from nemo_gym_ckpt.launch.startup_gc import pause_collector
pause_collector()
from nemo_gym_ckpt.bridge.child import main
main(instance)
"""
"""What a NeMo Gym server's process runs first: ``nemo_gym_ckpt`` alone from the project root."""
SERVER_KEEPALIVE_S = 60
"""How long a server keeps an idle connection open (uvicorn's ``timeout_keep_alive``)."""
UVICORN_SETTINGS: dict[str, Any] = {
    "loop": "uvloop",
    "http": "httptools",
    "log_level": "warning",
    "timeout_graceful_shutdown": 5,
    # The mesh client drops an idle pooled connection after KEEPALIVE_S (2 s); a server that
    # closed idle ones after uvicorn's 5 s left a starved client (an event loop seconds late on
    # 2 busy cores) reusing connections already closed: the scale bench lost rollouts that way.
    "timeout_keep_alive": SERVER_KEEPALIVE_S,
    "backlog": BACKLOG,
}
"""How every server child runs uvicorn (``cli/serve.py`` for ours, ``bridge/child.py`` for NeMo Gym's)."""
_PR_SET_PDEATHSIG = 1
logger = logging.getLogger(__name__)


def build_app(mesh: MeshConfig, name: str) -> FastAPI:
    """The app of instance ``name``, with the context's client closed at shutdown."""
    instance = mesh.instance(name)
    module = importlib.import_module(instance.module)
    ctx: ServerContext[Any] = ServerContext(name=name, settings=instance.settings, mesh=mesh)
    app = cast(FastAPI, module.create_app(ctx))
    if hasattr(app.state, "body_limit"):  # an app of nemo_gym_ckpt.server.create_app
        set_max_body_bytes(app, instance.settings.max_body_bytes)
    return close_on_shutdown(app, ctx.aclose)  # our servers close it already; a server of yours may not


def bridge_command(python: str, root: Path, instance: str) -> list[str]:
    """The command line of a NeMo Gym server instance, run by ``python`` (its environment's)."""
    return [python, "-c", BRIDGE_BOOT, str(root), instance]


def watch_parent(parent_pid: int, on_orphaned: Callable[[], None], interval_s: float = 0.5) -> None:
    """Call ``on_orphaned`` once the parent process is gone (a daemon thread polls)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    def poll() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        on_orphaned()

    threading.Thread(target=poll, name="parent-watch", daemon=True).start()


def exit_orphaned(grace_s: float = ORPHAN_GRACE_S) -> None:
    """Shut down gracefully (SIGTERM to ourselves); SIGKILL ourselves if still alive after ``grace_s``."""
    logger.warning("parent process is gone; shutting down")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    logger.error("still running %g s after the parent died; killing myself", grace_s)
    os.kill(os.getpid(), signal.SIGKILL)


def read_mesh_dict() -> dict[str, Any]:
    """The resolved mesh config in the file the launcher named in ``CONFIG_FILE_ENV`` (not validated)."""
    path = os.environ.get(CONFIG_FILE_ENV)
    if not path:
        raise ConfigError(f"{CONFIG_FILE_ENV} is not set: start servers with 'nemo-gym-ckpt run CONFIG'")
    return read_config_file(path)


def load_mesh() -> MeshConfig:
    return load_config_dict(read_mesh_dict())
