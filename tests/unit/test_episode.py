"""Episodes as named steps: boundaries, failures, cleanup, restore from a boundary, timeouts."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from nemo_gym_ckpt.environment.episode import (
    Boundary,
    Episode,
    Program,
    Step,
    StepBudget,
    run_episode,
    step_error,
    task_digest,
    without_token_arrays,
)
from nemo_gym_ckpt.errors import (
    InternalError,
    InvalidCheckpointState,
    InvalidRequest,
    Overloaded,
    Unavailable,
    UpstreamError,
    UpstreamTimeout,
)
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.testing.clock import FakeClock

pytestmark = pytest.mark.unit

RID = RolloutIdentity("7-0")
TASK = {"responses_create_params": {"input": "count"}, "limit": 3}


class Counter:
    """A three-step program: start, tick (repeats up to the task's limit), finish."""

    def __init__(self, fail_at: int | None = None, error: Exception | None = None) -> None:
        self.runs: list[str] = []
        self.cleanups = 0
        self.fail_at = fail_at
        self.error = error or InvalidRequest("no")
        self.program = Program.of(
            [Step("start", self.start, "replay"), Step("tick", self.tick, self.tick_mode),
             Step("finish", self.finish, "replay")],
            cleanup=self.cleanup,
        )

    @staticmethod
    def tick_mode(state: Any) -> Any:
        return "wait" if state.get("count", 0) % 2 else "replay"

    async def start(self, episode: Episode) -> str:
        self.runs.append("start")
        episode.state["count"] = 0
        return "tick"

    async def tick(self, episode: Episode) -> str:
        self.runs.append("tick")
        episode.state["count"] += 1
        if episode.state["count"] == self.fail_at:
            raise self.error
        return "tick" if episode.state["count"] < episode.task["limit"] else "finish"

    async def finish(self, episode: Episode) -> None:
        self.runs.append("finish")
        episode.state["result"] = {"count": episode.state["count"]}
        return None

    async def cleanup(self, episode: Episode) -> None:
        self.cleanups += 1


class Recorder:
    """Hooks that record where the episode was at each call."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    async def entering(self, episode: Episode, step: Step) -> None:
        self.events.append(("enter", (step.name, step.mode_for(episode.boundary.state()))))

    async def at_boundary(self, episode: Episode) -> None:
        self.events.append(("boundary", (episode.boundary.index, episode.boundary.next_step)))


async def test_steps_run_in_order_with_a_boundary_after_each() -> None:
    counter, hooks = Counter(), Recorder()
    episode = Episode.start(RID, TASK, counter.program)
    final = await run_episode(counter.program, episode, hooks=hooks)
    assert final == {"count": 3, "result": {"count": 3}}
    assert counter.runs == ["start", "tick", "tick", "tick", "finish"]
    boundaries = [value for kind, value in hooks.events if kind == "boundary"]
    assert boundaries == [(1, "tick"), (2, "tick"), (3, "tick"), (4, "finish"), (5, None)]
    modes = [value for kind, value in hooks.events if kind == "enter"]
    assert modes == [("start", "replay"), ("tick", "replay"), ("tick", "wait"), ("tick", "replay"),
                     ("finish", "replay")]
    assert episode.boundary.finished and episode.current is None and counter.cleanups == 0


async def test_a_failed_step_stays_at_the_previous_boundary_and_cleans_up() -> None:
    counter = Counter(fail_at=2)
    episode = Episode.start(RID, TASK, counter.program)
    with pytest.raises(InvalidRequest, match="step tick failed: no") as caught:
        await run_episode(counter.program, episode)
    assert caught.value.fields == {"step": "tick"}
    assert episode.boundary.index == 2 and episode.boundary.next_step == "tick"
    assert episode.boundary.state() == {"count": 1}  # the half-done tick left nothing behind
    assert counter.cleanups == 1


async def test_a_peers_internal_error_is_passed_on_as_upstream_error() -> None:
    counter = Counter(fail_at=1, error=InternalError("boom"))
    with pytest.raises(UpstreamError, match="step tick failed: boom"):
        await run_episode(counter.program, Episode.start(RID, TASK, counter.program))


async def test_a_bug_in_a_step_is_not_disguised() -> None:
    counter = Counter(fail_at=1, error=KeyError("count"))
    with pytest.raises(KeyError):
        await run_episode(counter.program, Episode.start(RID, TASK, counter.program))
    assert counter.cleanups == 1


async def test_restored_episode_continues_at_its_boundary_without_redoing_steps() -> None:
    reference = await run_episode(Counter().program, Episode.start(RID, TASK, Counter().program))
    first = Counter(fail_at=3)
    episode = Episode.start(RID, TASK, first.program)
    with pytest.raises(InvalidRequest):
        await run_episode(first.program, episode)
    saved = Boundary.from_json(episode.record()["boundary"])
    second = Counter()
    restored = Episode.from_boundary(RID.next_attempt(), TASK, saved, second.program)
    assert await run_episode(second.program, restored) == reference
    assert second.runs == ["tick", "finish"]


async def test_cancellation_runs_the_cleanup() -> None:
    started = asyncio.Event()

    async def hang(episode: Episode) -> str:
        started.set()
        await asyncio.Event().wait()
        return "never"

    cleaned: list[str] = []

    async def cleanup(episode: Episode) -> None:
        cleaned.append(episode.identity.capture_key)

    program = Program.of([Step("hang", hang, "wait")], cleanup=cleanup)
    episode = Episode.start(RID, TASK, program)
    task = asyncio.create_task(run_episode(program, episode))
    async with asyncio.timeout(5):
        await started.wait()
    assert episode.mode == "wait" and episode.current is not None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == ["7-0"] and episode.current is None


async def test_the_timeout_counts_time_in_steps_only() -> None:
    clock = FakeClock(0.0)

    async def step(episode: Episode) -> str | None:
        clock.advance(1.0)
        episode.state["n"] = episode.state.get("n", 0) + 1
        return None if episode.state["n"] == 5 else "step"

    class SlowHooks(Recorder):
        async def at_boundary(self, episode: Episode) -> None:
            clock.advance(100.0)  # a parked episode: not charged

    program = Program.of([Step("step", step, "replay")])
    budget = StepBudget(10.0, clock=clock)
    await run_episode(program, Episode.start(RID, TASK, program), hooks=SlowHooks(), budget=budget)
    assert budget.spent_s == 5.0 and budget.remaining() == 5.0


async def test_a_step_past_the_episode_timeout_fails_with_upstream_timeout() -> None:
    async def slow(episode: Episode) -> str:
        await asyncio.sleep(30)
        return "slow"

    program = Program.of([Step("slow", slow, "replay")])
    with pytest.raises(UpstreamTimeout, match=r"step slow failed: the episode timeout of 0\.05 s ran out"):
        await run_episode(program, Episode.start(RID, TASK, program), budget=StepBudget(0.05))


async def test_the_timeout_fires_on_the_budget_clock_while_a_step_waits() -> None:
    clock = FakeClock(0.0)
    waiting = asyncio.Event()

    async def wait(episode: Episode) -> str:
        clock.advance(4.0)
        waiting.set()
        await asyncio.Event().wait()  # a peer that never answers
        return "wait"

    program = Program.of([Step("wait", wait, "replay")])
    budget = StepBudget(10.0, clock=clock)
    run = asyncio.create_task(run_episode(program, Episode.start(RID, TASK, program), budget=budget))
    async with asyncio.timeout(5):
        await waiting.wait()
        while clock.sleepers == 0:  # the budget's watchdog sleeps on the clock
            await asyncio.sleep(0)
    clock.advance(5.9)
    await asyncio.sleep(0)
    assert not run.done()
    clock.advance(0.1)  # 10 s charged: the timeout
    with pytest.raises(UpstreamTimeout, match=r"step wait failed: the episode timeout of 10 s ran out"):
        await asyncio.wait_for(run, 5)
    assert budget.spent_s == 10.0 and budget.remaining() == 0.0


async def test_a_step_starting_with_nothing_left_fails_at_its_first_await() -> None:
    clock = FakeClock(0.0)
    ran: list[str] = []

    async def step(episode: Episode) -> str:
        ran.append(episode.boundary.next_step or "")
        clock.advance(6.0)
        await asyncio.sleep(0)
        return "step"

    program = Program.of([Step("step", step, "replay")])
    with pytest.raises(UpstreamTimeout, match="episode timeout of 10 s"):
        await run_episode(program, Episode.start(RID, TASK, program), budget=StepBudget(10.0, clock=clock))
    # 6 s, then 6 more: the second step ended before its timeout could fire; the third starts with
    # nothing left and fails at its first await (without the check it would complete too)
    assert len(ran) == 3


async def test_state_that_is_not_json_is_a_bug() -> None:
    async def bad(episode: Episode) -> None:
        episode.state["x"] = object()
        return None

    program = Program.of([Step("bad", bad, "replay")])
    with pytest.raises(InternalError, match="not JSON data"):
        await run_episode(program, Episode.start(RID, TASK, program))


async def test_unknown_next_step_and_bad_mode_are_bugs() -> None:
    async def lost(episode: Episode) -> str:
        return "nowhere"

    program = Program.of([Step("lost", lost, "replay")])
    with pytest.raises(InternalError, match="no step named 'nowhere'"):
        await run_episode(program, Episode.start(RID, TASK, program))
    with pytest.raises(InternalError, match="mode"):
        Step("odd", lost, lambda state: "sometimes").mode_for({})  # type: ignore[arg-type,return-value]


def test_program_needs_unique_step_names() -> None:
    async def noop(episode: Episode) -> None:
        return None

    with pytest.raises(ValueError, match="unique"):
        Program.of([Step("a", noop), Step("a", noop)])
    with pytest.raises(ValueError):
        Program.of([])


def test_record_and_boundary_round_trip() -> None:
    counter = Counter()
    episode = Episode.start(RID, TASK, counter.program)
    record = episode.record()
    assert record == {"episode_id": {"rollout_id": "7-0", "attempt": 0}, "task_digest": task_digest(TASK),
                      "boundary": None}
    boundary = Boundary(2, "tick", b'{"count":1}')
    assert Boundary.from_json(boundary.to_json()) == boundary
    assert task_digest({"b": 1, "a": [1, 2]}) == task_digest({"a": [1, 2], "b": 1})
    assert task_digest({"a": 1}) != task_digest({"a": 2})


@pytest.mark.parametrize(
    "data",
    [None, [], {"index": 1}, {"index": -1, "next_step": "a", "state": {}},
     {"index": True, "next_step": "a", "state": {}}, {"index": 1, "next_step": 3, "state": {}},
     {"index": 1, "next_step": "a", "state": []}, {"index": 1, "next_step": "a", "state": {}, "x": 1}],
)
def test_malformed_boundaries_are_invalid_checkpoint_state(data: Any) -> None:
    with pytest.raises(InvalidCheckpointState):
        Boundary.from_json(data)


def test_a_boundary_naming_a_missing_step_is_refused() -> None:
    counter = Counter()
    with pytest.raises(InvalidCheckpointState, match="'gone'"):
        Episode.from_boundary(RID, TASK, Boundary(1, "gone", b"{}"), counter.program)


async def test_the_mode_is_fixed_when_the_step_starts() -> None:
    seen: list[Any] = []

    async def flip(episode: Episode) -> None:
        episode.state["count"] = 1  # would make tick_mode answer "wait" if read again
        seen.append(episode.mode)
        return None

    program = Program.of([Step("flip", flip, Counter.tick_mode)])
    episode = Episode.start(RID, TASK, program)
    await run_episode(program, episode)
    assert seen == ["replay"] and episode.mode is None


def test_records_leave_token_arrays_out_and_the_boundary_keeps_them() -> None:
    item = {"type": "message", "text": "hi", "generation_token_ids": [1, 2], "prompt_token_ids": [3],
            "generation_log_probs": [-0.1, -0.2], "policy_version": 4}
    state = {"response": {"output": [item, {"nested": {"token_ids": [5], "logprobs": [0.0]}}]}}
    episode = Episode(RID, TASK, Boundary(1, "next", b"{}").advance("next", state))
    recorded = episode.record()["boundary"]["state"]
    assert recorded == {"response": {"output": [{"type": "message", "text": "hi", "policy_version": 4},
                                                {"nested": {}}]}}
    assert episode.boundary.state() == state  # the boundary in memory keeps everything
    assert without_token_arrays([{"token_ids": [1]}, "token_ids", 3]) == [{}, "token_ids", 3]


def test_a_restart_mark_is_sticky() -> None:
    episode = Episode.start(RID, TASK, Counter().program)
    assert episode.restart is False
    episode.mark_restart()
    episode.mark_restart()
    assert episode.restart is True


def _deep(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels - 1):
        value = {"d": value}
    return value  # ``levels`` levels of JSON


def _keeping(levels: int) -> Program:
    """One step that keeps an answer ``levels`` levels deep under the state (a peer's, say)."""

    async def keep(episode: Episode) -> None:
        episode.state["answer"] = _deep(levels)
        return None

    return Program.of([Step("keep", keep, "replay")])


@pytest.mark.parametrize(("levels", "record_levels"), [(254, 0), (252, 2)])
async def test_a_state_too_deep_to_keep_fails_its_step_as_an_upstream_error(levels: int, record_levels: int) -> None:
    """254 levels under the state is one more than the state can hold (500 before); 252 fits the
    state but not a record (two more levels): the record's encoding failed later, as a 500."""
    program = _keeping(levels - 1)
    assert (await run_episode(program, Episode.start(RID, TASK, program), record_levels=record_levels))["answer"]
    program = _keeping(levels)
    with pytest.raises(UpstreamError, match=r"step keep failed: .*cannot be written as JSON") as raised:
        await run_episode(program, Episode.start(RID, TASK, program), record_levels=record_levels)
    assert raised.value.fields["step"] == "keep"


def test_a_saved_boundary_is_refused_when_it_cannot_be_written_again() -> None:
    with pytest.raises(InvalidCheckpointState, match="index"):
        Boundary.from_json({"index": 2**63, "next_step": None, "state": {}})
    assert Boundary.from_json({"index": 2**63 - 1, "next_step": "x", "state": _deep(252)}, 2).index == 2**63 - 1
    with pytest.raises(InvalidCheckpointState, match="written again"):
        Boundary.from_json({"index": 1, "next_step": "x", "state": _deep(253)}, 2)


def test_a_peer_busy_inside_a_step_is_unavailable_never_a_refusal_up_front() -> None:
    error = step_error("act", Overloaded("busy", retry_after_s=30))
    assert type(error) is Unavailable and error.status == 503 and error.fields["step"] == "act"
    assert error.headers() == {} and "busy" in error.detail


def test_a_finished_boundary_must_hold_its_result() -> None:
    program = _keeping(1)
    program.check_state("keep", {})  # no check of its own: any state
    program.check_state(None, {"result": {}})
    with pytest.raises(ValueError, match="result"):
        program.check_state(None, {})
