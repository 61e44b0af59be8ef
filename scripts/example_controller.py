#!/usr/bin/env python3
"""A NeMo RL style controller for a running mesh, written with nothing but httpx and docs/protocol.md.

    export GYM_CKPT_TOKEN=...       # the mesh's checkpoint.control_auth_token (never on argv)
    python scripts/example_controller.py checkpoint --head http://127.0.0.1:11000 --dir /abs/ckpts \\
        --input resources_servers/calculator_tools/data/quickstart.jsonl --rollouts 8
    # ... every server dies; start the mesh again (fresh processes) ...
    python scripts/example_controller.py restore --head http://127.0.0.1:11000 --dir /abs/ckpts

``checkpoint`` dispatches N rollouts (``POST {environment}/ng-rollout/<rollout_id>/run`` with a task
row), takes one checkpoint while they run and lets them finish:

1. discover: ``GET {head}/servers``, then each server's ``GET .../checkpoint/status`` (404: not a
   participant);
2. prepare stage by stage (environment, model, agent, resources), again with the same id while a
   stage is not ready, until the deadline (then resume: abort);
3. commit everywhere at once with the rollouts in flight that are not restarts as the scope;
4. publish its own aggregate last: ``<dir>/<id>/controller.json``, then ``<dir>/LATEST``;
5. resume in reverse order; wait for the rollouts; forget them (callers first).

``restore`` runs on a fresh mesh: it restores the checkpoint ``LATEST`` names with its continued
rollouts, resumes, and dispatches each one again as its next attempt with the same task row (the
environment continues it from the restored boundary); the rest start over as a new attempt.
Directory paths are sent absolute and must lie inside the mesh's ``checkpoint.root``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

CONTROL = "/ng-control/v1/checkpoint"
PREPARE_ORDER = ("environment", "model", "agent", "resources")
RESUME_ORDER = tuple(reversed(PREPARE_ORDER))
RETIRE_ORDER = (("environment",), ("agent",), ("model", "resources"))
GRACE_S = 5.0
MAX_SECONDS = 365 * 24 * 3600.0  # the longest deadline a participant takes (max_deadline_seconds' bound)
Episode = dict[str, Any]  # {"rollout_id": str, "attempt": int}


def seconds(text: str) -> float:
    """A ``--timeout-s``: more than 0 and at most a year, never ``nan`` or ``inf`` (a deadline never reached).

    The rule of ``nemo-gym-ckpt``'s own duration flags (``nemo_gym_ckpt.cli.arguments.seconds``),
    written out here so that this script needs nothing but httpx.
    """
    value = float(text)
    if not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most {MAX_SECONDS:g} seconds, got {text}")
    return value


def capture_key(episode: Episode) -> str:
    """docs/protocol.md section 1: ``r`` for attempt 0, ``r-aN`` for attempt N."""
    rollout_id, attempt = episode["rollout_id"], episode["attempt"]
    return rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"


class ControlError(Exception):
    """A participant answered a control call with an error (``{"error": {"code", "detail"}}``)."""


@dataclass(frozen=True)
class Participant:
    name: str
    kind: str
    url: str


@dataclass
class Mesh:
    """The participants behind one head server, driven in the orders of docs/protocol.md section 5."""

    http: httpx.AsyncClient
    head: str
    token: str
    participants: tuple[Participant, ...] = ()

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"}

    async def servers(self) -> list[dict[str, str]]:
        reply = await self.http.get(f"{self.head}/servers")
        reply.raise_for_status()
        servers: list[dict[str, str]] = reply.json()
        return servers

    async def discover(self) -> tuple[Participant, ...]:
        found = []
        for server in await self.servers():
            reply = await self.http.get(f"{server['url']}{CONTROL}/status", headers=self.headers)
            if reply.status_code == 404:
                continue  # not a participant
            status = _checked(reply, f"status of {server['name']}")
            found.append(Participant(server["name"], status["kind"], server["url"]))
        self.participants = tuple(found)
        return self.participants

    def environment_url(self) -> str:
        return next(p.url for p in self.participants if p.kind == "environment")

    async def _call(self, participant: Participant, op: str, body: dict[str, Any]) -> dict[str, Any]:
        timeout = max(body["deadline_ts"] - time.time(), 0.0) + GRACE_S
        reply = await self.http.post(f"{participant.url}{CONTROL}/{op}", json=body, headers=self.headers,
                                     timeout=timeout)
        return _checked(reply, f"{op} on {participant.name}")

    async def stage(
        self, kinds: tuple[str, ...], op: str, body: dict[str, Any]
    ) -> list[tuple[Participant, dict[str, Any]]]:
        """One stage: every participant of these kinds at once; (participant, reply) pairs."""
        chosen = [p for p in self.participants if p.kind in kinds]
        replies = await asyncio.gather(*(self._call(p, op, body) for p in chosen))
        return list(zip(chosen, replies, strict=True))

    async def prepare(self, checkpoint_id: str, deadline_ts: float) -> tuple[bool, set[str]]:
        """Prepare stage by stage; (ready, capture keys of restarts)."""
        restarts: set[str] = set()
        for kind in PREPARE_ORDER:
            body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts}
            replies = [reply for _, reply in await self.stage((kind,), "prepare", body)]
            restarts.update(key for reply in replies for key in reply["report"]["restarts"])
            if not all(reply["report"]["ready"] for reply in replies):
                return False, restarts
        return True, restarts

    async def resume(self, checkpoint_id: str) -> None:
        """Reverse order; keep going past failures so that every participant reopens."""
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": time.time() + 30}
        for kind in RESUME_ORDER:
            try:
                await self.stage((kind,), "resume", body)
            except ControlError as error:
                print(f"resume: {error}", file=sys.stderr)

    async def housekeeping(
        self, op: str, field: str, items: list[Any], checkpoint_id: str | None = None
    ) -> None:
        """retire or forget: callers first (environment, agent, then model and resources). A fresh id,
        or the id of the restore that is open."""
        checkpoint_id = checkpoint_id or f"{op}-{secrets.token_hex(4)}"
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": time.time() + 60, field: items}
        for kinds in RETIRE_ORDER:
            await self.stage(kinds, op, body)


def _checked(reply: httpx.Response, what: str) -> dict[str, Any]:
    body: dict[str, Any] = reply.json()
    if reply.status_code >= 400:
        error = body.get("error", {})
        raise ControlError(f"{what}: {reply.status_code} {error.get('code')}: {error.get('detail')}")
    return body


# ---- rollouts ------------------------------------------------------------------------------------


@dataclass
class Rollouts:
    """The rollouts this controller dispatched, and which are still in flight."""

    mesh: Mesh
    tasks: dict[str, dict[str, Any]]
    in_flight: dict[str, Episode]
    results: dict[str, dict[str, Any]]

    async def run(self, episode: Episode) -> None:
        key = capture_key(episode)
        self.in_flight[key] = episode
        url = f"{self.mesh.environment_url()}/ng-rollout/{key}/run"
        try:
            reply = await self.mesh.http.post(url, json=self.tasks[episode["rollout_id"]], timeout=3600)
            self.results[episode["rollout_id"]] = {"attempt": episode["attempt"], "status": reply.status_code,
                                                   "reward": reply.json().get("reward")}
        finally:
            self.in_flight.pop(key, None)


async def take_checkpoint(
    mesh: Mesh, rollouts: Rollouts, directory: Path, timeout_s: float
) -> dict[str, Any]:
    """Prepare, commit the continued rollouts, publish ``controller.json`` and ``LATEST``, resume."""
    checkpoint_id = f"ckpt-{int(time.time())}-{secrets.token_hex(4)}"
    deadline = time.time() + timeout_s
    try:
        ready, restarts = await mesh.prepare(checkpoint_id, min(deadline, time.time() + 10))
        while not ready and time.time() < deadline:
            ready, restarts = await mesh.prepare(checkpoint_id, min(deadline, time.time() + 10))
        if not ready:
            raise ControlError(f"{checkpoint_id}: not ready by the deadline; aborted")
        in_flight = list(rollouts.in_flight.values())
        scope = [e for e in in_flight if capture_key(e) not in restarts]
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline,
                "checkpoint_dir": str(directory / checkpoint_id), "episode_ids": scope}
        commits = [reply for _, reply in await mesh.stage(PREPARE_ORDER, "commit", body)]
        aggregate = {"checkpoint_id": checkpoint_id, "continued": scope,
                     "restarted": [e for e in in_flight if e not in scope],
                     "manifests": [reply["manifest"] for reply in commits],
                     "staging_keys": [key for reply in commits for key in reply.get("staging_keys", [])],
                     "tasks": rollouts.tasks}
        publish(directory, aggregate)
        return aggregate
    finally:
        await mesh.resume(checkpoint_id)


def publish(directory: Path, aggregate: dict[str, Any]) -> None:
    """The controller's own aggregate, after every participant's manifest; then the pointer."""
    _write(directory / aggregate["checkpoint_id"] / "controller.json", json.dumps(aggregate, indent=1))
    _write(directory / "LATEST", aggregate["checkpoint_id"] + "\n")


def _write(path: Path, text: str) -> None:
    """Atomically: a temporary file, fsync, rename."""
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    temporary.replace(path)


def read_latest(directory: Path) -> dict[str, Any]:
    latest = (directory / "LATEST").read_text().strip()
    aggregate: dict[str, Any] = json.loads((directory / latest / "controller.json").read_text())
    return aggregate


async def restore_checkpoint(
    mesh: Mesh, directory: Path, timeout_s: float
) -> tuple[list[Episode], dict[str, Any]]:
    """Restore the continued rollouts of ``LATEST`` on a fresh mesh; the attempts to dispatch next."""
    aggregate = read_latest(directory)
    restore_id = f"restore-{int(time.time())}-{secrets.token_hex(4)}"
    continued = aggregate["continued"]
    body = {"checkpoint_id": restore_id, "deadline_ts": time.time() + timeout_s,
            "checkpoint_dir": str(directory / aggregate["checkpoint_id"]), "episode_ids": continued}
    try:
        replies = await mesh.stage(PREPARE_ORDER, "restore", body)
    except ControlError:  # undo everywhere (retire the next attempts, resume), then give up
        next_attempts = [{**e, "attempt": e["attempt"] + 1} for e in continued]
        await mesh.housekeeping("retire", "episode_ids", next_attempts, checkpoint_id=restore_id)
        await mesh.resume(restore_id)
        raise
    await mesh.resume(restore_id)
    restored = {key for p, reply in replies if p.kind == "environment" for key in reply["restored"]}
    episodes = [{**e, "attempt": e["attempt"] + 1} for e in continued + aggregate["restarted"]]
    return episodes, {"restored": sorted(restored), **aggregate}


# ---- the command ---------------------------------------------------------------------------------


def _tasks(path: Path, count: int) -> dict[str, dict[str, Any]]:
    lines = [line for line in path.read_text().splitlines() if line.strip()][:count]
    return {f"ex-{index}": json.loads(line) for index, line in enumerate(lines)}


async def checkpoint_command(mesh: Mesh, args: argparse.Namespace) -> dict[str, Any]:
    await mesh.discover()
    rollouts = Rollouts(mesh, _tasks(args.input, args.rollouts), {}, {})
    runs = [asyncio.create_task(rollouts.run({"rollout_id": rid, "attempt": 0})) for rid in rollouts.tasks]
    while len(rollouts.results) < args.after_rows:  # the first ones finish; the others are mid-episode
        await asyncio.sleep(0.01)
    aggregate = await take_checkpoint(mesh, rollouts, args.dir, args.timeout_s)
    await asyncio.gather(*runs)
    await mesh.housekeeping("forget", "rollout_ids", list(rollouts.tasks))
    return {"checkpoint": {k: v for k, v in aggregate.items() if k != "tasks"}, "results": rollouts.results}


async def restore_command(mesh: Mesh, args: argparse.Namespace) -> dict[str, Any]:
    await mesh.discover()
    episodes, aggregate = await restore_checkpoint(mesh, args.dir, args.timeout_s)
    rollouts = Rollouts(mesh, aggregate["tasks"], {}, {})
    await asyncio.gather(*(rollouts.run(episode) for episode in episodes))
    await mesh.housekeeping("forget", "rollout_ids", [e["rollout_id"] for e in episodes] or ["none"])
    return {"restored": aggregate["restored"], "results": rollouts.results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("checkpoint", "restore"))
    parser.add_argument("--head", required=True, help="the mesh's head server URL")
    parser.add_argument("--dir", type=lambda text: Path(text).absolute(), required=True,
                        help="where checkpoints go (inside the mesh's checkpoint.root)")
    parser.add_argument("--input", type=Path, help="task rows (JSON Lines), for checkpoint")
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--after-rows", type=int, default=1, help="checkpoint once this many have finished")
    parser.add_argument("--timeout-s", type=seconds, default=120.0)
    args = parser.parse_args(argv)
    token = os.environ.get("GYM_CKPT_TOKEN", "")
    if not token or (args.command == "checkpoint" and args.input is None):
        parser.error("set GYM_CKPT_TOKEN, and pass --input for checkpoint")
    return asyncio.run(_run(args, token))


async def _run(args: argparse.Namespace, token: str) -> int:
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        mesh = Mesh(http, args.head.rstrip("/"), token)
        command = checkpoint_command if args.command == "checkpoint" else restore_command
        try:
            print(json.dumps(await command(mesh, args), indent=1))
        except ControlError as error:
            print(f"example_controller: {error}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
