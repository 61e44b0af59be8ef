"""Episodes as explicit named steps, with a boundary after every completed step.

An environment server describes its episode once, as a ``Program``: named ``Step`` objects, the
first step's name, and an optional cleanup. Each step has a checkpoint mode (docs/protocol.md section 7):

- ``replay``: safe to run again after a crash; a checkpoint does not wait for it, and an episode
  inside it is exported at its previous boundary;
- ``wait``: must not run twice; a checkpoint waits for it to end at a new boundary.

A mode may also be derived from the state (``single_agent_turn``'s verify step takes the mode the
resources server announced at seed time).

A step's action reads the episode's ``task`` and changes its JSON ``state``, and answers the name of
the next step, or ``None`` when the episode is done. Each step starts from a fresh copy of the last
boundary's state, so a step that fails or is cancelled leaves nothing half-written behind::

    Episode.start ──> boundary 0 (next: first step) ──run step──> boundary 1 ──> ... ──> next None
                             ^                          │ fails or is cancelled
                             └──── stays at the last boundary; the program's cleanup runs

A ``Boundary`` is the number of completed steps, the next step's name and the state frozen as
canonical JSON, so it is always serializable and never changes under a running step.
``Episode.from_boundary`` puts an episode back at a saved boundary and ``run_episode`` continues from
there: restoring an episode never needs the program to change.

``EpisodeHooks`` is where checkpointing plugs in: ``entering`` runs before each step and
``at_boundary`` after each (it may park the episode until a checkpoint ends). Time spent in hooks is
not charged to the episode's timeout; only time inside steps is, as the budget's clock counts it.
That clock is a ``Clock`` (``now`` and ``sleep_until``): monotonic time by default; checkpointing
gives one that stands still while a checkpoint is open, so a step waiting on a parked peer is not
charged for the wait either (docs/protocol.md section 7).

Records never carry token arrays (docs/protocol.md section 6): ``Episode.record()`` leaves out the token
capture fields (``nemo_gym_ckpt.capture``) wherever they appear in the boundary's state; the boundary kept
in memory keeps them, so an episode that goes on in the same process loses nothing, while one
restored from a record continues without the token arrays of its earlier turns.

What an episode keeps must stay writable as JSON: ``run_episode`` takes ``record_levels``, the
levels whatever keeps its boundaries wraps a state in (a record: two), and a step that leaves a state
that cannot be written that deep (data from a peer nested too deep) fails as ``upstream_error``
naming the step. The final state's ``result`` holds the task row's fields one level below the state
(``RESULT_LEVELS``), which is how deep a ``/run`` row may be is derived (``environment.base``).
A restored boundary is read with the same bound, and ``Program.check_state`` (the program's own
check, if it has one) says whether its state holds what the steps from its next step on read.

A step that learns its episode cannot be captured (a restart-only resources server or agent,
docs/protocol.md section 7) calls ``episode.mark_restart()``; the mark is sticky and checkpointing
then leaves the episode alone (it never parks and is never exported).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import orjson

from nemo_gym_ckpt.bounds import MAX_INT64
from nemo_gym_ckpt.canonical import canonical_json, canonical_json_within
from nemo_gym_ckpt.capture import without_token_arrays
from nemo_gym_ckpt.checkpoint.clock import Clock
from nemo_gym_ckpt.errors import (
    GymError,
    InternalError,
    InvalidCheckpointState,
    Overloaded,
    Unavailable,
    UpstreamError,
    UpstreamTimeout,
)
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = [
    "MONOTONIC_CLOCK",
    "NO_HOOKS",
    "RESULT_LEVELS",
    "STEP_MODES",
    "Action",
    "Boundary",
    "Episode",
    "EpisodeHooks",
    "FailureStage",
    "MonotonicClock",
    "Program",
    "StateCheck",
    "Step",
    "StepBudget",
    "StepMode",
    "run_episode",
    "step_error",
    "task_digest",
]

logger = logging.getLogger(__name__)

StepMode = Literal["wait", "replay"]
STEP_MODES: tuple[StepMode, ...] = ("wait", "replay")
FailureStage = Literal["admission", "seed", "agent", "verification", "cleanup"]
"""Where an episode failed, in NeMo Gym's words (its ``EpisodeFailure.stage``)."""

RESULT_LEVELS = 1
"""Levels the final state wraps the task row's fields in: ``{"result": {**row, ...}}``."""

