"""One collection run: rollouts dispatched at bounded concurrency, rows written, checkpoints taken.

``run_plan(plan, client, stream, control=..., triggers=..., watch=...)`` collects every rollout of
the plan not yet in its output. First every rollout of the plan is written, as dispatched, to
``<output>_materialized_inputs.jsonl``. Each rollout is then one ``POST
{environment}/ng-rollout/<capture key>/run`` of its dispatched row (``rows.dispatch_body``: the task
row, ``agent_ref``, ``_ng_task_index``, ``_ng_rollout_index``, and ``_ng_attempt_index`` from attempt
1 on, as NeMo Gym's collector sends it); the reply becomes an output row (``rows.output_row``), an
error or a reply carrying ``_ng_failure_class`` a failure row (``rows.failure_row``). At the end the
aggregate metrics file is written over every row of the output.

``watch`` is polled while the rollouts run: when it answers a reason (the launcher's "a server
exited"), the run stops as on SIGINT, with ``Summary.stopped_by`` set to that reason.

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
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx
import orjson

from nemo_gym_ckpt.client import MeshClient, raise_for_error
from nemo_gym_ckpt.collect.control import CollectionControl, Published
from nemo_gym_ckpt.collect.progress import Progress
from nemo_gym_ckpt.collect.published import write_atomic
from nemo_gym_ckpt.collect.rows import (
    FAILURE_CLASS,
    JsonlAppender,
    RolloutKey,
    RunFailure,
    Stamps,
    aggregate_entry,
    dispatch_body,
    dispatch_row,
    failure_row,
    failures_path,
    materialized_path,
    metrics_path,
    output_row,
    read_jsonl,
    rollout_id,
    rollout_key,
    summarize,
)
from nemo_gym_ckpt.collect.triggers import SIGTERM, STOP, Triggers, install_signals
from nemo_gym_ckpt.errors import CollectionStartFailed, GymError, Overloaded, UpstreamError, UsageError
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["HOUSEKEEPING_TICK_S", "CollectionStartFailed", "Dispatcher", "HeldBack", "Plan", "Summary", "Watch",
           "done_keys", "run_plan", "write_materialized"]

HOUSEKEEPING_TICK_S = 1.0
WATCH_TICK_S = 0.5
Work = list[tuple[RolloutKey, RolloutIdentity]]
Watch = Callable[[], str | None]
"""Answers why the run must stop (a server exited), or None while it may go on."""


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
    result_type: str | None = None
    """The environment server's implementation (``_ng_result_type`` on every row)."""
    agent_ref: Mapping[str, Any] | None = None
    """The agent the environment server fronts (``agent_ref`` on rows whose task names none)."""

    def rollouts(self) -> list[RolloutKey]:
        return [(task, rollout) for task in range(len(self.tasks)) for rollout in range(self.num_repeats)]

    @property
    def stamps(self) -> Stamps:
        return Stamps(self.environment, self.result_type, self.agent_ref)

    def dispatched(self, key: RolloutKey) -> dict[str, Any]:
        """The rollout's row as dispatched (its line of the materialized inputs)."""
        return dispatch_row(self.tasks[key[0]], *key, self.stamps)


def done_keys(output: Path) -> set[RolloutKey]:
    """The rollouts that have a whole row in ``output``; ``UsageError`` naming the file (and line) if
    it cannot be read or a complete line is not a JSON object."""
    try:
        return {key for row in read_jsonl(output, complete_lines_only=True) if (key := rollout_key(row))}
    except ValueError as error:  # names the file and the line
        raise UsageError(f"the output is damaged: {error}") from None
    except OSError as error:
        raise UsageError(f"cannot read the output {output}: {error.strerror or error}") from None


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
    refused: int = 0
    """``/run`` calls refused up front (``capacity_exceeded``) and sent again after their ``Retry-After``."""
    stop_checkpointed: bool = False
    """After SIGTERM: whether the checkpoint before stopping was published."""
    failure_codes: Counter[str] = field(default_factory=Counter)
    """The failed rollouts of this run by error code (what the collector's exit line names)."""


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
        dispatched = self.plan.dispatched(key)
        try:
            reply = await self._send(dispatch_body(dispatched, identity.attempt), identity)
        except _RunFailed as failed:
            self._failed(identity, failure_row(failed.failure, dispatched, identity.attempt, self.plan.stamps),
                         failed.failure.error.code)
            return
        finally:
            self._in_flight.pop(identity.capture_key, None)
        row = output_row(reply, dispatched, identity.attempt, self.plan.stamps)
        if FAILURE_CLASS in reply:  # the environment reports the rollout failed, NeMo Gym's way
            self._failed(identity, row, str(reply[FAILURE_CLASS]))
            return
        self.sinks.rows.append(row)
        self.summary.finished += 1
        if self.control is not None:
            self.control.finished(identity)
        reward = reply.get("reward")
        self.sinks.progress.advance(reward=float(reward) if isinstance(reward, int | float) else None)

    async def _send(self, body: dict[str, Any], identity: RolloutIdentity) -> dict[str, Any]:
        """The environment's reply to one ``/run``; ``_RunFailed`` with what came back otherwise. A
        refusal up front (``Overloaded``: nothing started) is sent again after its ``Retry-After``,
        until the rollout's own timeout has passed."""
        give_up = time.monotonic() + self.plan.rollout_timeout_s
        while True:
            try:
                response = await self.client.request(
                    "POST", f"{self.plan.environment_url}/run", json=body, identity=identity,
                    timeout_s=self.plan.rollout_timeout_s, check=False,
                )
            except GymError as error:
                raise _RunFailed(RunFailure(error)) from None
            status, content = response.status_code, response.content
            refused = _error_of(response)
            if not isinstance(refused, Overloaded) or time.monotonic() + refused.retry_after_s >= give_up:
                break
            self.summary.refused += 1
            await asyncio.sleep(refused.retry_after_s)
        if refused is not None:
            raise _RunFailed(RunFailure(refused, status, content))
        try:
            reply = orjson.loads(content)
        except orjson.JSONDecodeError:
            reply = None
        if not isinstance(reply, dict):
            unusable = UpstreamError("the environment answered something other than a row")
            raise _RunFailed(RunFailure(unusable, status, content))
        return reply

    def _failed(self, identity: RolloutIdentity, row: dict[str, Any], code: str) -> None:
        self.sinks.failures.append(row)
        self.summary.failed += 1
        self.summary.failure_codes[code] += 1
        if self.control is not None:
            self.control.failed(identity)
        self.sinks.progress.advance(failed=True)


