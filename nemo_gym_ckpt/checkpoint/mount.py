"""One call for a server to become a participant: ``mount_checkpointing``.

With checkpointing off (no ``checkpoint:`` block, or ``enabled: false``) it does nothing at all and
returns ``None``: no route (``/status`` answers 404), no participant, no waiting. With it on, it
builds the ``Participant`` over the server's adapter, mounts the control router, puts
``ControlFirst`` in front of the app (control calls served ahead of data requests on a busy server)
and closes the participant's background work when the app shuts down. When the app starts, the control routes are
moved after every other route: servers add their own routes after mounting, and routes are tried in
order, so each data request would otherwise try the control routes first (about 15 us of CPU each).
Servers keep the returned participant and call ``participant.admit(identity)`` on rollout-scoped
routes (only when it is not ``None``).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.routing import BaseRoute

from nemo_gym_ckpt.checkpoint.adapter import ParticipantAdapter
from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK, Clock
from nemo_gym_ckpt.checkpoint.collector_pause import PROCESS_COLLECTOR
from nemo_gym_ckpt.checkpoint.collector_schedule import PROCESS_FULL_COLLECTIONS
from nemo_gym_ckpt.checkpoint.fileops import FileOps
from nemo_gym_ckpt.checkpoint.follower import FollowerParticipant, WorkerLink
from nemo_gym_ckpt.checkpoint.participant import Participant
from nemo_gym_ckpt.checkpoint.priority import ControlFirst
from nemo_gym_ckpt.checkpoint.router import make_router
from nemo_gym_ckpt.checkpoint.store import CheckpointStore
from nemo_gym_ckpt.checkpoint.telemetry import Telemetry
from nemo_gym_ckpt.checkpoint.worker_hub import COORDINATOR_ENV
from nemo_gym_ckpt.config import CheckpointConfig
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.server import close_on_shutdown

__all__ = ["LOST_COORDINATOR_GRACE_S", "mount_checkpointing"]

LOST_COORDINATOR_GRACE_S = 10.0


def mount_checkpointing(
    app: FastAPI,
    source: ServerContext[Any] | CheckpointConfig,
    adapter: ParticipantAdapter,
    *,
    kind: str,
    instance: str | None = None,
    clock: Clock = SYSTEM_CLOCK,
    telemetry: Telemetry | None = None,
    file_ops: FileOps | None = None,
) -> Participant | None:
    """Mount the control routes of a new participant on ``app``; ``None`` when checkpointing is off.

    ``source`` is the server's context (its instance name and the mesh's ``checkpoint`` block) or a
    ``CheckpointConfig`` (then ``instance`` is required).
    """
    config = source.mesh.checkpoint if isinstance(source, ServerContext) else source
    if not config.enabled:
        return None
    name = instance or (source.name if isinstance(source, ServerContext) else None)
    if name is None:
        raise ValueError("instance is required when mounting from a CheckpointConfig")
    assert config.control_auth_token is not None  # the config refuses enabled without a token
    coordinator = os.environ.get(COORDINATOR_ENV)
    participant = (Participant if coordinator is None else FollowerParticipant)(
        kind=kind,
        instance=name,
        adapter=adapter,
        store=CheckpointStore(config.root, file_ops, max_record_bytes=config.max_record_bytes),
        lease_grace_s=config.lease_grace_seconds,
        clock=clock,
        telemetry=telemetry.for_participant(kind, name) if telemetry else None,
        max_deadline_s=config.max_deadline_seconds,
        collector=PROCESS_COLLECTOR if config.pause_garbage_collection else None,
    )
    forward = None
    if isinstance(participant, FollowerParticipant):  # a worker of a multi-worker server
        assert coordinator is not None
        link = WorkerLink(participant, adapter, Path(coordinator), _exit_for_lost_coordinator)
        _start_with_app(app, link)
        forward = link.forward
    before = {id(route) for route in app.router.routes}
    app.include_router(make_router(participant, config.control_auth_token.get_secret_value(), forward))
    app.add_middleware(ControlFirst)  # control calls ahead of data requests on a busy server
    _last_once_started(app, [route for route in app.router.routes if id(route) not in before])
    if config.full_collection_interval_seconds is not None:
        _full_collections_while_running(app, config.full_collection_interval_seconds)
    close_on_shutdown(app, participant.aclose)
    return participant


def _exit_for_lost_coordinator() -> None:
    """A worker whose coordinator is gone shuts down (SIGTERM), and is killed if that takes too long."""
    os.kill(os.getpid(), signal.SIGTERM)
    killer = threading.Timer(LOST_COORDINATOR_GRACE_S, os.kill, (os.getpid(), signal.SIGKILL))
    killer.daemon = True
    killer.start()


def _start_with_app(app: FastAPI, link: WorkerLink) -> None:
    """Connect ``link`` when ``app`` starts; close it when the app shuts down."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(instance: FastAPI) -> AsyncIterator[Any]:
        link.start()
        try:
            async with inner(instance) as state:
                yield state
        finally:
            await link.aclose()

    app.router.lifespan_context = lifespan


def _full_collections_while_running(app: FastAPI, interval_s: float) -> None:
    """The process's full collections on a schedule from the app's start to its shutdown."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(instance: FastAPI) -> AsyncIterator[Any]:
        PROCESS_FULL_COLLECTIONS.start(interval_s)
        try:
            async with inner(instance) as state:
                yield state
        finally:
            PROCESS_FULL_COLLECTIONS.stop()

    app.router.lifespan_context = lifespan


def _last_once_started(app: FastAPI, control: list[BaseRoute]) -> None:
    """When ``app`` starts, move the ``control`` routes after all the others (in their order).

    No path of the server's own routes is under the control prefix, so the order changes what
    matches no request: a data request simply finds its route before the control routes.
    """
    inner = app.router.lifespan_context
    moved = {id(route) for route in control}

    @asynccontextmanager
    async def lifespan(instance: FastAPI) -> AsyncIterator[Any]:
        routes = app.router.routes
        routes[:] = [route for route in routes if id(route) not in moved] + control
        async with inner(instance) as state:
            yield state

    app.router.lifespan_context = lifespan