Action = Callable[["Episode"], Awaitable[str | None]]
"""A step's work: reads ``episode.task``, changes ``episode.state``, answers the next step's name."""


def task_digest(task: Mapping[str, Any]) -> str:
    """SHA-256 of the canonical JSON of a task row (docs/protocol.md section 7)."""
    return hashlib.sha256(canonical_json(task)).hexdigest()


# ---- steps and programs --------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One named step: its action, its checkpoint mode (fixed, or derived from the state) and the
    stage NeMo Gym names when an episode fails in it (``seed``, ``agent``, ``verification``,
    ``cleanup``; None: not said)."""

    name: str
    action: Action
    mode: StepMode | Callable[[Mapping[str, Any]], StepMode] = "wait"
    stage: FailureStage | None = None

    def mode_for(self, state: Mapping[str, Any]) -> StepMode:
        mode = self.mode(state) if callable(self.mode) else self.mode
        if mode not in STEP_MODES:
            raise InternalError(f"step {self.name} has mode {mode!r}; expected one of {STEP_MODES}")
        return mode


Cleanup = Callable[["Episode"], Awaitable[None]]
StateCheck = Callable[[str | None, Mapping[str, Any]], None]
"""A program's check of a restored boundary: its next step (None: finished) and its state; raises
``ValueError`` naming what the steps from there on would read and the state lacks."""


@dataclass(frozen=True)
class Program:
    """The steps of one kind of episode, by name, and where an episode starts."""

    steps: Mapping[str, Step]
    first: str
    cleanup: Cleanup | None = None
    state_check: StateCheck | None = None

    @classmethod
    def of(
        cls, steps: Sequence[Step], *, cleanup: Cleanup | None = None, check_state: StateCheck | None = None
    ) -> Program:
        """A program whose first step is the first of ``steps``; names must be unique."""
        by_name = {step.name: step for step in steps}
        if not steps or len(by_name) != len(steps):
            raise ValueError(f"a program needs steps with unique names, got {[s.name for s in steps]}")
        return cls(by_name, steps[0].name, cleanup, check_state)

    def check_state(self, next_step: str | None, state: Mapping[str, Any]) -> None:
        """Whether an episode can go on from a restored boundary: ``ValueError`` naming what is
        wrong. A finished one (``next_step`` None) must hold its ``result`` (what ``/run`` answers);
        one with steps left, what the program's own check asks (nothing without one)."""
        if next_step is None:
            if not isinstance(state.get("result"), dict):
                raise ValueError("a finished episode's state holds its result, an object")
        elif self.state_check is not None:
            self.state_check(next_step, state)

    def step(self, name: str) -> Step:
        try:
            return self.steps[name]
        except KeyError:
            raise InternalError(f"no step named {name!r}; steps are {list(self.steps)}") from None


# ---- boundaries and episodes ---------------------------------------------------------------------


@dataclass(frozen=True)
class Boundary:
    """The saved state of an episode after ``index`` completed steps; ``next_step`` None: finished."""

    index: int
    next_step: str | None
    state_json: bytes

    @classmethod
    def start(cls, first: str, state: Mapping[str, Any] | None = None) -> Boundary:
        return cls(0, first, canonical_json(dict(state or {})))

    def advance(self, next_step: str | None, state: Mapping[str, Any], levels: int = 0) -> Boundary:
        """The boundary after one more step; ``orjson.JSONEncodeError`` when ``state`` cannot be
        written as JSON ``levels`` levels deeper (what keeps it wraps it in those)."""
        return Boundary(self.index + 1, next_step, canonical_json_within(state, levels))

    def state(self) -> dict[str, Any]:
        """A fresh, independent copy of the saved state."""
        return dict(orjson.loads(self.state_json))

    @property
    def finished(self) -> bool:
        return self.next_step is None

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "next_step": self.next_step, "state": self.state()}

    @classmethod
    def from_json(cls, data: Any, levels: int = 0) -> Boundary:
        """Read a saved boundary; ``InvalidCheckpointState`` if it is malformed, its index past 64
        bits, or its state cannot be written as JSON again ``levels`` levels deeper (in a record)."""
        if not isinstance(data, Mapping) or set(data) != {"index", "next_step", "state"}:
            raise InvalidCheckpointState("a boundary is {index, next_step, state}")
        index, next_step, state = data["index"], data["next_step"], data["state"]
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index <= MAX_INT64:
            raise InvalidCheckpointState(f"boundary index must be an int from 0 to {MAX_INT64}, got {index!r}")
        if not (next_step is None or isinstance(next_step, str)) or not isinstance(state, Mapping):
            raise InvalidCheckpointState("boundary next_step must be a string or null, state an object")
        try:
            frozen = canonical_json_within(state, levels)
        except orjson.JSONEncodeError as error:
            raise InvalidCheckpointState(f"boundary state cannot be written again as JSON ({error})") from None
        return cls(index, next_step, frozen)


