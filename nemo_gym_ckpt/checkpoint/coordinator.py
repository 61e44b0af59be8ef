"""The coordinator: drives every participant of a mesh through one checkpoint (docs/protocol.md section 5).

Discovery reads the mesh the NeMo Gym way: the head server's ``GET /global_config_dict_yaml`` (a
JSON string holding the YAML of the resolved config), then every top-level entry shaped like a
server instance (instance -> its first server type key -> its first implementation -> settings with
``host`` and ``port``; the type keys are not looked at by name), then each server's checkpoint
``/status`` (``NotFound`` means "not a participant"). Orders:

- prepare: environment -> model -> agent -> resources, one stage at a time; stop at the first
  stage not ready;
- commit: all at once; any failure fails the commit (the controller must not publish);
- restore: all at once; on failure retire the N+1 attempts everywhere, resume everyone, raise;
- resume: resources -> agent -> model -> environment, going on past failures, then raise;
- retire, forget: environment, then agent, then model and resources together.

Each call's timeout is the remaining deadline + 5 s. The coordinator's calls go over a client of
its own (a pool of ``CONTROL_CONNECTIONS``), so a controller that also sends rollouts never queues a
control call behind them, and a new connection not made within ``CONTROL_CONNECT_S`` is made again on a
fresh socket (a burst of data connections may have filled the server's listen queue); a ``client``
passed in should be one kept for control calls too (``MeshClient.for_control``). Calls
are fanned out in a task group; a participant's failure is the ``GymError`` the client mapped,
kept per participant in the result, and raised as the same class naming the participant
(``error.fields["result"]`` holds the result). A call that fails any other way (a bug) is that
participant's ``UpstreamError``, logged with its traceback: it never cancels the other calls.

Replies are trusted only in their shape: discovery keeps a participant whose status names one of
the four kinds and a valid instance name, once per (kind, instance); a prepare, commit or restore
reply is checked as ``replies.py`` says (a commit's manifest must be this participant's, of this
checkpoint), and one that fails is that participant's ``UpstreamError``, naming the field.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import yaml

from nemo_gym_ckpt.checkpoint.participant import INSTANCE_NAME, KINDS
from nemo_gym_ckpt.checkpoint.replies import ReplyContext, reply_problem
from nemo_gym_ckpt.checkpoint.router import CONTROL_PREFIX
from nemo_gym_ckpt.checkpoint.telemetry import ATTR, Telemetry
from nemo_gym_ckpt.client import CONTROL_CONNECT_S, EncodedJson, MeshClient
from nemo_gym_ckpt.config import http_url
from nemo_gym_ckpt.config_yaml import YamlRefused, load_yaml
from nemo_gym_ckpt.errors import GymError, NotFound, Unavailable, UpstreamError
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = [
    "CALL_GRACE_S",
    "CLEANUP_MIN_S",
    "CONFIG_ROUTE",
    "PREPARE_STAGES",
    "RESUME_STAGES",
    "RETIRE_STAGES",
    "CommitResult",
    "Coordinator",
    "Outcome",
    "ParticipantRef",
    "PrepareResult",
    "RestoreResult",
    "StagedResult",
    "global_config_of",
    "servers_in_config",
]

logger = logging.getLogger(__name__)

CALL_GRACE_S = 5.0
CONTROL_CONNECTIONS = 64
CLEANUP_MIN_S = 30.0
DISCOVERY_TIMEOUT_S = 60.0
CONFIG_ROUTE = "/global_config_dict_yaml"
MAX_CONFIG_BYTES = 16 * 1024 * 1024
RETIRE_BATCH = 1024
MAX_FAILURE_CHARS = 500
"""The most characters of an unexpected exception's text kept in the error a participant's outcome holds."""
PREPARE_STAGES: tuple[tuple[str, ...], ...] = (("environment",), ("model",), ("agent",), ("resources",))
RESUME_STAGES: tuple[tuple[str, ...], ...] = tuple(reversed(PREPARE_STAGES))
RETIRE_STAGES: tuple[tuple[str, ...], ...] = (("environment",), ("agent",), ("model", "resources"))
ALL_AT_ONCE: tuple[tuple[str, ...], ...] = (("environment", "model", "agent", "resources"),)


@dataclass(frozen=True)
class ParticipantRef:
    name: str
    kind: str
    instance: str
    url: str


_Found = tuple[ParticipantRef, dict[str, Any]]


@dataclass
class Outcome:
    """One participant's reply to one call, or the error it answered."""

    participant: ParticipantRef
    reply: dict[str, Any] | None = None
    error: GymError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        if self.error is not None:
            return {"error": {"code": self.error.code, "detail": self.error.detail}}
        return dict(self.reply or {})


