"""A controller that drives a mesh the way NeMo RL's Gym checkpoint adapter does, written from its facts.

NeMo RL (``gym_checkpoint_adapter`` and its coordinator, over NeMo Gym's ``coordination`` and
``store``) is not installed here; this is this project's own code, doing what those do on the
wire, so that a test shows the mesh serves that controller unchanged. It talks plain HTTP
(``httpx``) and shares nothing with ``nemo_gym_ckpt.checkpoint.coordinator``:

- **discovery**: the head's ``GET /global_config_dict_yaml`` is a JSON string of YAML; a server is
  a top-level mapping holding one of NeMo Gym's four type keys, its URL the ``host`` and ``port``
  of the first implementation under the first type key; each answers ``GET
  /ng-control/v1/checkpoint/status`` with the bearer token (404: not a participant), its ``kind``
  one of the four; a model participant must be there. Members sorted by stage, then name;
- **calls**: ``POST /ng-control/v1/checkpoint/<op>``, timeout the remaining deadline + 5 s, any
  non-200 a ``ParticipantError``;
- **prepare**: environment, model, agent, resources, one stage at a time, stopping after the first
  stage where a reply is not ``prepared``; a second prepare of the same id goes on from there;
- **commit**: every member at once, the body always with ``stop`` and ``episode_ids`` as
  ``[{rollout_id, attempt}]``; then the adapter's checks of every reply (``commit_summary``): the
  reply set is the member set; each reply ``committed`` with unique ``episode_ids`` inside the
  scope and an exactly typed manifest; the model's ``staging_keys_by_episode`` one entry per
  exported record, each list sorted, their union the sorted unique ``staging_keys``; every agent's
  records re-read from disk as NeMo Gym's store reads them (``read_participant_state``: manifest,
  file-name pattern, whole-file SHA-256, line count), a non-null ``episode`` field naming a legacy
  episode the agent must have exported; one environment export per capture key;
- **outer manifest**: ``gym_checkpoint.json`` in the training checkpoint's directory, written
  after every commit and check (a temporary file, then ``os.replace``): schema version 2, the
  checkpoint id, per Gym instance its exported episodes and their staging keys;
- **restore**: every member at once under a new id, the scope the outer manifest's episodes
  (attempt N); every reply's ``source_checkpoint_id`` must be the manifest's; on a failure the
  attempts N+1 are retired everywhere, everyone is resumed, and the error is raised;
- **resume**: resources, agent, model, environment, going on past failures, then raising;
- **retire**, **forget**: environment, then agent, then model and resources together.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

__all__ = [
    "OUTER_MANIFEST",
    "CommitSummary",
    "Episode",
    "GymInstance",
    "Member",
    "NemoRlController",
    "ParticipantError",
    "PrepareOutcome",
    "load_outer_manifest",
    "read_participant_state",
]

TYPE_KEYS = ("environment_servers", "responses_api_models", "responses_api_agents", "resources_servers")
STAGES = ("environment", "model", "agent", "resources")
ROUTE = "/ng-control/v1/checkpoint"
GRACE_S = 5.0
CLEANUP_S = 30.0
OUTER_MANIFEST = "gym_checkpoint.json"
RECORDS_FILE = re.compile(r"^records(-[0-9a-f]{64})?\.jsonl$")
ATTEMPT_SUFFIX = re.compile(r"-a([1-9][0-9]*)$")
MANIFEST_STR = ("instance", "checkpoint_id", "records_file", "records_sha256")


@dataclass(frozen=True, order=True)
class Episode:
    """NeMo Gym's ``EpisodeId``: a rollout id and an attempt."""

    rollout_id: str
    attempt: int = 0

    @property
    def capture_key(self) -> str:
        return self.rollout_id if self.attempt == 0 else f"{self.rollout_id}-a{self.attempt}"

    @classmethod
    def from_capture_key(cls, key: str) -> Episode:
        found = ATTEMPT_SUFFIX.search(key)
        return cls(key[: found.start()], int(found.group(1))) if found else cls(key)

    def next_attempt(self) -> Episode:
        return Episode(self.rollout_id, self.attempt + 1)

    def to_json(self) -> dict[str, Any]:
        return {"rollout_id": self.rollout_id, "attempt": self.attempt}