def _error_of(response: httpx.Response) -> GymError | None:
    """The error a ``/run`` reply stands for (``Overloaded`` with its ``Retry-After``), or None."""
    try:
        raise_for_error(response)
    except GymError as error:
        return error
    return None


class _RunFailed(Exception):
    """A ``/run`` without a row (internal to the dispatcher)."""

    def __init__(self, failure: RunFailure) -> None:
        super().__init__(failure.error.detail)
        self.failure = failure


# ---- running with and without a controller -------------------------------------------------------


@contextmanager
def _cancel_on(signums: tuple[int, ...], dispatcher: Dispatcher, work: asyncio.Task[None],
               also: Triggers | None = None, watch: Watch | None = None) -> Iterator[None]:
    """While inside, each of ``signums`` (and a reason from ``watch``) cancels ``work``, recorded in
    ``summary.stopped_by``; the rollouts in flight then are kept in ``dispatcher.abandoned``."""
    loop = asyncio.get_running_loop()

    def stop(reason: str) -> None:
        if dispatcher.summary.stopped_by is not None:
            return
        dispatcher.summary.stopped_by = reason
        dispatcher.abandoned = dispatcher.in_flight()
        work.cancel()
        if also is not None:
            also.close()

    for signum in signums:
        loop.add_signal_handler(signum, stop, signal.Signals(signum).name)
    watcher = asyncio.create_task(_watch(watch, stop)) if watch is not None else None
    try:
        yield
    finally:
        for signum in signums:
            loop.remove_signal_handler(signum)
        if watcher is not None:
            watcher.cancel()


async def _watch(watch: Watch, stop: Callable[[str], None]) -> None:
    """Poll ``watch`` until it answers a reason to stop."""
    while (reason := watch()) is None:
        await asyncio.sleep(WATCH_TICK_S)
    stop(reason)


async def _await_work(work: asyncio.Task[None], summary: Summary) -> None:
    try:
        await work
    except asyncio.CancelledError:
        if summary.stopped_by is None:
            raise


async def _uncontrolled(dispatcher: Dispatcher, work: Work, watch: Watch | None) -> None:
    task = asyncio.create_task(dispatcher.run(work))
    try:
        with _cancel_on((signal.SIGINT, signal.SIGTERM), dispatcher, task, watch=watch):
            await _await_work(task, dispatcher.summary)
    finally:
        await _cancelled(task)


async def _cancelled(task: asyncio.Task[None]) -> None:
    if not task.done():
        task.cancel()
        await asyncio.wait({task})


async def _controlled(
    dispatcher: Dispatcher, work: Work, control: CollectionControl, triggers: Triggers, watch: Watch | None
) -> None:
    triggers.started()
    task = asyncio.create_task(dispatcher.run(work))
    task.add_done_callback(lambda _: triggers.close())
    try:
        with _cancel_on((signal.SIGINT,), dispatcher, task, triggers, watch):
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
        published = await control.checkpoint(dispatcher.in_flight, dispatcher.rows_done, stop=keep_paused)
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
    watch: Watch | None = None,
) -> Summary:
    """Collect every rollout of ``plan`` not yet in its output; answers the summary (metrics written)."""
    write_materialized(plan)
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
                await _uncontrolled(dispatcher, work, watch)
            else:
                await _controlled(dispatcher, work, control, triggers, watch)
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


def write_materialized(plan: Plan) -> None:
    """Every rollout of the plan as it is dispatched, in order (written whole, before any ``/run``)."""
    lines = b"".join(orjson.dumps(plan.dispatched(key), option=orjson.OPT_NON_STR_KEYS) + b"\n"
                     for key in plan.rollouts())
    path = materialized_path(plan.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lines)


def _write_metrics(plan: Plan, summary: Summary) -> dict[str, Any]:
    """The aggregate metrics file (NeMo Gym's shape, over every row of the output); answers the summary."""
    rows = list(read_jsonl(plan.output, complete_lines_only=True))
    write_atomic(metrics_path(plan.output), _json([aggregate_entry(rows, plan.stamps)]))
    task_fields = {key for task in plan.tasks for key in task}
    metrics = summarize(rows, task_fields, summary.failed)
    ran = summary.finished + summary.failed
    metrics.update(
        environment=plan.environment, concurrency=plan.concurrency, elapsed_s=round(summary.elapsed_s, 3),
        rollouts_per_s=round(ran / summary.elapsed_s, 3) if summary.elapsed_s > 0 else None,
    )
    return metrics


def _json(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS) + b"\n"
