"""A worker of a multi-worker server: admission that follows its coordinator (``worker_hub.py``).

Each worker process builds its app as usual; ``mount_checkpointing`` sees ``COORDINATOR_ENV`` and
mounts a ``FollowerParticipant`` instead of a ``Participant``: the worker's adapter keeps serving
its own episodes or sessions, but the checkpoint state machine is the coordinator's.

- Control calls received here are forwarded (``WorkerLink.forward``) and answered with the
  coordinator's reply; ``/status`` too.
- Admission follows the coordinator's ``gate`` notes: closed while a checkpoint is open there,
  with the same lease expiry. A request that arrives before the worker has registered waits for
  it (bounded by ``CONNECT_S``).
- A restore's records come in pages (``install``); they are held until the last page, which
  installs them all, so a restore that fails midway leaves the worker as fresh as before.
- A request naming an attempt that a restore installed claims it from the coordinator first
  (once per attempt and worker): the first worker keeps that state, every other drops its copy.
- A call this worker cannot get answered in time (no coordinator, or none within the deadline) is
  503 ``checkpoint_coordinator_unavailable``; once the channel to the coordinator ends, the
  requests parked here are woken and refused the same way, and the worker shuts down (``on_lost``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_gym_ckpt.checkpoint.adapter import BeforeExport, ExportItem, ParticipantAdapter, StopCommitted
from nemo_gym_ckpt.checkpoint.channel import Channel
from nemo_gym_ckpt.checkpoint.lease import Lease
from nemo_gym_ckpt.checkpoint.participant import Participant, _Open
from nemo_gym_ckpt.checkpoint.phases import Phase
from nemo_gym_ckpt.checkpoint.records import Record
from nemo_gym_ckpt.checkpoint.wire_scope import episodes_from_wire, item_to_wire, scope_from_wire
from nemo_gym_ckpt.checkpoint.worker_hub import CALL_TIMEOUT_S, PAGE_BYTES, PAGE_ITEM_BYTES, REPLY_GRACE_S
from nemo_gym_ckpt.errors import CoordinatorUnavailable, InvalidCheckpointState, InvalidPhase, NotFound
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["CONNECT_S", "FollowerParticipant", "WorkerLink", "connect_s"]

logger = logging.getLogger(__name__)
CONNECT_S = 30.0
_RETRY_S = 0.1


def connect_s() -> float:
    """How long a worker tries to reach its coordinator (``CONNECT_S``, read when used)."""
    return CONNECT_S


@dataclass
class _Receiving:
    """The records of an install's pages received so far."""

    pages: int = 0
    records: list[Record] = field(default_factory=list)


class FollowerParticipant(Participant):
    """A worker's participant: the coordinator decides, this one follows and serves the adapter."""

    link: WorkerLink

    def follow(self, gate: dict[str, Any]) -> None:
        """Take the coordinator's gate: its open checkpoint (or none), phase and lease expiry."""
        checkpoint_id, expires_at = gate.get("checkpoint_id"), gate.get("lease_expires_at")
        if checkpoint_id is None or not isinstance(expires_at, int | float):
            self._open, self.phase = None, Phase.IDLE
        else:
            if self._open is None or self._open.checkpoint_id != checkpoint_id:
                self._open = _Open(str(checkpoint_id), Lease(self.clock, self.lease_grace_s, float(expires_at)))
            self._open.lease.expires_at = float(expires_at)
            self.phase = Phase(gate.get("phase", Phase.PREPARING))
        if self.collector is not None:  # the worker's own collector is off while its coordinator's checkpoint is open
            (self.collector.release if self._open is None else self.collector.hold)(self)
        self.signal.notify()
        self.gate_signal.notify()

    def _expire_if_due(self) -> None:
        """The lease is the coordinator's: past its expiry admission reopens here as it does there."""
        if self._open is not None and self._open.lease.expired:
            self.follow({"checkpoint_id": None})

    def _check_admissible(self) -> None:
        """No coordinator, no admission: a request parked here is refused (503) once it is lost."""
        self.link._usable()

    def notify_changed(self) -> None:
        super().notify_changed()
        if self._open is not None:
            self.link.changed()

    async def close_elsewhere(self, identity: RolloutIdentity) -> None:
        await self.link.registered()
        await self.link.release(identity.rollout_id)

    async def admit(self, identity: RolloutIdentity | None, *, deadline_ts: float | None = None) -> None:
        await self.link.registered()
        await super().admit(identity, deadline_ts=deadline_ts)
        self.link.served()
        if identity is not None and identity in self.link.restored:
            await self.link.claim(identity)


