"""A minimal participant: an adapter over a dict of sessions, its app, and a head-server stand-in.

The conformance suite, the sockets tests and the benchmarks run against it. A session belongs to
one episode (``rollout_id``, ``attempt``) and holds a JSON state; it may be marked busy (it then
blocks a prepare) or restart (never exported). A restored session keeps the record it came from
and exports it again byte for byte until it changes.

Run one as a process (the benchmarks do): ``GYM_CKPT_TOKEN=... python -m
nemo_gym_ckpt.testing.minimal --name s1 --kind agent --root ./checkpoints --port 8123``.

Data plane of the app (rollout-scoped, under ``/ng-rollout/<capture_key>/``):
``POST /session {"state": {...}}`` sets the session's state, ``GET /session`` reads it, and
``POST /session/busy {"busy": bool}`` marks it busy (a test hook standing in for a long step).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, SecretStr

from nemo_gym_ckpt.checkpoint.adapter import ExportItem, Readiness
from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK, Clock
from nemo_gym_ckpt.checkpoint.fileops import FileOps
from nemo_gym_ckpt.checkpoint.mount import mount_checkpointing
from nemo_gym_ckpt.checkpoint.participant import Participant
from nemo_gym_ckpt.checkpoint.records import Record, Scope
from nemo_gym_ckpt.checkpoint.telemetry import Telemetry
from nemo_gym_ckpt.config import CheckpointConfig
from nemo_gym_ckpt.config_yaml import dump_yaml
from nemo_gym_ckpt.errors import InvalidCheckpointState, RolloutIdRequired
from nemo_gym_ckpt.identity import RolloutIdentity, current_identity
from nemo_gym_ckpt.server import create_app

__all__ = [
    "MinimalHooks",
    "MinimalServer",
    "Session",
    "SessionsAdapter",
    "create_head_stub",
    "create_minimal_server",
    "main",
]


@dataclass
class Session:
    episode: RolloutIdentity
    state: dict[str, Any]
    busy: bool = False
    restart: bool = False
    restored: Record | None = None  # the record it was restored from, while unchanged

    def record(self) -> ExportItem:
        return self.restored or {"episode_id": self.episode.to_json(), "state": self.state}


@dataclass
class SessionsAdapter:
    """A ``ParticipantAdapter`` over ``sessions`` (capture key -> session)."""

    sessions: dict[str, Session] = field(default_factory=dict)
    participant: Participant | None = None

    # ---- data plane -------------------------------------------------------------------------

    def put(self, episode: RolloutIdentity, state: dict[str, Any], *, restart: bool = False) -> Session:
        session = Session(episode, state, restart=restart)
        self.sessions[episode.capture_key] = session
        return session

    def set_busy(self, episode: RolloutIdentity, busy: bool) -> None:
        session = self.sessions.get(episode.capture_key) or self.put(episode, {})
        session.busy = busy
        if self.participant is not None:
            self.participant.notify_changed()

    # ---- the adapter protocol ---------------------------------------------------------------

    async def readiness(self) -> Readiness:
        live = [key for key, s in self.sessions.items() if not s.restart]
        return Readiness(
            blockers=[key for key in live if self.sessions[key].busy],
            counts={"sessions": len(self.sessions)},
            restarts=[key for key, s in self.sessions.items() if s.restart],
        )

    async def export(self, scope: Scope | None) -> AsyncIterator[ExportItem]:
        for session in list(self.sessions.values()):
            if not session.restart:
                yield session.record()

    async def committed(self, scope: Scope | None) -> Mapping[str, Any]:
        if scope is not None:
            for key, session in list(self.sessions.items()):
                if session.restored is not None and session.restored.episode not in scope:
                    del self.sessions[key]
        return {}

    async def install(self, records: Sequence[Record], scope: Scope) -> None:
        for record in records:
            _check_record(record)
            if record.episode.next_attempt().capture_key in self.sessions:
                raise InvalidCheckpointState(f"session {record.episode.next_attempt().capture_key} exists")
        for record in records:
            target = record.episode.next_attempt()
            self.sessions[target.capture_key] = Session(target, dict(record.data["state"]), restored=record)

    async def retire(self, episodes: Sequence[RolloutIdentity]) -> None:
        for episode in episodes:
            for key, session in list(self.sessions.items()):
                mine = session.episode.rollout_id == episode.rollout_id
                if mine and session.episode.attempt <= episode.attempt:
                    del self.sessions[key]

    async def forget(self, rollout_ids: Sequence[str]) -> None:
        gone = set(rollout_ids)
        for key, session in list(self.sessions.items()):
            if session.episode.rollout_id in gone:
                del self.sessions[key]

    def status_extras(self) -> Mapping[str, Any]:
        return {"sessions": len(self.sessions)}


def _check_record(record: Record) -> None:
    if set(record.data) != {"episode_id", "state"} or not isinstance(record.data["state"], dict):
        raise InvalidCheckpointState(f"record of {record.episode.capture_key} is not a session record")


class _StateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    state: dict[str, Any]


class _BusyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    busy: bool


@dataclass
class MinimalServer:
    app: FastAPI
    adapter: SessionsAdapter
    participant: Participant | None


def create_minimal_server(
    name: str,
    checkpoint: CheckpointConfig,
    *,
    kind: str = "resources",
    clock: Clock = SYSTEM_CLOCK,
    telemetry: Telemetry | None = None,
    file_ops: FileOps | None = None,
) -> MinimalServer:
    """The minimal participant's app (a plain app when checkpointing is off)."""
    app = create_app(name)
    adapter = SessionsAdapter()
    participant = mount_checkpointing(
        app,
        checkpoint,
        adapter,
        kind=kind,
        instance=name,
        clock=clock,
        telemetry=telemetry,
        file_ops=file_ops,
    )
    adapter.participant = participant
    _data_routes(app, adapter, participant)
    return MinimalServer(app, adapter, participant)