@dataclass
class StagedResult:
    """Outcomes of one coordinated op, in call order."""

    op: str
    checkpoint_id: str
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def failures(self) -> list[Outcome]:
        return [outcome for outcome in self.outcomes if not outcome.ok]

    def replies(self) -> dict[str, dict[str, Any]]:
        return {o.participant.name: o.reply for o in self.outcomes if o.reply is not None}

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "checkpoint_id": self.checkpoint_id,
                "participants": {o.participant.name: o.to_json() for o in self.outcomes}}


@dataclass
class PrepareResult(StagedResult):
    not_ready_stage: str | None = None

    @property
    def prepared(self) -> bool:
        return self.not_ready_stage is None and not self.failures

    def restarts(self) -> set[str]:
        """Capture keys of every restart episode, over all participants (never capped)."""
        reports = [reply["report"] for reply in self.replies().values()]
        return {key for report in reports if report is not None for key in report["restarts"]}

    def continued(self, episodes: Iterable[RolloutIdentity]) -> list[RolloutIdentity]:
        """The given in-flight episodes that continue from this checkpoint (the commit scope)."""
        restarts = self.restarts()
        return [episode for episode in episodes if episode.capture_key not in restarts]

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "prepared": self.prepared, "not_ready_stage": self.not_ready_stage,
                "restarts": sorted(self.restarts())}


@dataclass
class CommitResult(StagedResult):
    def manifests(self) -> dict[str, dict[str, Any]]:
        return {name: reply["manifest"] for name, reply in self.replies().items()}

    def staging_keys(self) -> dict[str, list[str]]:
        replies = self.replies().items()
        return {name: reply["staging_keys"] for name, reply in replies if "staging_keys" in reply}

    def episode_ids(self) -> list[str]:
        return sorted({key for reply in self.replies().values() for key in reply["episode_ids"]})


@dataclass
class RestoreResult(StagedResult):
    scope: list[RolloutIdentity] = field(default_factory=list)

    def restored(self) -> set[str]:
        """Capture keys of the next attempts installed (by the environments, if any took part)."""
        answered = [o for o in self.outcomes if o.reply is not None]
        environments = [o for o in answered if o.participant.kind == "environment"]
        return {key for o in (environments or answered) if o.reply for key in o.reply["restored"]}

    def continued(self) -> list[RolloutIdentity]:
        """Scope episodes that continue: dispatch each as its next attempt."""
        restored = self.restored()
        return [e.next_attempt() for e in self.scope if e.next_attempt().capture_key in restored]

    def restarts(self) -> list[RolloutIdentity]:
        """Scope episodes with nothing to continue from: dispatch them afresh."""
        restored = self.restored()
        return [episode for episode in self.scope if episode.next_attempt().capture_key not in restored]

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "continued": [e.capture_key for e in self.continued()],
                "restarts": [e.capture_key for e in self.restarts()]}