@dataclass(frozen=True)
class GymInstance:
    """One Gym actor of the training job: its checkpoint directory under the training checkpoint."""

    shard: str = "shard-0"
    replica: int = 0

    @property
    def instance_id(self) -> str:
        return f"{self.shard}/replica-{self.replica}"

    def checkpoint_dir(self, root: Path) -> Path:
        return root / "gym-instances" / self.shard / f"replica-{self.replica}"


@dataclass(frozen=True)
class Member:
    name: str
    kind: str
    instance: str
    url: str


class ParticipantError(RuntimeError):
    """A participant answered a control call with a non-200 reply (or its reply failed a check)."""

    def __init__(self, member: str, op: str, status: int, code: str, detail: str) -> None:
        super().__init__(f"{op} on {member}: {status} {code}: {detail}")
        self.member, self.op, self.status, self.code, self.detail = member, op, status, code, detail


@dataclass
class PrepareOutcome:
    prepared: bool
    replies: dict[str, dict[str, Any]]

    def blockers(self) -> list[str]:
        return sorted(key for reply in self.replies.values() if reply["phase"] != "prepared"
                      for key in reply["report"]["blockers"])

    def restarts(self) -> set[Episode]:
        return {Episode.from_capture_key(key) for reply in self.replies.values()
                for key in reply["report"]["restarts"]}

    def continued(self, candidates: Sequence[Episode]) -> list[Episode]:
        restarts = self.restarts()
        return [episode for episode in candidates if episode not in restarts]


@dataclass
class CommitSummary:
    """What the adapter keeps of one instance's commit."""

    replies: dict[str, dict[str, Any]]
    exported_episodes: list[Episode]
    staging_keys_by_episode: dict[str, list[str]]
    unowned_live_episodes: list[str] = field(default_factory=list)

    def staging_keys(self) -> list[str]:
        exported = {episode.capture_key for episode in self.exported_episodes}
        return sorted({key for capture, keys in self.staging_keys_by_episode.items() if capture in exported
                       for key in keys})


