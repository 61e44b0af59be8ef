"""The collector as the checkpoint controller of its mesh (docs/protocol.md sections 5 and 6).

``CollectionControl`` drives a ``Coordinator`` for one collection whose files live in the
checkpoint directory (``collection_checkpoint``). The collector calls it:

- ``begin(left)`` once, before dispatching, with the rollout ids not yet in the output: restore the
  latest published checkpoint (refused if another config or input took it) with the continued
  rollouts still left as the scope, on a mesh of fresh processes; fence by ``retire`` every other
  attempt the dispatch log names for a rollout still left; resume (also when the fencing failed:
  then logged, and ``begin`` raises the fencing's error). Answers what to dispatch: the
  continued rollouts as attempt N+1 first, then every other rollout as the attempt after the
  highest it was ever dispatched as (0 if never). A mesh that is not fresh refuses the restore
  (``invalid_phase``): the coordinator undoes it, and those rollouts start over too. A checkpoint
  whose files do not read (``preflight``) is refused before its restore is sent, with the mesh
  untouched, and the older published checkpoints are tried in turn; one the participants refuse
  (``invalid_checkpoint_state``) is undone, and its rollouts start over.
- ``dispatching(identity)`` before each ``/run``: one line of ``dispatched.jsonl``, written with
  one unbuffered ``write``;
- ``finished(identity)`` / ``failed(identity)`` after each: the rollout is forgotten (in batches)
  once done; a failed attempt is retired;
- ``checkpoint(in_flight, rows_done)``: prepare (asked again with the same id until every stage is
  ready or the deadline passes; not ready: resume, that is abort, and log), commit with the
  in-flight rollouts that are not restarts as the scope (with the restored next attempts not yet
  dispatched: the servers hold their state, which a commit leaving them out would delete),
  publish (``collection.json``, ``LATEST``, retention), resume. Any failure: no publish, resume, log; answers ``None``;
- ``housekeeping()`` between checkpoints, and ``release(attempts)`` when the collector stops with
  rollouts in flight (they are retired, so the mesh holds nothing of them).

Every control operation goes through the one control loop of the collector, so none overlaps a
checkpoint. Every call has a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from nemo_gym_ckpt.checkpoint.coordinator import CommitResult, Coordinator, PrepareResult
from nemo_gym_ckpt.collect.preflight import check_files
from nemo_gym_ckpt.collect.published import (
    DISPATCH_LOG,
    CheckpointRefused,
    CollectionManifest,
    RunIdentity,
    check_same_run,
    created_now,
    find_latest,
    new_checkpoint_id,
    older_published,
    publish,
    read_dispatched,
)
from nemo_gym_ckpt.collect.rows import JsonlAppender
from nemo_gym_ckpt.config import DEFAULT_MAX_RECORD_BYTES
from nemo_gym_ckpt.errors import GymError, InvalidCheckpointState, InvalidPhase, StaleAttempt, StorageError
from nemo_gym_ckpt.identity import RolloutIdentity, parse_capture_key

__all__ = ["AfterPublish", "CollectionControl", "ControlSettings", "Published", "Restored"]

logger = logging.getLogger(__name__)

RESUME_S = 30.0
AfterPublish = Callable[["Published"], Awaitable[None]]
"""Called after a checkpoint is published, before resume (the demo's crash). If it raises, the
exception propagates and nothing more is sent to the mesh: no resume."""


@dataclass(frozen=True)
class ControlSettings:
    directory: Path
    """The checkpoint directory, absolute, inside the mesh's ``checkpoint.root``."""
    identity: RunIdentity
    timeout_s: float = 300.0
    """Deadline of one checkpoint (prepare, commit) and of the restore."""
    prepare_poll_s: float = 10.0
    """Each prepare waits at most this long, then is asked again with the same id."""
    forget_batch: int = 256
    forget_every_s: float = 2.0
    max_record_bytes: int | None = DEFAULT_MAX_RECORD_BYTES
    """The participants' ``checkpoint.max_record_bytes``: the bound the files are read with before a
    restore; ``None`` (not known) reads nothing before, and a damaged checkpoint is found by the restore."""


@dataclass(frozen=True)
class Published:
    """One checkpoint taken: its manifest, when it was published and how long the mesh was paused."""

    manifest: CollectionManifest
    published_ms: float
    """From the first prepare until ``LATEST`` was replaced."""
    pause_ms: float = 0.0
    """From the first prepare until every participant resumed."""


@dataclass
class Restored:
    """What ``begin`` did."""

    source: CollectionManifest | None = None
    continued: list[RolloutIdentity] = field(default_factory=list)
    """The next attempts the restore installed: dispatched first."""
    restarted: list[str] = field(default_factory=list)
    """Rollouts in flight at the checkpoint and still left that start over."""
    fenced: list[RolloutIdentity] = field(default_factory=list)
    restore_ms: float = 0.0
    refused: list[str] = field(default_factory=list)
    """Checkpoints the participants refused as unusable (``invalid_checkpoint_state``): left on disk."""


def _elapsed_ms(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 1)


class CollectionControl:
    """Checkpoints, restores and housekeeping of one collection; see the module docstring."""

    def __init__(
        self,
        coordinator: Coordinator,
        settings: ControlSettings,
        *,
        after_publish: AfterPublish | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.settings = settings
        self.after_publish = after_publish
        self.published: list[Published] = []
        self.restored = Restored()
        self._log: JsonlAppender | None = None
        self._to_retire: list[RolloutIdentity] = []
        self._to_forget: list[str] = []
        self._forgot_at = time.monotonic()
        self._restored_waiting: dict[str, RolloutIdentity] = {}
        self._refused: list[str] = []
        """Next attempts the restore installed whose ``/run`` is not sent yet: kept by every commit."""

    @property
    def directory(self) -> Path:
        return self.settings.directory

    def _deadline(self) -> float:
        return time.time() + self.settings.timeout_s

    # ---- begin: restore, fence, resume --------------------------------------------------------

    def latest(self) -> CollectionManifest | None:
        """The published checkpoint a run would restore; ``CheckpointRefused`` if another run's."""
        latest = find_latest(self.directory)
        if latest is not None:
            check_same_run(latest, self.settings.identity, self.directory)
        return latest

    async def begin(self, left: Sequence[str]) -> list[RolloutIdentity]:
        """Restore and fence (see the module docstring); the attempts to dispatch, in order."""
        await self.coordinator.discover()
        self.directory.mkdir(parents=True, exist_ok=True)
        latest, dispatched = self.latest(), read_dispatched(self.directory)
        self._log = JsonlAppender(self.directory / DISPATCH_LOG)
        pending = set(left)
        started = time.monotonic()
        source, restore_id, continued = await self._restore_usable(latest, pending, dispatched)
        fences = _fences(left, continued, dispatched)
        try:
            if fences:
                await self.coordinator.retire(fences, deadline_ts=self._deadline(), checkpoint_id=restore_id)
        except BaseException:
            if restore_id is not None:  # never leave the mesh restored with admission closed
                await self._resume(restore_id)
            raise
        if restore_id is not None:
            await self.coordinator.resume(restore_id, deadline_ts=self._deadline())
        restarted = _restarted([latest, source], pending, continued)
        self.restored = Restored(source, list(continued.values()), restarted, fences, _elapsed_ms(started),
                                 self._refused)
        self._restored_waiting = {episode.capture_key: episode for episode in continued.values()}
        fresh = [RolloutIdentity(rid, dispatched.get(rid, -1) + 1) for rid in left if rid not in continued]
        return [continued[rid] for rid in left if rid in continued] + fresh

    async def _restore_usable(
        self, latest: CollectionManifest | None, pending: set[str], dispatched: dict[str, int]
    ) -> tuple[CollectionManifest | None, str | None, dict[str, RolloutIdentity]]:
        """Restore ``latest``; if its files do not read (``preflight``: nothing was sent, the mesh is
        still fresh) or the participants refuse it as unusable (``invalid_checkpoint_state``), each
        older published checkpoint in turn. The source, the restore's id (``None``: nothing
        restored, the rollouts start over) and the continued attempts by rollout id."""
        candidates = [] if latest is None else [latest]
        while candidates:
            candidate = candidates.pop(0)
            checkpointed = map(parse_capture_key, candidate.continued)
            # an older checkpoint only for rollouts whose checkpointed attempt is still their last one
            scope = [e for e in checkpointed if e.rollout_id in pending
                     and (candidate is latest or e.attempt >= dispatched.get(e.rollout_id, -1))]
            if not scope:
                continue
            if not await self._files_read(candidate, scope):
                if candidate is latest:
                    candidates = self._older(candidate)
                continue
            try:
                restore_id, continued = await self._restore(candidate, scope)
            except (InvalidPhase, StaleAttempt) as error:
                logger.warning("cannot restore %s on this mesh (%s: %s); its %d unfinished rollouts start over",
                               candidate.checkpoint_id, error.code, error.detail, len(scope))
                _start_over(scope, dispatched)
                return latest, None, {}
            except StorageError as error:
                logger.error("checkpoint %s refused as unusable (%s: %s); it is left on disk, its %d unfinished "
                             "rollouts start over unless an older checkpoint holds them",
                             candidate.checkpoint_id, error.code, error.detail, len(scope))
                self._refused.append(candidate.checkpoint_id)
                _start_over(scope, dispatched)
                if candidate is latest:
                    candidates = self._older(candidate)
                continue
            return candidate, restore_id, continued
        return latest, None, {}

    async def _files_read(self, candidate: CollectionManifest, scope: list[RolloutIdentity]) -> bool:
        """Whether every participant's files of ``candidate`` read as its restore will read them
        (``preflight``); if not, the checkpoint is refused with nothing sent to the mesh (logged)."""
        if self.settings.max_record_bytes is None:
            return True
        checkpoint = self.directory / candidate.checkpoint_id
        try:
            await asyncio.to_thread(check_files, checkpoint, candidate, scope,
                                    max_record_bytes=self.settings.max_record_bytes)
        except InvalidCheckpointState as error:
            logger.error("checkpoint %s refused as unusable (%s: %s) before its restore was sent; it is left on "
                         "disk, its %d unfinished rollouts start over unless an older checkpoint holds them",
                         candidate.checkpoint_id, error.code, error.detail, len(scope))
            self._refused.append(candidate.checkpoint_id)
            return False
        return True

    def _older(self, refused: CollectionManifest) -> list[CollectionManifest]:
        """The published checkpoints of this collection other than ``refused``, newest first."""
        older = []
        for manifest in older_published(self.directory, refused.checkpoint_id):
            try:
                check_same_run(manifest, self.settings.identity, self.directory)
            except CheckpointRefused as error:
                logger.warning("not falling back to %s: %s", manifest.checkpoint_id, error)
                continue
            older.append(manifest)
        return older

    async def _restore(
        self, source: CollectionManifest, scope: list[RolloutIdentity]
    ) -> tuple[str, dict[str, RolloutIdentity]]:
        """One restore (the coordinator undoes a failed one, retiring the next attempts, and raises)."""
        restore_id = f"restore-{int(time.time())}-{secrets.token_hex(4)}"
        directory = str(self.directory / source.checkpoint_id)
        result = await self.coordinator.restore(restore_id, deadline_ts=self._deadline(),
                                                checkpoint_dir=directory, episode_ids=scope)
        logger.info("restored %s: %d rollouts continue, %d start over", source.checkpoint_id,
                    len(result.continued()), len(result.restarts()))
        return restore_id, {episode.rollout_id: episode for episode in result.continued()}

    # ---- the data plane reports ---------------------------------------------------------------

    def dispatching(self, identity: RolloutIdentity) -> None:
        assert self._log is not None, "begin first"
        self._log.append(identity.to_json())
        self._restored_waiting.pop(identity.capture_key, None)

    def finished(self, identity: RolloutIdentity) -> None:
        self._to_forget.append(identity.rollout_id)

    def failed(self, identity: RolloutIdentity) -> None:
        self._to_retire.append(identity)

    # ---- checkpoints --------------------------------------------------------------------------

    async def checkpoint(
        self, in_flight: Callable[[], list[RolloutIdentity]], rows_done: Callable[[], int], *, stop: bool = False
    ) -> Published | None:
        """Take, publish and resume one checkpoint; ``None`` (logged) if it was not published. With
        ``stop`` the commit tells the participants the mesh is stopped next."""
        checkpoint_id, deadline = new_checkpoint_id(), self._deadline()
        started = time.monotonic()
        resume = True
        try:
            manifest = await self._take(checkpoint_id, deadline, in_flight, rows_done, stop)
            taken = None if manifest is None else Published(manifest, _elapsed_ms(started))
            if taken is not None and self.after_publish is not None:
                resume = False
                await self.after_publish(taken)
                resume = True
        finally:
            if resume:
                await self._resume(checkpoint_id)
        if taken is None:
            return None
        published = replace(taken, pause_ms=_elapsed_ms(started))
        self.published.append(published)
        logger.info("checkpoint %s published: %d rollouts continue, %d start over, paused %.0f ms",
                    checkpoint_id, len(taken.manifest.continued), len(taken.manifest.restarted),
                    published.pause_ms)
        return published

    async def _take(
        self, checkpoint_id: str, deadline: float, in_flight: Callable[[], list[RolloutIdentity]],
        rows_done: Callable[[], int], stop: bool = False,
    ) -> CollectionManifest | None:
        started = time.monotonic()
        try:
            prepared = await self._prepare(checkpoint_id, deadline)
            if not prepared.prepared:
                logger.warning("checkpoint %s: stage %s not ready by the deadline; aborted", checkpoint_id,
                               prepared.not_ready_stage)
                return None
            sent = in_flight()
            keys = {episode.capture_key for episode in sent}
            waiting = [e for key, e in self._restored_waiting.items() if key not in keys]
            prepare_ms, episodes = _elapsed_ms(started), sent + waiting
            scope = prepared.continued(episodes)
            committed = await self.coordinator.commit(
                checkpoint_id, deadline_ts=deadline, checkpoint_dir=str(self.directory / checkpoint_id),
                episode_ids=scope, stop=stop)
            stats = {"prepare_ms": prepare_ms, "commit_ms": round(_elapsed_ms(started) - prepare_ms, 1)}
            manifest = self._manifest(checkpoint_id, scope, episodes, rows_done(), committed, stats)
            publish(self.directory, manifest)
        except GymError as error:
            logger.warning("checkpoint %s failed, not published: %s: %s", checkpoint_id, error.code,
                           error.detail)
            return None
        except (CheckpointRefused, OSError) as error:
            logger.warning("checkpoint %s could not be published: %s", checkpoint_id, error)
            return None
        return manifest

    async def _prepare(self, checkpoint_id: str, deadline: float) -> PrepareResult:
        while True:
            step = min(deadline, time.time() + self.settings.prepare_poll_s)
            result = await self.coordinator.prepare(checkpoint_id, deadline_ts=step)
            if result.prepared or time.time() >= deadline:
                return result
            logger.info("checkpoint %s: stage %s not ready yet; asking again", checkpoint_id,
                        result.not_ready_stage)

    def _manifest(
        self, checkpoint_id: str, scope: list[RolloutIdentity], episodes: list[RolloutIdentity],
        rows_done: int, committed: CommitResult, stats: dict[str, float],
    ) -> CollectionManifest:
        identity = self.settings.identity
        manifests = {name: f"gym/{m['kind']}/{m['instance']}/manifest.json"
                     for name, m in committed.manifests().items()}
        checkpoint = self.directory / checkpoint_id
        size = sum(path.stat().st_size for path in (checkpoint / "gym").rglob("*") if path.is_file())
        records = sum(int(m["record_count"]) for m in committed.manifests().values())
        continued = {episode.capture_key for episode in scope}
        return CollectionManifest(
            checkpoint_id=checkpoint_id, run_id=identity.run_id, created_at=created_now(),
            continued=sorted(continued),
            restarted=sorted(e.capture_key for e in episodes if e.capture_key not in continued),
            rows_done=rows_done, config_digest=identity.config_digest, input_digest=identity.input_digest,
            num_repeats=identity.num_repeats, manifests=manifests, staging_keys=committed.staging_keys(),
            stats={**stats, "bytes": size, "records": records},
        )

    async def _resume(self, checkpoint_id: str) -> None:
        try:
            await self.coordinator.resume(checkpoint_id, deadline_ts=time.time() + RESUME_S)
        except GymError as error:
            logger.error("resume of checkpoint %s failed: %s: %s (the participants' leases end it)",
                         checkpoint_id, error.code, error.detail)

    # ---- housekeeping -------------------------------------------------------------------------

    async def housekeeping(self, *, final: bool = False) -> None:
        """Retire failed attempts; forget finished rollouts once a batch is due (all if ``final``)."""
        if self._to_retire:
            doomed, self._to_retire = self._to_retire, []
            await self._quietly("retire", self.coordinator.retire(doomed, deadline_ts=self._deadline()))
        due = time.monotonic() - self._forgot_at >= self.settings.forget_every_s
        if self._to_forget and (final or due or len(self._to_forget) >= self.settings.forget_batch):
            done, self._to_forget = self._to_forget, []
            self._forgot_at = time.monotonic()
            await self._quietly("forget", self.coordinator.forget(done, deadline_ts=self._deadline()))

    async def release(self, attempts: Sequence[RolloutIdentity]) -> None:
        """Retire attempts the collector abandons (it stops with them in flight)."""
        if attempts:
            retire = self.coordinator.retire(list(attempts), deadline_ts=self._deadline())
            await self._quietly("retire", retire)

    @staticmethod
    async def _quietly(op: str, work: Awaitable[object]) -> None:
        try:
            await work
        except GymError as error:
            logger.warning("%s failed: %s: %s", op, error.code, error.detail)

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def _start_over(scope: list[RolloutIdentity], dispatched: dict[str, int]) -> None:
    """A restore of ``scope`` was undone: the coordinator retired the next attempts, so each rollout
    starts over as the attempt after them."""
    for episode in scope:
        rid = episode.rollout_id
        dispatched[rid] = max(dispatched.get(rid, -1), episode.attempt + 1)


def _restarted(
    sources: Sequence[CollectionManifest | None], pending: set[str], continued: dict[str, RolloutIdentity]
) -> list[str]:
    """Rollouts in flight at the checkpoints, still left, that do not continue: they start over."""
    in_flight = [key for m in sources if m is not None for key in m.continued + m.restarted]
    return sorted({parse_capture_key(key).rollout_id for key in in_flight} & pending - continued.keys())


def _fences(
    left: Sequence[str], continued: dict[str, RolloutIdentity], dispatched: dict[str, int]
) -> list[RolloutIdentity]:
    """The attempts to retire before dispatching: every earlier attempt of each rollout still left."""
    fences = []
    for rid in left:
        if rid in continued:
            fences.append(RolloutIdentity(rid, continued[rid].attempt - 1))
        elif rid in dispatched:
            fences.append(RolloutIdentity(rid, dispatched[rid]))
    return fences
