"""Entry point of one server process: ``python -m nemo_gym_ckpt.cli.serve <instance>``.

The launcher starts it (``nemo_gym_ckpt.launch.child`` says with what); it serves the instance's app
with uvicorn (uvloop and httptools) and exits with ``ExitCode.USAGE`` on a config error. Its
``/health`` replies carry the instance token the launcher gave it (``launch/instance_token.py``).

With ``num_workers: N`` (N > 1) this process holds the port, forks N workers (``launch/workers.py``),
each serving the app on the same port (``SO_REUSEPORT``), and runs the coordinator (when
checkpointing is on: ``checkpoint/worker_hub.py``, on a Unix socket in a private runtime
directory); it stops them all on SIGTERM or SIGINT, or when one ends.
"""

from __future__ import annotations

from nemo_gym_ckpt.launch import startup_gc

if __name__ == "__main__":  # a server process: its imports and its app's start without the collector
    startup_gc.pause_collector()

import argparse
import asyncio
import importlib
import logging
import os
import shutil
import signal
from pathlib import Path
from typing import cast

import uvicorn

from nemo_gym_ckpt.checkpoint.otlp import Exporting, flush_telemetry_at_shutdown, install_telemetry
from nemo_gym_ckpt.checkpoint.worker_hub import COORDINATOR_ENV, start_coordinator
from nemo_gym_ckpt.cli.exit_codes import ExitCode
from nemo_gym_ckpt.config import MeshConfig, ServerInstance
from nemo_gym_ckpt.errors import ConfigError
from nemo_gym_ckpt.launch.child import (
    PARENT_ENV,
    SERVE_MODULE,
    UVICORN_SETTINGS,
    build_app,
    exit_orphaned,
    load_mesh,
    watch_parent,
)
from nemo_gym_ckpt.launch.instance_token import read_instance_token, with_instance_token
from nemo_gym_ckpt.launch.workers import WorkerProcesses, bind_listener, reserve_port, runtime_dir

__all__ = ["KIND_OF_TYPE", "main"]

logger = logging.getLogger(__name__)

KIND_OF_TYPE = {"environment_servers": "environment", "responses_api_agents": "agent",
                "resources_servers": "resources", "responses_api_models": "model"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {SERVE_MODULE}")
    parser.add_argument("instance")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request blocks the event loop
    try:
        mesh = load_mesh()
        instance = mesh.instance(args.instance)
    except ConfigError as error:
        logger.error("config error: %s", error)
        raise SystemExit(ExitCode.USAGE) from None
    if (instance.settings.num_workers or 1) > 1:
        raise SystemExit(_serve_workers(mesh, instance))
    _serve(mesh, instance, worker=False)


def _serve(mesh: MeshConfig, instance: ServerInstance, *, worker: bool) -> None:
    """Serve the instance's app in this process (one worker of several: on the shared port)."""
    if PARENT_ENV in os.environ:
        watch_parent(int(os.environ[PARENT_ENV]), exit_orphaned)
    try:
        exporting = install_telemetry(mesh.telemetry, instance.name)
        token = read_instance_token()  # the launcher knows its own process by it
        app = flush_telemetry_at_shutdown(build_app(mesh, instance.name), exporting)
    except ConfigError as error:
        logger.error("config error: %s", error)
        raise SystemExit(ExitCode.USAGE) from None
    host, port = instance.settings.host, cast(int, instance.settings.port)
    served = startup_gc.settled_at_startup(with_instance_token(app, token))
    if worker:
        uvicorn.Server(uvicorn.Config(served, **UVICORN_SETTINGS)).run(sockets=[bind_listener(host, port)])
    else:
        uvicorn.run(served, host=host, port=port, **UVICORN_SETTINGS)


def _serve_workers(mesh: MeshConfig, instance: ServerInstance) -> int:
    """The main process of a multi-worker server: the port, the workers (forked before any thread or
    event loop starts here), then the coordinator and the workers' supervision."""
    count = cast(int, instance.settings.num_workers)
    reserved = reserve_port(instance.settings.host, cast(int, instance.settings.port))
    runtime = runtime_dir()  # mode 700: only this user reaches the socket
    path = runtime / "coordinator.sock"
    importlib.import_module(instance.module)  # imported once, here: the forked workers start at once
    launcher_pid = os.environ.get(PARENT_ENV)
    os.environ[PARENT_ENV] = str(os.getpid())
    if mesh.checkpoint.enabled:
        os.environ[COORDINATOR_ENV] = str(path)

    def serve() -> None:
        reserved.close()
        _serve(mesh, instance, worker=True)

    workers = WorkerProcesses.fork(instance.name, count, serve)
    startup_gc.settle_collector()  # the workers settle theirs once their apps have started
    if launcher_pid is not None:
        watch_parent(int(launcher_pid), exit_orphaned)
    try:
        exporting = install_telemetry(mesh.telemetry, instance.name)  # the coordinator's spans
    except ConfigError as error:  # each worker stops on the same error, with its status
        logger.error("config error: %s", error)
        exporting = None
    try:
        return asyncio.run(_coordinate(mesh, instance, path, workers, exporting))
    finally:
        reserved.close()
        shutil.rmtree(runtime, ignore_errors=True)


async def _coordinate(
    mesh: MeshConfig, instance: ServerInstance, path: Path, workers: WorkerProcesses, exporting: Exporting | None
) -> int:
    hub = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        if mesh.checkpoint.enabled:
            hub = await start_coordinator(kind=KIND_OF_TYPE[instance.type], instance=instance.name,
                                          config=mesh.checkpoint, path=path, expected_workers=len(workers.pids))
        logger.info("%s: %d workers on %s", instance.name, len(workers.pids), instance.url)
        return await workers.wait(stop)
    finally:
        await workers.stop()
        if hub is not None:
            await hub.aclose()
        if exporting is not None:
            await exporting.aclose()


if __name__ == "__main__":
    main()