class WorkerLink:
    """The worker's end of the channel to its coordinator, and what the coordinator asks of it."""

    def __init__(self, participant: FollowerParticipant, adapter: ParticipantAdapter, path: Path,
                 on_lost: Callable[[], None], *, pid: int | None = None) -> None:
        self.participant, self.adapter, self.path, self.on_lost = participant, adapter, path, on_lost
        self.pid = os.getpid() if pid is None else pid  # how the coordinator names this worker
        participant.link = self
        self.channel: Channel | None = None
        self.restored: set[RolloutIdentity] = set()
        self._registered = asyncio.Event()
        self._failed: str | None = None
        self._served_told = False
        self._changed_pending = False
        self._export: Any = None
        self._receiving: _Receiving | None = None  # the pages of an install, until its last
        self._task: asyncio.Task[None] | None = None

    # ---- connecting ---------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._connect_and_serve())

    async def aclose(self) -> None:
        if self.channel is not None:
            self.channel.on_closed = None  # a shutdown of our own is no lost coordinator
            self.channel.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _connect_and_serve(self) -> None:
        deadline = time.monotonic() + connect_s()
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(self.path))
                break
            except OSError as error:
                if time.monotonic() >= deadline:
                    self._failed = f"no coordinator at {self.path} within {connect_s():g} s ({error})"
                    logger.error("%s; shutting down", self._failed)
                    self._registered.set()
                    self.on_lost()
                    return
                await asyncio.sleep(_RETRY_S)
        self.channel = Channel(reader, writer, name=f"worker {self.pid}", on_call=self._on_call,
                               on_note=self._on_note, on_closed=self._lost)
        serving = asyncio.create_task(self.channel.serve())
        try:
            reply = await self.channel.call("register", {"pid": self.pid}, CALL_TIMEOUT_S)
            self.participant.follow(reply["gate"])
        except CoordinatorUnavailable as error:
            self._failed = error.detail
        self._registered.set()
        await serving

    def _lost(self) -> None:
        self._failed = "the coordinator is gone"
        logger.error("worker %d: its coordinator is gone; shutting down", self.pid)
        self.participant.gate_signal.notify()  # the parked requests wake, and are refused
        self.on_lost()

    async def registered(self) -> None:
        """Wait until registered (at most ``CONNECT_S``); 503 when that cannot happen."""
        if not self._registered.is_set():
            try:
                async with asyncio.timeout(connect_s()):
                    await self._registered.wait()
            except TimeoutError:
                raise CoordinatorUnavailable(f"not registered with the coordinator within {connect_s():g} s") from None
        self._usable()

    def _usable(self) -> Channel:
        if self._failed is not None or self.channel is None or self.channel.closed:
            raise CoordinatorUnavailable(f"this worker has lost its coordinator: {self._failed or 'not connected'}")
        return self.channel

    # ---- worker -> coordinator ----------------------------------------------------------------

    async def forward(self, operation: str, request: dict[str, Any] | None) -> dict[str, Any]:
        """Run a control call on the coordinator's participant (``request`` is ``None`` for status)."""
        await self.registered()
        channel = self._usable()
        if request is None:
            return await channel.call("status", {}, CALL_TIMEOUT_S)
        deadline_ts = request.get("deadline_ts")
        left = deadline_ts - self.participant.clock.now() if isinstance(deadline_ts, int | float) else 0.0
        timeout = min(max(left, 0.0), self.participant.max_deadline_s) + REPLY_GRACE_S
        return await channel.call("control", {"operation": operation, "request": request}, timeout)

    async def claim(self, identity: RolloutIdentity) -> None:
        reply = await self._usable().call("claim", {"episode": identity.to_json()}, CALL_TIMEOUT_S)
        self.restored.discard(identity)
        if reply.get("owner") == "another":
            await self.adapter.forget([identity.rollout_id])

    async def release(self, rollout_id: str) -> None:
        """Have the other workers drop what they hold of ``rollout_id`` (a close landed here)."""
        await self._usable().call("release", {"rollout_id": rollout_id}, CALL_TIMEOUT_S)

    def served(self) -> None:
        if not self._served_told and self.channel is not None and not self.channel.closed:
            self._served_told = True
            self.channel.note("served", {})

    def changed(self) -> None:
        """Tell the coordinator readiness may have changed (one note per turn of the loop)."""
        if self._changed_pending or self.channel is None or self.channel.closed:
            return
        self._changed_pending = True
        asyncio.get_running_loop().call_soon(self._send_changed)

    def _send_changed(self) -> None:
        self._changed_pending = False
        if self.channel is not None and not self.channel.closed:
            self.channel.note("changed", {})

    # ---- coordinator -> worker ----------------------------------------------------------------

    def _on_note(self, kind: str, body: dict[str, Any]) -> None:
        if kind == "install_abort":  # the restore failed elsewhere: the pages held here are dropped
            self._receiving = None
            return
        if kind != "gate":
            raise InvalidCheckpointState(f"no coordinator note named {kind!r}")
        self.participant.follow(body)

    async def _on_call(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        adapter, participant = self.adapter, self.participant
        if kind == "readiness":
            readiness = await adapter.readiness()
            return {"blockers": list(readiness.blockers), "counts": dict(readiness.counts),
                    "restarts": list(readiness.restarts)}
        if kind == "export":
            return await self._export_page(body)
        if kind == "committed":
            return dict(await adapter.committed(scope_from_wire(body.get("scope"))))
        if kind == "stop_committed":
            if isinstance(adapter, StopCommitted):
                await adapter.stop_committed(scope_from_wire(body.get("scope")))
            return {}
        if kind == "install":
            return await self._install(body)
        if kind == "retire":
            episodes = episodes_from_wire(body.get("episodes"))
            participant.marks.retire(episodes)
            participant.signal.notify()
            participant.gate_signal.notify()
            self.restored.difference_update({e for e in self.restored if e.rollout_id in
                                             {episode.rollout_id for episode in episodes}})
            await adapter.retire(episodes)
            return {}
        if kind in ("forget", "drop_rollout"):
            rollout_ids = [str(rollout) for rollout in body.get("rollout_ids") or []]
            if kind == "forget":
                participant.marks.forget(rollout_ids)
            self.restored.difference_update({e for e in self.restored if e.rollout_id in set(rollout_ids)})
            await adapter.forget(rollout_ids)
            return {}
        if kind == "extras":
            waiting = participant.status()["waiting_requests"]
            return {"extras": dict(adapter.status_extras()), "waiting_requests": waiting}
        raise NotFound(f"no coordinator call named {kind!r}")

    async def _install(self, body: dict[str, Any]) -> dict[str, Any]:
        """One page of a restore's records; the last installs them all, nothing is installed before."""
        records = self._install_page(body)
        if body.get("done") is not True:
            return {}
        self._check_fresh()
        scope = scope_from_wire(body.get("scope")) or frozenset()
        await self.adapter.install(records, scope)
        self.participant._installed = True
        self.restored = {record.episode.next_attempt() for record in records}
        return {}

    def _install_page(self, body: dict[str, Any]) -> list[Record]:
        """The records of the install's pages so far, this one's added. Page 0 begins an install; a
        page out of turn or unparsable is refused and drops what the install held."""
        number = body.get("page")
        if number == 0:
            self._check_fresh()
            self._receiving = _Receiving()
        receiving, self._receiving = self._receiving, None  # taken: a refusal below leaves nothing held
        if receiving is None or type(number) is not int or number != receiving.pages:
            raise InvalidCheckpointState(f"install page {number!r} came out of turn on worker {self.pid}")
        receiving.records.extend(Record.from_raw(str(raw).encode()) for raw in body.get("records") or [])
        receiving.pages += 1
        if body.get("done") is not True:
            self._receiving = receiving
        return receiving.records

    def _check_fresh(self) -> None:
        if not self.participant.fresh:
            raise InvalidPhase("restore expected fresh workers (no rollout traffic, nothing restored), "
                               f"got worker {self.pid} that is not")

    async def _export_page(self, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("first"):
            if isinstance(self.adapter, BeforeExport):
                raise InvalidPhase("a multi-worker server cannot cut generations")
            self._export = self.adapter.export(scope_from_wire(body.get("scope"))).__aiter__()
        if self._export is None:
            raise InvalidPhase("no export is running on this worker")
        items: list[dict[str, Any]] = []
        size = 0
        while size < PAGE_BYTES:
            try:
                item: ExportItem = await self._export.__anext__()
            except StopAsyncIteration:
                self._export = None
                return {"items": items, "done": True}
            wire = item_to_wire(item)
            size += len(wire.get("raw", "")) + PAGE_ITEM_BYTES
            items.append(wire)
        return {"items": items, "done": False}
