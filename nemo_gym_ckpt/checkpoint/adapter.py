"""What a server kind implements to be a checkpoint participant: ``ParticipantAdapter``.

The participant (phases, fencing, lease, admission, files) is generic; everything that knows what
an episode or a session is lives in the adapter. The contract of each method:

- ``readiness()``: a snapshot. Ready when nothing blocks: every live episode is parked at a
  boundary, inside a replay step, or a restart. Called while admission is closed; cheap.
- ``export(scope)``: stream one record per exported episode or session (``None`` = everything
  continuable). Each record is a JSON object with ``episode_id: {rollout_id, attempt}``, or a
  ``Record`` read at restore and not changed since (exported again byte for byte). Never a restart,
  never token arrays. Runs while admission is closed; cancelled if the checkpoint is resumed.
- ``committed(scope)``: the records and manifest are durable. Drop restored state that ``scope``
  left out; return extra fields for the commit reply (the model adds ``staging_keys``).
- ``install(records, scope)``: all or nothing. Check the records (task digests, lineage, a fresh
  process) and install each under the next attempt (``record.episode.next_attempt()``); on any
  problem raise ``InvalidCheckpointState`` with nothing installed.
- ``retire(episodes)``: stop those attempts (and earlier ones of the same rollouts), wait for their
  work to end, free their state. The participant has already fenced them.
- ``forget(rollout_ids)``: drop whatever is left of those rollouts (the fences are dropped by the
  participant).
- ``status_extras()``: kind-specific fields for ``GET /status`` (counts, declarations).

Optional (``BeforeExport``): ``before_export(checkpoint_id, scope, deadline_ts)`` runs once per
commit, after the readiness check and before ``export``, with the commit's deadline; the model uses
it to cut the generations in flight within half of the time left. It must not fail the commit for
work it can do without (a failed generation cut is only logged).

Optional (``PauseWindow``): ``paused(checkpoint_id, until_ts)`` runs once when a prepare finds the
participant ready (its work parked until the resume; ``until_ts``, the lease's expiry, bounds the
pause), and ``resumed(checkpoint_id)`` when the checkpoint closes (resume, abort, lease expiry,
after a restore too, so possibly without a ``paused`` before it). Both are synchronous and must not
block or raise: the model uses them to hold its worker's generation (``generation_hold``).

Optional (``ExportAtOnce``): ``export_at_once(scope)`` gives what ``export`` would stream, in one
list, synchronously, when every record is at hand as a ``Record`` (encoded when its episode moved);
``None`` when it cannot (then ``export`` runs). A commit of thousands of episodes then costs one loop
in the adapter and no step of an async generator per record (docs/protocol.md section 6).

Optional (``StopCommitted``): ``stop_committed(scope)`` runs after ``committed`` of a commit sent
with ``stop: true`` (the controller stops the mesh next): free what the records do not hold
(sandboxes, child processes, connections). Bounded by the commit's deadline; a failure is logged
and the commit still succeeds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from nemo_gym_ckpt.checkpoint.records import Record, Scope
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["MAX_BLOCKERS", "BeforeExport", "ExportAtOnce", "ExportItem", "ParticipantAdapter", "PauseWindow",
           "Readiness", "StopCommitted"]

MAX_BLOCKERS = 100
ExportItem = Record | Mapping[str, Any]


@dataclass(frozen=True)
class Readiness:
    """What a prepare waits on: ready when there are no blockers (derived, never stored)."""

    blockers: Sequence[str] = ()
    counts: Mapping[str, int] = field(default_factory=dict)
    restarts: Sequence[str] = ()

    @property
    def ready(self) -> bool:
        return not self.blockers

    def report(self) -> dict[str, Any]:
        """The wire report: at most 100 blockers listed, every restart listed."""
        return {
            "ready": self.ready,
            "blockers": list(self.blockers[:MAX_BLOCKERS]),
            "blocker_count": len(self.blockers),
            "counts": dict(self.counts),
            "restarts": list(self.restarts),
        }


class ParticipantAdapter(Protocol):
    async def readiness(self) -> Readiness: ...

    def export(self, scope: Scope | None) -> AsyncIterator[ExportItem]: ...

    async def committed(self, scope: Scope | None) -> Mapping[str, Any]: ...

    async def install(self, records: Sequence[Record], scope: Scope) -> None: ...

    async def retire(self, episodes: Sequence[RolloutIdentity]) -> None: ...

    async def forget(self, rollout_ids: Sequence[str]) -> None: ...

    def status_extras(self) -> Mapping[str, Any]: ...


@runtime_checkable
class BeforeExport(Protocol):
    """An adapter that works once per commit before its export, knowing the commit's deadline."""

    async def before_export(self, checkpoint_id: str, scope: Scope | None, deadline_ts: float) -> None: ...


@runtime_checkable
class ExportAtOnce(Protocol):
    """An adapter that can hand over its export as one list of ``Record``s (``None``: it cannot now)."""

    def export_at_once(self, scope: Scope | None) -> list[Record] | None: ...


@runtime_checkable
class PauseWindow(Protocol):
    """An adapter told when its participant is ready inside a checkpoint, and when it resumes."""

    def paused(self, checkpoint_id: str, until_ts: float) -> None: ...

    def resumed(self, checkpoint_id: str) -> None: ...


@runtime_checkable
class StopCommitted(Protocol):
    """An adapter that frees what its records do not hold once a ``stop`` commit is durable."""

    async def stop_committed(self, scope: Scope | None) -> None: ...