def _data_routes(app: FastAPI, adapter: SessionsAdapter, participant: Participant | None) -> None:

    async def admitted() -> RolloutIdentity:
        identity = current_identity()
        if participant is not None:
            await participant.admit(identity)
        if identity is None:
            raise RolloutIdRequired("/session needs /ng-rollout/<capture_key>/")
        return identity

    @app.post("/session")
    async def put_session(body: _StateBody) -> dict[str, Any]:
        identity = await admitted()
        adapter.put(identity, body.state)
        return {"key": identity.capture_key, "state": body.state}

    @app.get("/session")
    async def get_session(request: Request) -> dict[str, Any]:
        identity = await admitted()
        session = adapter.sessions.get(identity.capture_key)
        return {"key": identity.capture_key, "state": session.state if session else None}

    @app.post("/session/busy")
    async def set_busy(body: _BusyBody) -> dict[str, Any]:
        identity = current_identity()
        if identity is None:
            raise RolloutIdRequired("/session/busy needs /ng-rollout/<capture_key>/")
        adapter.set_busy(identity, body.busy)
        return {"key": identity.capture_key, "busy": body.busy}


def create_head_stub(servers: Sequence[Mapping[str, str]]) -> FastAPI:
    """A stand-in for the head server: ``GET /servers`` lists ``{name, type, implementation, url}``
    and ``GET /global_config_dict_yaml`` answers them as NeMo Gym's head does (a JSON string of the
    YAML ``name -> type -> implementation -> {host, port}``)."""
    app = create_app("head")
    listing = [dict(server) for server in servers]
    config_yaml = dump_yaml(_config_of_listing(listing))

    @app.get("/servers")
    async def list_servers() -> list[dict[str, str]]:
        return listing

    @app.get("/global_config_dict_yaml")
    async def global_config_dict_yaml() -> str:
        return config_yaml

    return app


def _config_of_listing(listing: Sequence[Mapping[str, str]]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for server in listing:
        url = httpx.URL(server["url"])
        settings = {"host": url.host, "port": url.port or 80}
        config[server["name"]] = {server.get("type", "resources_servers"): {
            server.get("implementation", server["name"]): settings}}
    return config


class MinimalHooks:
    """The minimal app's data plane, as the conformance suite's ``DataHooks``."""

    async def request(
        self, client: httpx.AsyncClient, episode: RolloutIdentity, payload: dict[str, Any]
    ) -> httpx.Response:
        return await client.post(f"/ng-rollout/{episode.capture_key}/session", json={"state": payload})

    async def block(self, client: httpx.AsyncClient, episode: RolloutIdentity, blocked: bool) -> None:
        url = f"/ng-rollout/{episode.capture_key}/session/busy"
        response = await client.post(url, json={"busy": blocked})
        response.raise_for_status()


def main(argv: Sequence[str] | None = None) -> None:
    """Serve one minimal participant (token from ``GYM_CKPT_TOKEN``) until terminated."""
    parser = argparse.ArgumentParser(prog="python -m nemo_gym_ckpt.testing.minimal")
    parser.add_argument("--name", required=True)
    parser.add_argument("--kind", default="resources")
    parser.add_argument("--root", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--grace-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    config = CheckpointConfig(
        enabled=True,
        control_auth_token=SecretStr(os.environ["GYM_CKPT_TOKEN"]),
        root=args.root,
        lease_grace_seconds=args.grace_s,
    )
    server = create_minimal_server(args.name, config, kind=args.kind)
    uvicorn.run(
        server.app, host="127.0.0.1", port=args.port, log_level="warning", loop="uvloop", http="httptools"
    )


if __name__ == "__main__":
    main()