class NemoRlController:
    """Drives the participants of the mesh behind ``head_url`` (module docstring)."""

    def __init__(self, head_url: str, token: str, http: httpx.AsyncClient) -> None:
        self.head_url = head_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"}
        self.http = http
        self.members: list[Member] = []

    # ---- discovery ------------------------------------------------------------------------------

    async def discover(self) -> list[Member]:
        reply = await self.http.get(f"{self.head_url}/global_config_dict_yaml", timeout=60.0)
        reply.raise_for_status()
        config = yaml.safe_load(json.loads(reply.content))
        servers = {name: url for name, block in config.items() if (url := _server_url(block)) is not None}
        found = await asyncio.gather(*(self._status_of(name, url) for name, url in servers.items()))
        members = [member for member in found if member is not None]
        if not any(member.kind == "model" for member in members):
            raise RuntimeError("discover: no model participant")
        self.members = sorted(members, key=lambda m: (STAGES.index(m.kind), m.name))
        return self.members

    async def _status_of(self, name: str, url: str) -> Member | None:
        reply = await self.http.get(f"{url}{ROUTE}/status", headers=self.headers, timeout=60.0)
        if reply.status_code == 404:
            return None
        if reply.status_code != 200:
            raise _error(name, "discover", reply)
        status = reply.json()
        if status["kind"] not in STAGES:
            raise RuntimeError(f"discover: {name} is of kind {status['kind']!r}")
        return Member(name, status["kind"], status["instance"], url)

    def of_kind(self, *kinds: str) -> list[Member]:
        return [member for member in self.members if member.kind in kinds]

    # ---- calls ----------------------------------------------------------------------------------

    async def call(self, member: Member, op: str, body: dict[str, Any]) -> dict[str, Any]:
        timeout = max(body["deadline_ts"] - time.time(), 0.0) + GRACE_S
        reply = await self.http.post(f"{member.url}{ROUTE}/{op}", json=body, headers=self.headers, timeout=timeout)
        if reply.status_code != 200:
            raise _error(member.name, op, reply)
        answer: dict[str, Any] = reply.json()
        return answer

    async def all_at_once(self, members: Sequence[Member], op: str, body: dict[str, Any]) -> dict[str, Any]:
        """Each member's reply, or the ``ParticipantError`` it failed with, by name."""
        outcomes = await asyncio.gather(*(self.call(m, op, body) for m in members), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, ParticipantError):
                raise outcome
        return {member.name: outcome for member, outcome in zip(members, outcomes, strict=True)}

    async def _all_or_raise(self, members: Sequence[Member], op: str, body: dict[str, Any]) -> dict[str, Any]:
        outcomes = await self.all_at_once(members, op, body)
        for outcome in outcomes.values():
            if isinstance(outcome, ParticipantError):
                raise outcome
        return outcomes

    # ---- operations -----------------------------------------------------------------------------

    async def prepare(self, checkpoint_id: str, deadline_ts: float) -> PrepareOutcome:
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts}
        replies: dict[str, dict[str, Any]] = {}
        for kind in STAGES:
            stage = await self._all_or_raise(self.of_kind(kind), "prepare", body)
            replies |= stage
            if any(reply["phase"] != "prepared" for reply in stage.values()):
                return PrepareOutcome(False, replies)
        return PrepareOutcome(True, replies)

    async def renew(self, checkpoint_id: str, deadline_ts: float) -> dict[str, Any]:
        return await self._all_or_raise(self.members, "renew", {"checkpoint_id": checkpoint_id,
                                                                "deadline_ts": deadline_ts})

    async def commit(
        self, checkpoint_id: str, deadline_ts: float, checkpoint_dir: Path, scope: Sequence[Episode], *, stop: bool
    ) -> CommitSummary:
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts, "checkpoint_dir": str(checkpoint_dir),
                "episode_ids": [episode.to_json() for episode in scope], "stop": stop}
        replies = await self._all_or_raise(self.members, "commit", body)
        return await asyncio.to_thread(self.commit_summary, checkpoint_id, checkpoint_dir, scope, replies)

    def commit_summary(
        self, checkpoint_id: str, checkpoint_dir: Path, scope: Sequence[Episode], replies: Mapping[str, Any]
    ) -> CommitSummary:
        """The adapter's checks of the commit replies (module docstring); ``RuntimeError`` on any."""
        if set(replies) != {member.name for member in self.members}:
            raise RuntimeError(f"commit replies from {sorted(replies)}, members {[m.name for m in self.members]}")
        candidates = {episode.capture_key for episode in scope}
        for member in self.members:
            _check_commit_reply(member, replies[member.name], checkpoint_id, candidates)
        by_episode: dict[str, list[str]] = {}
        for model in self.of_kind("model"):
            by_episode |= _checked_staging_keys(model.name, replies[model.name])
        owned = self._environment_exports(replies) | self._legacy_agent_keys(checkpoint_dir, replies)
        sessions = {key for m in self.of_kind("agent") for key in replies[m.name]["episode_ids"]}
        keys = {key for reply in replies.values() for key in reply["episode_ids"]}
        exported = sorted(Episode.from_capture_key(key) for key in keys)
        return CommitSummary(dict(replies), exported, by_episode, sorted(sessions - owned))

    def _environment_exports(self, replies: Mapping[str, Any]) -> set[str]:
        seen: set[str] = set()
        for member in self.of_kind("environment"):
            keys = set(replies[member.name]["episode_ids"])
            if keys & seen:
                raise RuntimeError(f"capture keys exported by two environments: {sorted(keys & seen)}")
            seen |= keys
        return seen

    def _legacy_agent_keys(self, checkpoint_dir: Path, replies: Mapping[str, Any]) -> set[str]:
        owners: set[str] = set()
        for member in self.of_kind("agent"):
            reply = replies[member.name]
            manifest, records = read_participant_state(checkpoint_dir, "agent", reply["manifest"]["instance"])
            if manifest["records_sha256"] != reply["manifest"]["records_sha256"]:
                raise RuntimeError(f"{member.name}: the records on disk are not the ones the commit answered")
            legacy = {Episode(**r["episode"]).capture_key for r in records if r.get("episode") is not None}
            if not legacy <= set(reply["episode_ids"]) or legacy & owners:
                raise RuntimeError(f"{member.name}: legacy episodes {sorted(legacy)} not its own")
            owners |= legacy
        return owners

    async def restore(
        self, restore_id: str, deadline_ts: float, checkpoint_dir: Path, scope: Sequence[Episode],
        source_checkpoint_id: str,
    ) -> dict[str, Any]:
        body = {"checkpoint_id": restore_id, "deadline_ts": deadline_ts, "checkpoint_dir": str(checkpoint_dir),
                "episode_ids": [episode.to_json() for episode in scope]}
        outcomes = await self.all_at_once(self.members, "restore", body)
        failed = [outcome for outcome in outcomes.values() if isinstance(outcome, ParticipantError)]
        wrong = [name for name, reply in outcomes.items() if not isinstance(reply, ParticipantError)
                 and reply.get("source_checkpoint_id") != source_checkpoint_id]
        if failed or wrong:
            await self._undo_restore(restore_id, deadline_ts, scope)
            if failed:
                raise failed[0]
            raise RuntimeError(f"restore: {wrong} answered another source checkpoint than {source_checkpoint_id}")
        return outcomes

    async def _undo_restore(self, restore_id: str, deadline_ts: float, scope: Sequence[Episode]) -> None:
        deadline = max(deadline_ts, time.time() + CLEANUP_S)
        if scope:
            await self.retire(restore_id, deadline, [e.next_attempt() for e in scope], raise_first=False)
        await self.resume(restore_id, deadline, raise_first=False)

    async def resume(self, checkpoint_id: str, deadline_ts: float, *, raise_first: bool = True) -> None:
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts}
        failures: list[ParticipantError] = []
        for kind in reversed(STAGES):
            outcomes = await self.all_at_once(self.of_kind(kind), "resume", body)
            failures += [o for o in outcomes.values() if isinstance(o, ParticipantError)]
        if failures and raise_first:
            raise failures[0]

    async def retire(
        self, checkpoint_id: str, deadline_ts: float, episodes: Sequence[Episode], *, raise_first: bool = True
    ) -> None:
        if episodes:
            body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts,
                    "episode_ids": [episode.to_json() for episode in episodes]}
            await self._housekeeping("retire", body, raise_first)

    async def forget(self, checkpoint_id: str, deadline_ts: float, rollout_ids: Sequence[str]) -> None:
        if rollout_ids:
            body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts,
                    "rollout_ids": sorted(set(rollout_ids))}
            await self._housekeeping("forget", body, True)

    async def _housekeeping(self, op: str, body: dict[str, Any], raise_first: bool) -> None:
        for kinds in (("environment",), ("agent",), ("model", "resources")):
            outcomes = await self.all_at_once(self.of_kind(*kinds), op, body)
            failures = [o for o in outcomes.values() if isinstance(o, ParticipantError)]
            if failures and raise_first:
                raise failures[0]

    # ---- the training checkpoint's outer manifest -----------------------------------------------

    @staticmethod
    def write_outer_manifest(root: Path, checkpoint_id: str, summaries: Mapping[GymInstance, CommitSummary]) -> Path:
        manifest = {
            "schema_version": 2,
            "checkpoint_id": checkpoint_id,
            "instances": {i.instance_id: [e.to_json() for e in s.exported_episodes] for i, s in summaries.items()},
            "staging_keys": {i.instance_id: s.staging_keys() for i, s in summaries.items()},
        }
        path, temporary = root / OUTER_MANIFEST, root / f"{OUTER_MANIFEST}.tmp"
        temporary.write_text(json.dumps(manifest, sort_keys=True, indent=2) + "\n")
        os.replace(temporary, path)
        return path


