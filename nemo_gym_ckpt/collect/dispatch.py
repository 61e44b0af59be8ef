"""One collection run: rollouts dispatched at bounded concurrency, rows written, checkpoints taken.

``run_plan(plan, client, stream, control=..., triggers=...)`` collects every rollout of the plan not
yet in its output. Each is one ``POST {environment}/ng-rollout/<capture key>/run`` of its task row
with NeMo Gym's ``_ng_task_index`` and ``_ng_rollout_index`` added, as NeMo Gym's collector sends
them (a grouped verifier such as genrm_compare finds its cohort by them);
the reply becomes an output row (``rollouts.output_row``, with its attempt), an error a failure row.

Without ``control`` a rollout is dispatched as attempt 0 and SIGINT or SIGTERM cancels the run. With
a ``CollectionControl`` (``collection_control``) the run begins with its restore and fencing (the
attempts to dispatch come from there), reports every dispatch, finish and failure to it, and one
control loop serializes every control operation: the checkpoints ``Triggers`` asks for (timer,
SIGUSR1, SIGTERM), the housekeeping between them. During a checkpoint no new rollout is dispatched;
the rollouts in flight when every stage is ready are the checkpoint's. After a SIGTERM checkpoint
the run stops: the rollouts in flight are cancelled here and retired on the mesh. SIGINT cancels.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import orjson

from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.collect.control import CollectionControl, Published
from nemo_gym_ckpt.collect.progress import Progress
from nemo_gym_ckpt.collect.rows import (
    JsonlAppender,
    RolloutKey,
    aggregate,
    failure_row,
    failures_path,
    metrics_path,
    output_row,
    read_jsonl,
    rollout_id,
    rollout_key,
)
from nemo_gym_ckpt.collect.triggers import SIGTERM, STOP, Triggers, install_signals
from nemo_gym_ckpt.errors import CollectionStartFailed, GymError, UpstreamError
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["HOUSEKEEPING_TICK_S", "CollectionStartFailed", "Dispatcher", "HeldBack", "Plan", "Summary", "done_keys",
           "run_plan"]

HOUSEKEEPING_TICK_S = 1.0
Work = list[tuple[RolloutKey, RolloutIdentity]]


@dataclass(frozen=True)
class Plan:
    """Everything one collection needs, resolved."""

    environment: str
    environment_url: str
    tasks: list[dict[str, Any]]
    output: Path
    num_repeats: int = 1
    concurrency: int = 8
    rollout_timeout_s: float = 3600.0

    def rollouts(self) -> list[RolloutKey]:
        return [(task, rollout) for task in range(len(self.tasks)) for rollout in range(self.num_repeats)]


def done_keys(output: Path) -> set[RolloutKey]:
    """The rollouts that have a whole row in ``output``."""
    return {key for row in read_jsonl(output, complete_lines_only=True) if (key := rollout_key(row))}


@dataclass
class Summary:
    """What one run did."""

    planned: int
    skipped: int
    finished: int = 0
    failed: int = 0
    elapsed_s: float = 0.0
    stopped_by: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    checkpoints: list[Published] = field(default_factory=list)
    continued: int = 0
    """Rollouts that went on from a restored checkpoint."""
    stop_checkpointed: bool = False
    """After SIGTERM: whether the checkpoint before stopping was published."""


@dataclass(frozen=True)
class HeldBack:
    """The last ``count`` rollouts of a run are not sent before ``release`` is set (the demo holds
    them so that its collection cannot end before its checkpoint is taken)."""

    count: int
    release: asyncio.Event


@dataclass
class _Sinks:
    rows: JsonlAppender
    failures: JsonlAppender
    progress: Progress


class Dispatcher:
    """Sends the ``/run`` of each rollout, at most ``plan.concurrency`` at a time; knows what is in flight."""

    def __init__(self, plan: Plan, client: MeshClient, sinks: _Sinks, summary: Summary,
                 control: CollectionControl | None = None, held_back: HeldBack | None = None) -> None:
        self.plan, self.client, self.sinks, self.summary, self.control = plan, client, sinks, summary, control
        self.held_back = held_back
        self._in_flight: dict[str, RolloutIdentity] = {}
        self.abandoned: list[RolloutIdentity] = []
        """The rollouts in flight when the run was stopped (retired on the mesh then)."""
        self._open = asyncio.Event()
        self._open.set()

    def in_flight(self) -> list[RolloutIdentity]:
        return list(self._in_flight.values())

    def rows_done(self) -> int:
        return self.summary.skipped + self.summary.finished

    def pause(self) -> None:
        """No new ``/run`` until ``unpause`` (those already sent go on)."""
        self._open.clear()

    def unpause(self) -> None:
        self._open.set()

    async def run(self, work: Work) -> None:
        pending = deque(work)
        held_from = len(work) - self.held_back.count if self.held_back is not None else len(work)

        async def worker() -> None:
            while pending:
                await self._open.wait()
                if self.held_back is not None and len(work) - len(pending) >= held_from:
                    await self.held_back.release.wait()
                if pending:
                    await self._one(*pending.popleft())

        async with asyncio.TaskGroup() as group:
            for _ in range(min(self.plan.concurrency, len(pending))):
                group.create_task(worker())

    async def _one(self, key: RolloutKey, identity: RolloutIdentity) -> None:
        if self.control is not None:
            self.control.dispatching(identity)
        self._in_flight[identity.capture_key] = identity
        try:
            reply = await self._send(key, identity)
        except GymError as error:
            self._failed(key, identity, error)
            return
        finally:
            self._in_flight.pop(identity.capture_key, None)
        self.sinks.rows.append(output_row(reply, *key, attempt=identity.attempt))
        self.summary.finished += 1
        if self.control is not None:
            self.control.finished(identity)
        reward = reply.get("reward")
        self.sinks.progress.advance(reward=float(reward) if isinstance(reward, int | float) else None)

    async def _send(self, key: RolloutKey, identity: RolloutIdentity) -> dict[str, Any]:
        body = {**self.plan.tasks[key[0]], "_ng_task_index": key[0], "_ng_rollout_index": key[1]}
        reply = await self.client.post_json(f"{self.plan.environment_url}/run", json=body,
                                            identity=identity, timeout_s=self.plan.rollout_timeout_s)
        if not isinstance(reply, dict):
            raise UpstreamError("the environment answered something other than a row")
        return reply

    def _failed(self, key: RolloutKey, identity: RolloutIdentity, error: GymError) -> None:
        task = self.plan.tasks[key[0]]
        row = failure_row(task, *key, error.code, error.detail, attempt=identity.attempt)
        self.sinks.failures.append(row)
        self.summary.failed += 1
        if self.control is not None:
            self.control.failed(identity)
        self.sinks.progress.advance(failed=True)


# ---- running with and without a controller -------------------------------------------------------


@contextmanager
def _cancel_on(signums: tuple[int, ...], dispatcher: Dispatcher, work: asyncio.Task[None],
               also: Triggers | None = None) -> Iterator[None]:
    """While inside, each of ``signums`` cancels ``work`` (recorded in ``summary.stopped_by``; the
    rollouts in flight then are kept in ``dispatcher.abandoned``)."""
    loop = asyncio.get_running_loop()

    def stop(signum: int) -> None:
        dispatcher.summary.stopped_by = signal.Signals(signum).name
        dispatcher.abandoned = dispatcher.in_flight()
        work.cancel()
        if also is not None:
            also.close()

    for signum in signums:
        loop.add_signal_handler(signum, stop, signum)
    try:
        yield
    finally:
        for signum in signums:
            loop.remove_signal_handler(signum)


async def _await_work(work: asyncio.Task[None], summary: Summary) -> None:
    try:
        await work
    except asyncio.CancelledError:
        if summary.stopped_by is None:
            raise


async def _uncontrolled(dispatcher: Dispatcher, work: Work) -> None:
    task = asyncio.create_task(dispatcher.run(work))
    try:
        with _cancel_on((signal.SIGINT, signal.SIGTERM), dispatcher, task):
            await _await_work(task, dispatcher.summary)
    finally:
        await _cancelled(task)


async def _cancelled(task: asyncio.Task[None]) -> None:
    if not task.done():
        task.cancel()
        await asyncio.wait({task})


async def _controlled(
    dispatcher: Dispatcher, work: Work, control: CollectionControl, triggers: Triggers
) -> None:
    triggers.started()
    task = asyncio.create_task(dispatcher.run(work))
    task.add_done_callback(lambda _: triggers.close())
    try:
        with _cancel_on((signal.SIGINT,), dispatcher, task, triggers):
            await _control_loop(dispatcher, control, triggers, task)
            await _await_work(task, dispatcher.summary)
    finally:
        await _cancelled(task)


async def _control_loop(
    dispatcher: Dispatcher, control: CollectionControl, triggers: Triggers, task: asyncio.Task[None]
) -> None:
    """Checkpoints when asked, housekeeping in between; returns when the work ends or after SIGTERM."""
    while True:
        reason = await triggers.next(HOUSEKEEPING_TICK_S)
        if reason == STOP:  # the work ended, or SIGINT cancelled it
            await control.release(dispatcher.abandoned)
            await control.housekeeping(final=True)
            return
        if reason is not None:
            published = await _checkpoint(dispatcher, control, triggers, keep_paused=reason == SIGTERM)
            if reason == SIGTERM:
                await _stop_after_checkpoint(dispatcher, control, task, published)
                return
        await control.housekeeping()


async def _checkpoint(
    dispatcher: Dispatcher, control: CollectionControl, triggers: Triggers, *, keep_paused: bool
) -> Published | None:
    triggers.started()
    dispatcher.pause()
    try:
        published = await control.checkpoint(dispatcher.in_flight, dispatcher.rows_done)
    finally:
        if not keep_paused:
            dispatcher.unpause()
    if published is not None:
        dispatcher.summary.checkpoints.append(published)
    return published


async def _stop_after_checkpoint(
    dispatcher: Dispatcher, control: CollectionControl, task: asyncio.Task[None],
    published: Published | None,
) -> None:
    summary = dispatcher.summary
    summary.stopped_by, summary.stop_checkpointed = SIGTERM, published is not None
    dispatcher.abandoned = dispatcher.in_flight()
    await _cancelled(task)
    await control.release(dispatcher.abandoned)
    await control.housekeeping(final=True)


# ---- one run -------------------------------------------------------------------------------------


async def _work(
    keys: list[RolloutKey], control: CollectionControl | None, summary: Summary
) -> Work:
    """What to dispatch: attempt 0 of each key, or what the controller's restore answers."""
    if control is None:
        return [(key, RolloutIdentity(rollout_id(*key))) for key in keys]
    by_id = {rollout_id(*key): key for key in keys}
    try:
        attempts = await control.begin(list(by_id))
    except GymError as error:
        raise CollectionStartFailed(f"{error.code}: {error.detail}") from error
    summary.continued = len(control.restored.continued)
    return [(by_id[identity.rollout_id], identity) for identity in attempts]


