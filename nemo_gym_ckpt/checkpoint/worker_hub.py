"""The coordinator of a multi-worker server: one participant for all its worker processes.

A server with ``num_workers: N`` (N > 1) runs N worker processes behind one port and, in its main
process, one ``WorkerHub``. The hub owns the server's only ``Participant`` (one phase, one lease,
one fence list, one manifest per server) over a ``WorkerFanout`` adapter, and serves a Unix socket
(mode 600, in a private runtime directory; ``COORDINATOR_ENV`` names it to the workers). Every
worker registers there (``checkpoint/follower.py``); the control calls any worker receives are
forwarded here and run on the one participant.

What it does for the participant (docs/protocol.md section 13):

- the gate: whenever the open checkpoint, the phase or the lease changes, a ``gate`` note goes to
  every worker at once, before anything else the hub sends them, so a worker's admission closes
  before its readiness is asked for;
- prepare: readiness is the merge of every worker's (blockers joined, counts summed, restarts
  joined); while fewer workers than expected are registered a ``<kind>-workers-unregistered:<n>``
  blocker holds it, and a worker lost while the checkpoint is open blocks it with
  ``<kind>-worker-lost`` until the checkpoint closes;
- commit: every worker exports (in pages of at most ``PAGE_BYTES``; all start at once, their pages
  are read worker after worker); records installed on every worker by a restore and still untouched
  come back once; one records file, one manifest, written here;
- restore: every worker gets the records in pages bounded as an export's (all workers one page at a
  time; at most a page per worker is in flight) and checks and installs them with the last page
  (all or nothing on each); a failed restore has the workers drop the pages they hold
  (``install_abort``). The first worker whose request names a restored attempt claims it
  (``claim``), and the others drop their copy of that rollout, so its state lives in one worker
  from then on;
- retire and forget go to every worker (their retire marks included).

Every call to a worker has a deadline: ``CALL_TIMEOUT_S``, or the control call's own deadline plus
``REPLY_GRACE_S``. The readiness asked for by a prepare or a commit is bounded by that operation's
``deadline_ts`` too (plus ``READINESS_GRACE_S``): a worker that has not answered by then is a
``<kind>-workers-unanswered:<n>`` blocker, so a prepare answers by its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_gym_ckpt.checkpoint.adapter import ExportItem, Readiness
from nemo_gym_ckpt.checkpoint.channel import Channel
from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK
from nemo_gym_ckpt.checkpoint.models import (
    CommitRequest,
    ControlRequest,
    ForgetRequest,
    RestoreRequest,
    RetireRequest,
    parse_object,
)
from nemo_gym_ckpt.checkpoint.participant import Participant
from nemo_gym_ckpt.checkpoint.records import Record, Scope
from nemo_gym_ckpt.checkpoint.store import CheckpointStore
from nemo_gym_ckpt.checkpoint.wire_scope import episodes_from_wire, episodes_to_wire, item_from_wire, scope_to_wire
from nemo_gym_ckpt.config import CheckpointConfig
from nemo_gym_ckpt.errors import (
    CoordinatorUnavailable,
    GymError,
    InvalidCheckpointState,
    InvalidPhase,
    InvalidRequest,
    NotFound,
)
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["CALL_TIMEOUT_S", "COORDINATOR_ENV", "PAGE_BYTES", "PAGE_ITEM_BYTES", "READINESS_GRACE_S", "REPLY_GRACE_S",
           "HubParticipant", "WorkerFanout", "WorkerHub", "start_coordinator"]

logger = logging.getLogger(__name__)
COORDINATOR_ENV = "NEMO_GYM_CKPT_COORDINATOR_SOCKET"
CALL_TIMEOUT_S = 30.0
REPLY_GRACE_S = 10.0
READINESS_GRACE_S = 0.25  # how late past its deadline a prepare may answer, waiting on a worker's readiness
PAGE_BYTES = 4 * 1024 * 1024  # the records of one export or install page (about: one record over it is a page alone)
PAGE_ITEM_BYTES = 256  # what a page counts for each item besides its record's bytes
_CONTROL: dict[str, type[ControlRequest]] = {
    "prepare": ControlRequest, "renew": ControlRequest, "commit": CommitRequest, "restore": RestoreRequest,
    "resume": ControlRequest, "retire": RetireRequest, "forget": ForgetRequest,
}
_DEADLINE: ContextVar[float | None] = ContextVar("worker_hub_deadline", default=None)  # the running operation's


@dataclass
class _Worker:
    pid: int
    channel: Channel


@dataclass
class _Claims:
    """Restored attempts: which worker (pid) claimed each, ``None`` while unclaimed (until the other
    workers all dropped their copies: a claim whose drops failed is asked again)."""

    owners: dict[RolloutIdentity, int | None] = field(default_factory=dict)
    claiming: dict[RolloutIdentity, asyncio.Lock] = field(default_factory=dict)  # one claim at a time each

    def lock(self, episode: RolloutIdentity) -> asyncio.Lock:
        return self.claiming.setdefault(episode, asyncio.Lock())

    def claimed(self, episode: RolloutIdentity, pid: int) -> None:
        if episode in self.owners:
            self.owners[episode] = pid
        self.claiming.pop(episode, None)  # later claims see the owner without waiting

    def drop(self, rollout_ids: set[str]) -> None:
        for episode in [episode for episode in self.owners if episode.rollout_id in rollout_ids]:
            del self.owners[episode]
            self.claiming.pop(episode, None)

    def keep(self, rollout_ids: set[str]) -> None:
        for episode in [episode for episode in self.owners if episode.rollout_id not in rollout_ids]:
            del self.owners[episode]
            self.claiming.pop(episode, None)


class WorkerHub:
    """The registry of a server's workers and the socket they reach it on."""

    def __init__(self, kind: str, expected_workers: int) -> None:
        if expected_workers < 2:
            raise ValueError("a hub is for servers of at least 2 workers")
        self.kind, self.expected_workers = kind, expected_workers
        self.workers: dict[int, _Worker] = {}
        self.lost_while_open = 0
        self.served: set[int] = set()  # the workers that served rollout traffic
        self.claims = _Claims()
        self.participant: Participant | None = None
        self._server: asyncio.Server | None = None
        self._serving: set[asyncio.Task[None]] = set()

    def attach(self, participant: Participant) -> None:
        """Serve ``participant`` (built over ``WorkerFanout(self)``) to the workers."""
        self.participant = participant
        participant.watch_gate(self._send_gate)

    async def start(self, path: Path) -> None:
        """Listen on the Unix socket ``path`` (only its owner may connect)."""
        self._server = await asyncio.start_unix_server(self._accept, path=str(path))
        os.chmod(path, 0o600)

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for worker in list(self.workers.values()):
            worker.channel.close()
        for task in list(self._serving):
            task.cancel()
        await asyncio.gather(*self._serving, return_exceptions=True)
        if self.participant is not None:
            await self.participant.aclose()

    # ---- the channel of one worker ------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._serving.add(task)
        holder: dict[str, int] = {}
        channel = Channel(reader, writer, name=f"{self.kind} coordinator",
                          on_call=lambda kind, body: self._on_call(holder, channel, kind, body),
                          on_note=lambda kind, body: self._on_note(holder.get("pid"), kind, body))
        try:
            await channel.serve()
        finally:
            self._serving.discard(task)
            pid = holder.get("pid")
            if pid is not None and self.workers.get(pid) is not None and self.workers[pid].channel is channel:
                del self.workers[pid]
                logger.warning("%s worker %d left its coordinator", self.kind, pid)
                if self.participant is not None and self.participant.checkpoint_id is not None:
                    self.lost_while_open += 1
                    self.participant.notify_changed()

    async def _on_call(
        self, holder: dict[str, int], channel: Channel, kind: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        participant = self.participant
        assert participant is not None
        if kind == "register":
            return self._register(holder, channel, body)
        if "pid" not in holder:
            raise InvalidRequest("a worker must register first")
        if kind == "control":
            return await self._control(participant, body)
        if kind == "status":
            return await self._status(participant)
        if kind == "claim":
            return await self._claim(holder["pid"], body)
        if kind == "release":
            rollout_id = body.get("rollout_id")
            if not isinstance(rollout_id, str):
                raise InvalidRequest("release needs a rollout_id")
            await self._drop_elsewhere(holder["pid"], rollout_id)
            return {}
        raise NotFound(f"no worker call named {kind!r}")

    def _on_note(self, pid: int | None, kind: str, body: dict[str, Any]) -> None:
        participant = self.participant
        assert participant is not None
        if kind == "changed":
            participant.notify_changed()
        elif kind == "served" and pid is not None:
            self.served.add(pid)
            participant.mark_served()
        else:
            raise InvalidCheckpointState(f"no worker note named {kind!r}")

    def _register(self, holder: dict[str, int], channel: Channel, body: dict[str, Any]) -> dict[str, Any]:
        pid = body.get("pid")
        if type(pid) is not int or pid <= 0:
            raise InvalidRequest("register needs the worker's pid")
        if "pid" in holder:  # one entry per channel: a second would outlive the channel
            raise InvalidRequest(f"this channel is registered already, as worker {holder['pid']}")
        holder["pid"] = pid
        self.workers[pid] = _Worker(pid, channel)
        assert self.participant is not None
        self.participant.notify_changed()
        return {"gate": self.participant.gate()}

    async def _control(self, participant: Participant, body: dict[str, Any]) -> dict[str, Any]:
        operation, request = body.get("operation"), body.get("request")
        model = _CONTROL.get(operation) if isinstance(operation, str) else None
        if model is None or not isinstance(request, dict):
            raise InvalidRequest("control needs an operation and its request")
        parsed = parse_object(model, request)
        result: dict[str, Any] = await getattr(participant, str(operation))(parsed)
        return result

    async def _status(self, participant: Participant) -> dict[str, Any]:
        """The participant's status, with the workers' extras merged and their waiting requests summed."""
        status = participant.status()
        replies = [_checked(reply, "extras", _EXTRAS) for reply in await self.broadcast("extras", {}, CALL_TIMEOUT_S)]
        status["waiting_requests"] = sum(reply["waiting_requests"] for reply in replies)
        status["extras"] = self._merged_extras([reply["extras"] for reply in replies])
        return status

    def _merged_extras(self, replies: list[dict[str, Any]]) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for reply in replies:
            for key, value in reply.items():
                if isinstance(value, int) and not isinstance(value, bool) and isinstance(merged.get(key), int):
                    merged[key] += value
                else:
                    merged.setdefault(key, value)
        merged["workers"] = len(self.workers)
        merged["expected_workers"] = self.expected_workers
        merged["workers_served"] = len(self.served & set(self.workers))
        merged["restored_unclaimed"] = sum(owner is None for owner in self.claims.owners.values())
        return merged

    async def _claim(self, pid: int, body: dict[str, Any]) -> dict[str, Any]:
        episode = episodes_from_wire([body.get("episode")])[0]
        if episode not in self.claims.owners:
            return {"owner": "none"}
        if self.claims.owners[episode] is None:
            async with self.claims.lock(episode):
                if self.claims.owners.get(episode, pid) is None:  # unclaimed still, not retired meanwhile
                    await self._drop_elsewhere(pid, episode.rollout_id)  # the owner once every drop succeeded
                    self.claims.claimed(episode, pid)
        if episode not in self.claims.owners:
            return {"owner": "none"}
        return {"owner": "this" if self.claims.owners[episode] == pid else "another"}

    async def _drop_elsewhere(self, pid: int, rollout_id: str) -> None:
        """Every worker but ``pid`` drops what it holds of ``rollout_id`` (its retire marks stay)."""
        others = [worker for worker in self.workers.values() if worker.pid != pid]
        drop = {"rollout_ids": [rollout_id]}
        await asyncio.gather(*(worker.channel.call("drop_rollout", drop, CALL_TIMEOUT_S) for worker in others))

    def _send_gate(self) -> None:
        assert self.participant is not None
        gate = self.participant.gate()
        if gate["checkpoint_id"] is None:
            self.lost_while_open = 0
        for worker in list(self.workers.values()):
            with contextlib.suppress(GymError):
                worker.channel.note("gate", gate)

    def blockers(self) -> list[str]:
        """What holds a checkpoint besides the workers' own blockers: workers not registered yet, or
        one lost while the checkpoint is open."""
        blockers: list[str] = []
        missing = self.expected_workers - len(self.workers)
        if missing > 0:
            blockers.append(f"{self.kind}-workers-unregistered:{missing}")
        if self.lost_while_open:
            blockers.append(f"{self.kind}-worker-lost")
        return blockers

    # ---- calls to every worker ----------------------------------------------------------------

    async def broadcast(self, kind: str, body: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        """The same call to every registered worker; the first failure is raised."""
        workers = list(self.workers.values())
        return list(await asyncio.gather(*(worker.channel.call(kind, body, timeout_s) for worker in workers)))


class WorkerFanout:
    """The ``ParticipantAdapter`` of a hub's participant: every method asks every worker."""

    def __init__(self, hub: WorkerHub, clock_now: Any) -> None:
        self.hub, self._now = hub, clock_now

    def _readiness_timeout(self) -> float:
        """``CALL_TIMEOUT_S``, and no later than the running prepare's or commit's deadline (plus grace)."""
        deadline_ts = _DEADLINE.get()
        if deadline_ts is None:
            return CALL_TIMEOUT_S
        return min(CALL_TIMEOUT_S, max(deadline_ts - self._now(), 0.0) + READINESS_GRACE_S)

    async def readiness(self) -> Readiness:
        hub = self.hub
        replies, unanswered = await self._readiness_replies()
        blockers = hub.blockers()  # after the replies: a worker lost while answering counts
        if unanswered:
            blockers.append(f"{hub.kind}-workers-unanswered:{unanswered}")
        counts: dict[str, int] = {}
        restarts: list[str] = []
        for reply in replies:
            blockers.extend(reply["blockers"])
            restarts.extend(reply["restarts"])
            for key, value in reply["counts"].items():
                counts[key] = counts.get(key, 0) + value
        return Readiness(blockers=blockers, counts=counts, restarts=restarts)

    async def _readiness_replies(self) -> tuple[list[dict[str, Any]], int]:
        """The replies of the workers that answered in time, and how many others did not (lost ones
        left out: ``hub.blockers()`` names them); a worker's own error is raised."""
        workers, timeout = list(self.hub.workers.values()), self._readiness_timeout()
        calls = (worker.channel.call("readiness", {}, timeout) for worker in workers)
        replies: list[dict[str, Any]] = []
        unanswered = 0
        for worker, reply in zip(workers, await asyncio.gather(*calls, return_exceptions=True), strict=True):
            if isinstance(reply, CoordinatorUnavailable):
                unanswered += not worker.channel.closed
            elif isinstance(reply, BaseException):
                raise reply
            else:
                replies.append(_checked(reply, f"worker {worker.pid}'s readiness", _READINESS))
        return replies, unanswered

    async def export(self, scope: Scope | None) -> AsyncIterator[ExportItem]:
        """Every worker's records, worker after worker. All workers start their export at once (they
        are processes of their own: their captures run side by side), and their first pages wait
        here; the later pages of each are asked for in turn. At most a page per worker is held."""
        seen: set[bytes] = set()  # a restored record every worker still holds, untouched, comes once
        if blockers := self.hub.blockers():  # a worker lost since the readiness: its records would be missing
            raise InvalidPhase(f"commit expected every worker, got {', '.join(blockers)}")
        workers = list(self.hub.workers.values())
        first = {"scope": scope_to_wire(scope), "first": True}
        firsts = [asyncio.ensure_future(worker.channel.call("export", first, CALL_TIMEOUT_S)) for worker in workers]
        try:
            for worker, first_page in zip(workers, firsts, strict=True):
                page = await _page_of(worker, first_page)
                while True:
                    for value in page["items"]:
                        item = item_from_wire(value)
                        if isinstance(item, Record):
                            if item.raw in seen:
                                continue
                            seen.add(item.raw)
                        yield item
                    if page["done"]:
                        break
                    page = await _page_of(worker, worker.channel.call("export", {"first": False}, CALL_TIMEOUT_S))
        finally:
            for pending in firsts:
                pending.cancel()
            await asyncio.gather(*firsts, return_exceptions=True)  # nothing left unretrieved

    async def committed(self, scope: Scope | None) -> Mapping[str, Any]:
        replies = await self.hub.broadcast("committed", {"scope": scope_to_wire(scope)}, CALL_TIMEOUT_S)
        if scope is not None:
            self.hub.claims.keep({episode.rollout_id for episode in scope})
        merged: dict[str, Any] = {}
        for reply in replies:
            merged.update(reply)
        return merged

    async def stop_committed(self, scope: Scope | None) -> None:
        await self.hub.broadcast("stop_committed", {"scope": scope_to_wire(scope)}, CALL_TIMEOUT_S)

    async def install(self, records: Sequence[Record], scope: Scope) -> None:
        """Every worker gets the records in pages of about ``PAGE_BYTES`` (all workers one page at a
        time, each page decoded once) and installs them with the last: all or nothing on each."""
        hub = self.hub
        if len(hub.workers) < hub.expected_workers:
            raise InvalidCheckpointState(f"restore needs all {hub.expected_workers} workers registered, "
                                         f"got {len(hub.workers)}")
        workers = list(hub.workers.values())
        try:
            for number, (page, done) in enumerate(_install_pages(records)):
                body: dict[str, Any] = {"page": number, "records": page, "done": done}
                if done:
                    body["scope"] = scope_to_wire(scope)
                await _install_page(workers, body, CALL_TIMEOUT_S + (len(records) / 1000 if done else 0))
        except BaseException:
            for worker in workers:  # the pages they hold are of no use now (cancelled too)
                with contextlib.suppress(GymError):
                    worker.channel.note("install_abort", {})
            raise
        hub.claims = _Claims({record.episode.next_attempt(): None for record in records})

    async def retire(self, episodes: Sequence[RolloutIdentity]) -> None:
        self.hub.claims.drop({episode.rollout_id for episode in episodes})
        await self.hub.broadcast("retire", {"episodes": episodes_to_wire(episodes)}, CALL_TIMEOUT_S)

    async def forget(self, rollout_ids: Sequence[str]) -> None:
        self.hub.claims.drop(set(rollout_ids))
        await self.hub.broadcast("forget", {"rollout_ids": list(rollout_ids)}, CALL_TIMEOUT_S)

    def status_extras(self) -> Mapping[str, Any]:
        return {"workers": len(self.hub.workers), "expected_workers": self.hub.expected_workers}


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(each, str) for each in value)


def _counts(value: Any) -> bool:
    return isinstance(value, dict) and all(type(each) is int for each in value.values())


_READINESS: dict[str, Callable[[Any], bool]] = {"blockers": _strings, "restarts": _strings, "counts": _counts}
_EXTRAS: dict[str, Callable[[Any], bool]] = {
    "extras": lambda value: isinstance(value, dict), "waiting_requests": lambda value: type(value) is int}
_PAGE: dict[str, Callable[[Any], bool]] = {
    "items": lambda value: isinstance(value, list), "done": lambda value: isinstance(value, bool)}


def _checked(reply: dict[str, Any], what: str, shape: Mapping[str, Callable[[Any], bool]]) -> dict[str, Any]:
    """``reply`` when each field of ``shape`` fits; a worker that answers otherwise is misbehaving:
    ``InvalidCheckpointState`` (422, as for a frame it breaks), never a 500."""
    if bad := [key for key, fits in shape.items() if not fits(reply.get(key))]:
        raise InvalidCheckpointState(f"{what} reply has no usable {', '.join(bad)}")
    return reply


class HubParticipant(Participant):
    """The hub's participant: a prepare's or a commit's ``deadline_ts`` bounds the readiness its
    adapter (a ``WorkerFanout``) asks the workers for."""

    async def prepare(self, request: ControlRequest) -> dict[str, Any]:
        return await _within(request.deadline_ts, super().prepare(request))

    async def commit(self, request: CommitRequest) -> dict[str, Any]:
        return await _within(request.deadline_ts, super().commit(request))


async def _within(deadline_ts: float, work: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """``work`` run with ``deadline_ts`` as the running operation's (tasks it starts take it along)."""
    token = _DEADLINE.set(deadline_ts)
    try:
        return await work
    finally:
        _DEADLINE.reset(token)


async def _reply_of(worker: _Worker, pending: Awaitable[dict[str, Any]], operation: str, step: str) -> dict[str, Any]:
    """The reply of ``worker``; a worker lost before it answers fails ``operation`` (409 ``invalid_phase``)."""
    try:
        return await pending
    except CoordinatorUnavailable as error:
        if not worker.channel.closed:
            raise
        raise InvalidPhase(f"{operation} lost worker {worker.pid} during its {step}: {error.detail}") from None


async def _page_of(worker: _Worker, pending: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """An export page of ``worker``; a worker lost before its last page fails the commit."""
    return _checked(await _reply_of(worker, pending, "commit", "export"), f"worker {worker.pid}'s export page", _PAGE)


def _install_pages(records: Sequence[Record]) -> Iterator[tuple[list[str], bool]]:
    """``records`` in pages bounded as an export's (a record over ``PAGE_BYTES`` alone on its page),
    each with whether it is the last; no records is one empty page."""
    page: list[str] = []
    size = 0
    for record in records:
        cost = len(record.raw) + PAGE_ITEM_BYTES
        if page and size + cost > PAGE_BYTES:
            yield page, False
            page, size = [], 0
        page.append(record.raw.decode())
        size += cost
    yield page, True


async def _install_page(workers: Sequence[_Worker], body: dict[str, Any], timeout_s: float) -> None:
    """One install page to every worker at once; once all answered, the first failure is raised (a
    worker lost meanwhile fails the restore)."""
    calls = (_reply_of(worker, worker.channel.call("install", body, timeout_s), "restore", "install")
             for worker in workers)
    for reply in await asyncio.gather(*calls, return_exceptions=True):
        if isinstance(reply, BaseException):
            raise reply


async def start_coordinator(
    *, kind: str, instance: str, config: CheckpointConfig, path: Path, expected_workers: int
) -> WorkerHub:
    """The hub of a multi-worker server, its participant built from the mesh's ``checkpoint`` block
    (a ``CheckpointConfig``), listening on ``path``."""
    hub = WorkerHub(kind, expected_workers)
    participant = HubParticipant(
        kind=kind,
        instance=instance,
        adapter=WorkerFanout(hub, SYSTEM_CLOCK.now),
        store=CheckpointStore(config.root, None, max_record_bytes=config.max_record_bytes),
        lease_grace_s=config.lease_grace_seconds,
        clock=SYSTEM_CLOCK,
        max_deadline_s=config.max_deadline_seconds,
    )
    hub.attach(participant)
    await hub.start(path)
    return hub