def load_outer_manifest(root: Path) -> tuple[str, dict[str, list[Episode]], dict[str, list[str]]]:
    """The checkpoint id, the episodes and the staging keys per Gym instance; unknown keys refused."""
    manifest = json.loads((root / OUTER_MANIFEST).read_text())
    if set(manifest) != {"schema_version", "checkpoint_id", "instances", "staging_keys"}:
        raise ValueError(f"{OUTER_MANIFEST}: keys {sorted(manifest)}")
    if manifest["schema_version"] != 2:
        raise ValueError(f"{OUTER_MANIFEST}: schema_version {manifest['schema_version']}")
    instances = {}
    for instance, episodes in manifest["instances"].items():
        if any(set(episode) != {"rollout_id", "attempt"} for episode in episodes):
            raise ValueError(f"{OUTER_MANIFEST}: an episode of {instance} is not {{rollout_id, attempt}}")
        instances[instance] = [Episode(**episode) for episode in episodes]
    return manifest["checkpoint_id"], instances, manifest["staging_keys"]


def read_participant_state(checkpoint_dir: Path, kind: str, instance: str) -> tuple[dict[str, Any], list[Any]]:
    """A participant's manifest and records, read and checked as NeMo Gym's store reads them."""
    where = checkpoint_dir / "gym" / kind / instance
    manifest = json.loads((where / "manifest.json").read_bytes())
    if not isinstance(manifest, dict) or manifest.get("schema_version") != 1:
        raise RuntimeError(f"{where}: not a schema 1 manifest")
    if (manifest.get("kind"), manifest.get("instance")) != (kind, instance):
        raise RuntimeError(f"{where}: the manifest names {manifest.get('kind')}/{manifest.get('instance')}")
    name = manifest.get("records_file")
    if not isinstance(manifest.get("checkpoint_id"), str) or not isinstance(name, str) or not RECORDS_FILE.match(name):
        raise RuntimeError(f"{where}: bad checkpoint_id or records_file")
    digest, records = hashlib.sha256(), []
    with (where / name).open("rb") as lines:
        for line in lines:
            digest.update(line)
            records.append(json.loads(line))
    if digest.hexdigest() != manifest["records_sha256"] or len(records) != manifest["record_count"]:
        raise RuntimeError(f"{where}: the records file does not match its manifest")
    return manifest, records