async def run_plan(
    plan: Plan,
    client: MeshClient | None = None,
    stream: TextIO | None = None,
    *,
    control: CollectionControl | None = None,
    triggers: Triggers | None = None,
    held_back: HeldBack | None = None,
) -> Summary:
    """Collect every rollout of ``plan`` not yet in its output; answers the summary (metrics written)."""
    own_client = client is None
    client = client or MeshClient(max_connections=max(64, 2 * plan.concurrency))
    rows = JsonlAppender(plan.output)  # cuts a torn tail before the finished rows are read
    done = done_keys(plan.output)
    keys = [key for key in plan.rollouts() if key not in done]
    summary = Summary(planned=len(plan.rollouts()), skipped=len(plan.rollouts()) - len(keys))
    failures = JsonlAppender(failures_path(plan.output))
    progress: Progress | None = None
    started = time.monotonic()
    triggers = triggers or Triggers()
    try:
        with install_signals(triggers) if control is not None else nullcontext():
            work = await _work(keys, control, summary) if keys else []
            progress = Progress(len(work), stream)
            dispatcher = Dispatcher(plan, client, _Sinks(rows, failures, progress), summary, control, held_back)
            if control is None:
                await _uncontrolled(dispatcher, work)
            else:
                await _controlled(dispatcher, work, control, triggers)
    finally:
        summary.elapsed_s = time.monotonic() - started
        if progress is not None:
            progress.close()
        rows.close()
        failures.close()
        if own_client:
            await client.aclose()
    summary.metrics = _write_metrics(plan, summary)
    return summary


def _write_metrics(plan: Plan, summary: Summary) -> dict[str, Any]:
    task_fields = {key for task in plan.tasks for key in task}
    metrics = aggregate(read_jsonl(plan.output, complete_lines_only=True), task_fields, summary.failed)
    ran = summary.finished + summary.failed
    metrics.update(
        environment=plan.environment, concurrency=plan.concurrency, elapsed_s=round(summary.elapsed_s, 3),
        rollouts_per_s=round(ran / summary.elapsed_s, 3) if summary.elapsed_s > 0 else None,
    )
    metrics_path(plan.output).write_bytes(_json(metrics))
    return metrics


def _json(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2) + b"\n"