class Coordinator:
    """Drives the participants of the mesh behind ``head_url``; close with ``aclose``."""

    def __init__(
        self,
        head_url: str,
        token: str,
        *,
        client: MeshClient | None = None,
        required_kinds: Collection[str] = (),
        telemetry: Telemetry | None = None,
    ) -> None:
        self.head_url = head_url.rstrip("/")
        self._headers = {"authorization": f"Bearer {token}"}
        self._own_client = client is None
        # control calls over a pool of their own: never queued behind a controller's data calls
        self.client = client or MeshClient(max_connections=CONTROL_CONNECTIONS, connect_timeout_s=CONTROL_CONNECT_S)
        self.required_kinds = tuple(required_kinds)
        self.telemetry = telemetry or Telemetry("controller", "coordinator")
        self._participants: list[ParticipantRef] | None = None

    async def aclose(self) -> None:
        if self._own_client:
            await self.client.aclose()

    async def __aenter__(self) -> Coordinator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- discovery --------------------------------------------------------------------------

    async def discover(self) -> list[ParticipantRef]:
        """Ask the head for every server, then each server for its checkpoint status."""
        await self.status()
        assert self._participants is not None
        return self._participants

    async def participants(self) -> list[ParticipantRef]:
        return self._participants if self._participants is not None else await self.discover()

    async def status(self) -> dict[str, dict[str, Any]]:
        """The status of every participant, by server name (discovery is refreshed)."""
        statuses = await self._statuses()
        kinds = {ref.kind for ref, _ in statuses}
        missing = [kind for kind in self.required_kinds if kind not in kinds]
        if missing:
            raise Unavailable(f"no {', '.join(missing)} participant in the mesh at {self.head_url}")
        self._participants = [ref for ref, _ in statuses]
        return {ref.name: reply for ref, reply in statuses}

    async def _statuses(self) -> list[tuple[ParticipantRef, dict[str, Any]]]:
        reply = await self.client.request("GET", f"{self.head_url}{CONFIG_ROUTE}", rollout_prefix=False,
                                          timeout_s=DISCOVERY_TIMEOUT_S)
        listing = servers_in_config(global_config_of(reply.content))
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(self._status_of(server)) for server in listing]
        found = []
        for task in tasks:
            item = task.result()
            if isinstance(item, GymError):
                raise type(item)(f"discovery: {item.detail}") from item
            if item is not None:
                found.append(item)
        _refuse_twins([ref for ref, _ in found])
        return found

    async def _status_of(self, server: dict[str, str]) -> _Found | GymError | None:
        url = server["url"].rstrip("/")
        try:
            reply = await self.client.get_json(f"{url}{CONTROL_PREFIX}/status", headers=self._headers,
                                               rollout_prefix=False, timeout_s=DISCOVERY_TIMEOUT_S)
        except NotFound:
            return None
        except GymError as error:
            return type(error)(f"{server['name']}: {error.detail}")
        except Exception as error:  # noqa: BLE001 - one the client did not map (a bug): discovery fails plainly
            return _unexpected_failure("status", server["name"], error)
        problem = _status_problem(reply)
        if problem is not None:
            return UpstreamError(f"{server['name']}: checkpoint status is not a participant status: {problem}")
        return ParticipantRef(server["name"], reply["kind"], reply["instance"], url), reply

    # ---- operations -------------------------------------------------------------------------

    async def prepare(self, checkpoint_id: str, *, deadline_ts: float) -> PrepareResult:
        result = PrepareResult("prepare", checkpoint_id)
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts}
        with self._span("prepare", checkpoint_id):
            for stage in PREPARE_STAGES:
                with self._span(f"prepare.{stage[0]}", checkpoint_id):
                    outcomes = await self._fan_out(await self._in(stage), "prepare", body, deadline_ts)
                result.outcomes.extend(outcomes)
                _raise_first(result)
                if not all(o.reply is not None and o.reply["phase"] == "prepared" for o in outcomes):
                    result.not_ready_stage = stage[0]
                    break
        return result

    async def commit(
        self, checkpoint_id: str, *, deadline_ts: float, checkpoint_dir: str,
        episode_ids: Sequence[RolloutIdentity] | None = None, stop: bool = False, incremental: bool = True,
    ) -> CommitResult:
        """Commit everywhere; ``stop``: the mesh is stopped next (participants free what their records
        do not hold once the write is durable). The body always carries ``stop``, as upstream's does."""
        body: dict[str, Any] = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts,
                                "checkpoint_dir": checkpoint_dir, "stop": stop}
        if not incremental:  # sent only to turn it off: the default body stays upstream's
            body["incremental"] = False
        if episode_ids is not None:
            body["episode_ids"] = [episode.to_json() for episode in episode_ids]
        result = CommitResult("commit", checkpoint_id)
        with self._span("commit", checkpoint_id):
            result.outcomes = await self._fan_out(await self._in(ALL_AT_ONCE[0]), "commit", body, deadline_ts)
        _raise_first(result)
        return result

    async def restore(
        self, checkpoint_id: str, *, deadline_ts: float, checkpoint_dir: str,
        episode_ids: Sequence[RolloutIdentity],
    ) -> RestoreResult:
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts, "checkpoint_dir": checkpoint_dir,
                "episode_ids": [episode.to_json() for episode in episode_ids]}
        result = RestoreResult("restore", checkpoint_id, scope=list(episode_ids))
        with self._span("restore", checkpoint_id):
            everyone = await self._in(ALL_AT_ONCE[0])
            result.outcomes = await self._fan_out(everyone, "restore", body, deadline_ts)
            if result.failures:
                await self._undo_restore(checkpoint_id, episode_ids, deadline_ts)
        _raise_first(result)
        return result

    async def resume(self, checkpoint_id: str, *, deadline_ts: float) -> StagedResult:
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts}
        with self._span("resume", checkpoint_id):
            result = await self._staged("resume", RESUME_STAGES, body, deadline_ts)
        _raise_first(result)
        return result

    async def retire(
        self, episode_ids: Sequence[RolloutIdentity], *, deadline_ts: float, checkpoint_id: str | None = None,
    ) -> StagedResult:
        checkpoint_id = checkpoint_id or _housekeeping_id("retire")
        result = StagedResult("retire", checkpoint_id)
        with self._span("retire", checkpoint_id):
            for batch in _batches([episode.to_json() for episode in episode_ids], RETIRE_BATCH):
                body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts, "episode_ids": batch}
                staged = await self._staged("retire", RETIRE_STAGES, body, deadline_ts)
                result.outcomes.extend(staged.outcomes)
        _raise_first(result)
        return result

    async def forget(
        self, rollout_ids: Sequence[str], *, deadline_ts: float, checkpoint_id: str | None = None,
    ) -> StagedResult:
        checkpoint_id = checkpoint_id or _housekeeping_id("forget")
        result = StagedResult("forget", checkpoint_id)
        with self._span("forget", checkpoint_id):
            for batch in _batches(list(rollout_ids), RETIRE_BATCH):
                body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts, "rollout_ids": batch}
                staged = await self._staged("forget", RETIRE_STAGES, body, deadline_ts)
                result.outcomes.extend(staged.outcomes)
        _raise_first(result)
        return result

    # ---- internals --------------------------------------------------------------------------

    async def _undo_restore(
        self, checkpoint_id: str, episode_ids: Sequence[RolloutIdentity], deadline_ts: float
    ) -> None:
        """Retire the next attempts everywhere, then resume everyone; failures here are logged."""
        deadline = max(deadline_ts, time.time() + CLEANUP_MIN_S)
        cleanup: list[Outcome] = []
        if episode_ids:
            next_attempts = [episode.next_attempt().to_json() for episode in episode_ids]
            body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline, "episode_ids": next_attempts}
            cleanup += (await self._staged("retire", RETIRE_STAGES, body, deadline)).outcomes
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline}
        cleanup += (await self._staged("resume", RESUME_STAGES, body, deadline)).outcomes
        for outcome in cleanup:
            if outcome.error is not None:
                logger.warning("restore clean-up on %s: %s", outcome.participant.name, outcome.error.detail)

    async def _staged(
        self, op: str, stages: tuple[tuple[str, ...], ...], body: dict[str, Any], deadline_ts: float
    ) -> StagedResult:
        result = StagedResult(op, body["checkpoint_id"])
        for stage in stages:
            result.outcomes.extend(await self._fan_out(await self._in(stage), op, body, deadline_ts))
        return result

    async def _in(self, kinds: tuple[str, ...]) -> list[ParticipantRef]:
        return [p for p in await self.participants() if p.kind in kinds]

    async def _fan_out(
        self, participants: list[ParticipantRef], op: str, body: dict[str, Any], deadline_ts: float
    ) -> list[Outcome]:
        encoded = EncodedJson(orjson.dumps(body))  # once, whatever the number of participants
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(self._call(p, op, encoded, deadline_ts)) for p in participants]
        return [_checked(task.result(), op, body["checkpoint_id"]) for task in tasks]

    async def _call(self, participant: ParticipantRef, op: str, body: EncodedJson, deadline_ts: float) -> Outcome:
        """One participant's outcome: never raises (but for cancellation), so it cancels no other call."""
        timeout_s = max(deadline_ts - time.time(), 0.0) + CALL_GRACE_S
        try:
            reply = await self.client.post_json(
                f"{participant.url}{CONTROL_PREFIX}/{op}", body, headers=self._headers, idempotent=True,
                timeout_s=timeout_s, rollout_prefix=False,
            )
        except GymError as error:
            return Outcome(participant, error=error)
        except Exception as error:  # noqa: BLE001 - one the client did not map (a bug): this participant's alone
            return Outcome(participant, error=_unexpected_failure(op, participant.name, error))
        if not isinstance(reply, dict):
            return Outcome(participant, error=UpstreamError(f"{op} reply is not a JSON object"))
        return Outcome(participant, reply=reply)

    def _span(self, op: str, checkpoint_id: str) -> Any:
        return self.telemetry.span(f"coordinate.{op}", **{ATTR.ID: checkpoint_id})