# ---- checks ---------------------------------------------------------------------------------------


def _server_url(block: Any) -> str | None:
    if not isinstance(block, Mapping) or not any(key in block for key in TYPE_KEYS):
        return None
    implementations = next(iter(block.values()))
    if not isinstance(implementations, Mapping) or not implementations:
        return None
    settings = next(iter(implementations.values()))
    return f"http://{settings['host']}:{settings['port']}"


def _error(member: str, op: str, reply: httpx.Response) -> ParticipantError:
    try:
        error = reply.json()["error"]
        code, detail = str(error["code"]), str(error["detail"])
    except (ValueError, KeyError, TypeError):
        code, detail = "unknown", reply.text[:200]
    return ParticipantError(member, op, reply.status_code, code, detail)


def _check_commit_reply(member: Member, reply: Mapping[str, Any], checkpoint_id: str, candidates: set[str]) -> None:
    keys = reply.get("episode_ids")
    if reply.get("phase") != "committed" or not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise RuntimeError(f"{member.name}: not a committed reply with episode_ids: {reply}")
    if len(keys) != len(set(keys)) or not set(keys) <= candidates:
        raise RuntimeError(f"{member.name}: episode_ids {keys} not unique or outside the scope")
    manifest = reply.get("manifest")
    if not isinstance(manifest, dict):
        raise RuntimeError(f"{member.name}: no manifest")
    typed = (type(manifest.get("schema_version")) is int and manifest.get("kind") == member.kind
             and manifest.get("checkpoint_id") == checkpoint_id
             and all(isinstance(manifest.get(k), str) and manifest[k] for k in MANIFEST_STR)
             and type(manifest.get("record_count")) is int and manifest["record_count"] >= 0)
    if not typed:
        raise RuntimeError(f"{member.name}: manifest fields not as typed: {manifest}")


def _checked_staging_keys(name: str, reply: Mapping[str, Any]) -> dict[str, list[str]]:
    """The model's ``staging_keys_by_episode`` as the adapter accepts it, or ``RuntimeError``."""
    keys, by_episode = reply.get("staging_keys"), reply.get("staging_keys_by_episode")
    if not isinstance(keys, list) or keys != sorted(set(keys)):
        raise RuntimeError(f"policy model {name} returned invalid staging_keys")
    valid = (isinstance(by_episode, dict) and set(by_episode) == set(reply["episode_ids"])
             and all(isinstance(v, list) and v == sorted(set(v)) for v in by_episode.values())
             and sorted({key for v in by_episode.values() for key in v}) == keys)
    if not valid:
        raise RuntimeError(f"policy model {name} returned invalid staging_keys_by_episode")
    assert isinstance(by_episode, dict)
    return by_episode