@dataclass(eq=False)
class Episode:
    """One attempt of one rollout: its task, its last boundary, and the step running now (if any)."""

    identity: RolloutIdentity
    task: dict[str, Any]
    boundary: Boundary
    state: dict[str, Any] = field(default_factory=dict)
    current: Step | None = None
    current_mode: StepMode | None = None
    restart: bool = False
    _task_digest: str | None = field(default=None, repr=False)
    watcher: Callable[[Episode], None] | None = field(default=None, repr=False)
    """Told each time ``current_mode`` is set or cleared and when the episode is marked a restart
    (the checkpoint adapter keeps its readiness tally with it); it must not raise."""

    @classmethod
    def start(cls, identity: RolloutIdentity, task: Mapping[str, Any], program: Program) -> Episode:
        boundary = Boundary.start(program.first)
        return cls(identity, dict(task), boundary, boundary.state())

    @classmethod
    def from_boundary(
        cls, identity: RolloutIdentity, task: Mapping[str, Any], boundary: Boundary, program: Program
    ) -> Episode:
        """An episode that continues at ``boundary`` (a restored attempt); its next step must exist."""
        if boundary.next_step is not None and boundary.next_step not in program.steps:
            raise InvalidCheckpointState(f"boundary names step {boundary.next_step!r}, not in this program")
        return cls(identity, dict(task), boundary, boundary.state())

    @property
    def task_digest(self) -> str:
        """The task row's digest, computed once (the row never changes during an episode)."""
        if self._task_digest is None:
            self._task_digest = task_digest(self.task)
        return self._task_digest

    @property
    def mode(self) -> StepMode | None:
        """The mode of the step running now (fixed when it started); None between steps."""
        return self.current_mode

    def mark_restart(self) -> None:
        """This episode cannot be captured: it starts over after a crash (sticky)."""
        self.restart = True
        self.changed()

    def changed(self) -> None:
        """Tell the watcher (if any) that the step's mode or the restart mark changed."""
        if self.watcher is not None:
            self.watcher(self)

    def record(self) -> dict[str, Any]:
        """``{episode_id, task_digest, boundary}``; boundary null before the first step completes.

        The boundary's state is recorded without token arrays (records never carry them).
        """
        boundary = None if self.boundary.index == 0 else without_token_arrays(self.boundary.to_json())
        return {"episode_id": self.identity.to_json(), "task_digest": self.task_digest, "boundary": boundary}


# ---- running -------------------------------------------------------------------------------------


class EpisodeHooks(Protocol):
    """Called by ``run_episode`` around every step; checkpointing parks episodes here."""

    async def entering(self, episode: Episode, step: Step) -> None: ...

    async def at_boundary(self, episode: Episode) -> None: ...


class _NoHooks:
    async def entering(self, episode: Episode, step: Step) -> None:
        return None

    async def at_boundary(self, episode: Episode) -> None:
        return None


NO_HOOKS: EpisodeHooks = _NoHooks()