def _raise_first(result: StagedResult) -> None:
    failures = result.failures
    if failures:
        first = failures[0]
        assert first.error is not None
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        raise type(first.error)(f"{result.op} on {first.participant.name}: {first.error.detail}{more}",
                                result=result) from first.error


def _checked(outcome: Outcome, op: str, checkpoint_id: str) -> Outcome:
    """``outcome``, or the participant's ``UpstreamError`` when its reply is not of ``op``'s shape."""
    ref = outcome.participant
    if outcome.reply is None:
        return outcome
    problem = reply_problem(op, outcome.reply, ReplyContext(ref.kind, ref.instance, checkpoint_id))
    if problem is None:
        return outcome
    return Outcome(ref, error=UpstreamError(f"{op} reply of {ref.name}: {problem}"))


def _unexpected_failure(op: str, name: str, error: Exception) -> UpstreamError:
    logger.error("%s on %s failed with %s", op, name, type(error).__name__, exc_info=error)
    text = str(error)
    if len(text) > MAX_FAILURE_CHARS:
        text = f"{text[:MAX_FAILURE_CHARS]}... ({len(text)} characters)"
    return UpstreamError(f"{op} failed with {type(error).__name__}: {text}")


def _status_problem(reply: Any) -> str | None:
    """What keeps a ``/status`` reply from naming a participant, or ``None``."""
    if not (isinstance(reply, dict) and all(isinstance(reply.get(k), str) for k in ("kind", "instance"))):
        return "no string kind and instance"
    if reply["kind"] not in KINDS:
        return f"kind {reply['kind'][:64]!r} is none of {', '.join(KINDS)}"
    if not INSTANCE_NAME.fullmatch(reply["instance"]):
        return f"instance {reply['instance'][:64]!r} is not an instance name"
    return None


def _refuse_twins(participants: Sequence[ParticipantRef]) -> None:
    """Two servers answering as the same participant (kind and instance) would share its directory."""
    seen: dict[tuple[str, str], ParticipantRef] = {}
    for ref in participants:
        first = seen.setdefault((ref.kind, ref.instance), ref)
        if first is not ref:
            raise UpstreamError(f"discovery: {first.name} ({first.url}) and {ref.name} ({ref.url}) both answer "
                                f"as {ref.kind} {ref.instance!r}; each participant must be listed once")


def global_config_of(content: bytes) -> Any:
    """The global config a head's ``/global_config_dict_yaml`` reply holds (a JSON string of YAML)."""
    if len(content) > MAX_CONFIG_BYTES:
        raise UpstreamError(f"the head's {CONFIG_ROUTE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        text = orjson.loads(content)
        if not isinstance(text, str):
            raise UpstreamError(f"the head's {CONFIG_ROUTE} is not a JSON string")
        return load_yaml(text)
    except (orjson.JSONDecodeError, yaml.YAMLError, YamlRefused) as error:
        raise UpstreamError(f"the head's {CONFIG_ROUTE} is not a JSON string of YAML: {error}") from None


def servers_in_config(config: Any) -> list[dict[str, str]]:
    """``[{name, url}]`` of every entry of a global config shaped like a server instance: instance ->
    first key (its server type) -> first key (its implementation) -> settings with host and port."""
    if not isinstance(config, Mapping):
        raise UpstreamError(f"the head's {CONFIG_ROUTE} does not hold a mapping")
    servers = []
    for name, block in config.items():
        settings = _first_mapping(_first_mapping(block))
        url = _address(settings) if isinstance(settings, Mapping) else None
        if url is not None:
            servers.append({"name": str(name), "url": url})
    return servers


def _first_mapping(value: Any) -> Any:
    if not isinstance(value, Mapping) or not value:
        return None
    first = next(iter(value.values()))
    return first if isinstance(first, Mapping) else None


def _address(settings: Mapping[str, Any]) -> str | None:
    host, port = settings.get("host"), settings.get("port")
    if not isinstance(host, str) or not host or type(port) is not int or not 0 < port < 65536:
        return None
    return http_url(host, port)


def _batches(items: list[Any], size: int) -> list[list[Any]]:
    return [items[start : start + size] for start in range(0, len(items), size)]


def _housekeeping_id(op: str) -> str:
    return f"{op}-{int(time.time())}-{secrets.token_hex(4)}"