class MonotonicClock:
    """``time.monotonic`` as a ``Clock``: a budget's default time, immune to wall-clock steps."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep_until(self, ts: float) -> None:
        while (remaining := ts - time.monotonic()) > 0:
            await asyncio.sleep(remaining)


MONOTONIC_CLOCK = MonotonicClock()


@dataclass
class StepBudget:
    """An episode's timeout, charged only with time spent inside steps (never parked time).

    Time is what ``clock`` counts: a step is charged ``clock.now()`` at its end minus at its start,
    and fails once it would be charged more than ``remaining()`` (it wakes on ``clock.sleep_until``).
    """

    timeout_s: float | None
    clock: Clock = MONOTONIC_CLOCK
    spent_s: float = 0.0

    def remaining(self) -> float | None:
        return None if self.timeout_s is None else max(self.timeout_s - self.spent_s, 0.0)

    def watch(self, timer: asyncio.Timeout, started: float) -> asyncio.Task[None] | None:
        """Expire ``timer`` once the step started at ``started`` has used up the budget (cancel it
        when the step ends); ``None`` without a timeout."""
        remaining = self.remaining()
        if remaining is None:
            return None
        if remaining <= 0:
            timer.reschedule(asyncio.get_running_loop().time())
            return None
        return asyncio.create_task(_expire(timer, self.clock, started + remaining))


async def _expire(timer: asyncio.Timeout, clock: Clock, deadline: float) -> None:
    await clock.sleep_until(deadline)
    timer.reschedule(asyncio.get_running_loop().time())


def step_error(step: str, error: GymError) -> GymError:
    """The error a failed step answers: the cause's class, its detail prefixed with the step.

    A peer's 500 is the peer's bug, so it is passed on as ``upstream_error``, not as our own 500. A
    peer's 429 (``capacity_exceeded``: busy) is passed on as ``unavailable`` (503), never as our own
    429, which says that nothing started: this episode did, and its request must not be sent again
    as if it had not (docs/protocol.md, the error table).
    """
    if isinstance(error, Overloaded):
        return Unavailable(f"step {step} failed: a peer was busy after the episode started "
                           f"({error.code}): {error.detail}", step=step)
    cls = UpstreamError if isinstance(error, InternalError) else type(error)
    return cls(f"step {step} failed: {error.detail}", step=step)


def _unwritable_state(step: Step, error: orjson.JSONEncodeError) -> GymError:
    """The error of a step that left a state that cannot be written: a value of a type JSON has not
    is the program's bug; anything else (nesting too deep) came from a peer's answer."""
    if "not JSON serializable" in str(error):
        return InternalError(f"step {step.name} left a state that is not JSON data: {error}", step=step.name)
    return UpstreamError(f"step {step.name} failed: what a peer answered left a state that cannot be "
                         f"written as JSON ({error})", step=step.name)


async def _run_step(episode: Episode, step: Step, budget: StepBudget, record_levels: int) -> None:
    episode.state = episode.boundary.state()
    episode.current_mode = step.mode_for(episode.state)
    episode.current = step
    episode.changed()
    started = budget.clock.now()
    timer = asyncio.timeout(None)
    try:
        async with timer:
            watchdog = budget.watch(timer, started)
            try:
                next_step = await step.action(episode)
            finally:
                if watchdog is not None:
                    watchdog.cancel()
    except TimeoutError:
        if not timer.expired():
            raise
        raise UpstreamTimeout(
            f"step {step.name} failed: the episode timeout of {budget.timeout_s:g} s ran out", step=step.name
        ) from None
    except GymError as error:
        raise step_error(step.name, error) from error
    finally:
        budget.spent_s += budget.clock.now() - started
        episode.current = None
        episode.current_mode = None
        episode.changed()
    try:
        episode.boundary = episode.boundary.advance(next_step, episode.state, record_levels)
    except orjson.JSONEncodeError as error:
        raise _unwritable_state(step, error) from None


async def _clean_up(program: Program, episode: Episode, timeout_s: float) -> None:
    if program.cleanup is None:
        return
    try:
        async with asyncio.timeout(timeout_s):
            await program.cleanup(episode)
    except (GymError, TimeoutError) as error:
        logger.warning("cleanup of episode %s failed: %r", episode.identity.capture_key, error)


async def run_episode(
    program: Program,
    episode: Episode,
    *,
    hooks: EpisodeHooks = NO_HOOKS,
    budget: StepBudget | None = None,
    cleanup_timeout_s: float = 30.0,
    record_levels: int = 0,
) -> dict[str, Any]:
    """Run ``episode`` from its boundary to the end and answer the final state.

    A step that fails raises its error (named after the step, see ``step_error``); on failure or
    cancellation the program's cleanup runs first, bounded by ``cleanup_timeout_s``. Each boundary's
    state must be writable as JSON ``record_levels`` levels deeper (what records it wraps it in).
    """
    budget = budget or StepBudget(None)
    finished = False
    try:
        while (name := episode.boundary.next_step) is not None:
            step = program.step(name)
            await hooks.entering(episode, step)
            await _run_step(episode, step, budget, record_levels)
            await hooks.at_boundary(episode)
        finished = True
    finally:
        if not finished:
            await _clean_up(program, episode, cleanup_timeout_s)
    return episode.boundary.state()
