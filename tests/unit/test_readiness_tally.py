"""The environment's readiness, kept as its episodes move (``ReadinessTally``), is what a walk over
every live episode finds: the same blockers, restarts and counts, whatever the episodes do (enter a
``wait`` or a ``replay`` step, leave it, get marked a restart inside it, park during a checkpoint,
fail, or finish)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_ckpt.checkpoint.models import ControlRequest
from nemo_gym_ckpt.checkpoint.participant import Participant
from nemo_gym_ckpt.checkpoint.store import CheckpointStore
from nemo_gym_ckpt.environment.adapter import EpisodesAdapter, RunLimits
from nemo_gym_ckpt.environment.episode import Episode, Program, Step
from nemo_gym_ckpt.errors import GymError, InvalidRequest
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.testing.clock import FakeClock

pytestmark = pytest.mark.unit

EPISODES = 24
NEXT = {"first": "check", "check": "last", "last": None}
MOVES = 400


class Gates:
    """Each episode's step waits for the test to let it go (and be told how: on, restart, fail)."""

    def __init__(self) -> None:
        self.waiting: dict[str, asyncio.Future[str]] = {}

    async def step(self, episode: Episode) -> str | None:
        how = await self.waiting.setdefault(episode.identity.capture_key, asyncio.get_running_loop().create_future())
        del self.waiting[episode.identity.capture_key]
        if how == "restart":
            episode.mark_restart()
            return await self.step(episode)  # still inside the step, now a restart
        if how == "fail":
            raise InvalidRequest("the step failed")
        assert episode.current is not None
        return NEXT[episode.current.name]


def walked(adapter: EpisodesAdapter) -> tuple[list[str], list[str], dict[str, int]]:
    """What the readiness was before the tally: one pass over every live episode."""
    blockers, restarts = [], []
    counts = {"episodes": len(adapter.live), "parked": 0, "in_wait_step": 0, "in_replay_step": 0, "restarts": 0,
              "installed": len(adapter.installed)}
    for key, live in adapter.live.items():
        mode = live.episode.current_mode
        counts["parked"] += live.parked
        counts["in_wait_step"] += mode == "wait"
        counts["in_replay_step"] += mode == "replay"
        if live.episode.restart:
            counts["restarts"] += 1
            restarts.append(key)
        elif mode == "wait":
            blockers.append(key)
    return sorted(blockers), sorted(restarts), counts


async def settled() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def prepared(participant: Participant, clock: FakeClock, checkpoint_id: str) -> None:
    """A prepare given 10 ms: it answers ready, or not ready once the clock has moved past them."""
    prepare = asyncio.create_task(participant.prepare(ControlRequest(checkpoint_id=checkpoint_id,
                                                                     deadline_ts=clock.now() + 0.01)))
    await settled()
    clock.advance(0.01)
    await prepare


async def test_the_tally_answers_what_a_walk_over_every_episode_finds(root: Path) -> None:
    gates, rng = Gates(), random.Random(7)
    program = Program.of([Step("first", gates.step, "replay"), Step("check", gates.step, "wait"),
                          Step("last", gates.step, "replay")])
    adapter = EpisodesAdapter(program, RunLimits(None, 5.0))
    clock = FakeClock()  # a prepare's short deadline passes when the test says, not when a busy machine does
    participant = Participant(kind="environment", instance="e", adapter=adapter, store=CheckpointStore(root),
                              lease_grace_s=600.0, clock=clock)
    adapter.participant = participant
    runs: list[asyncio.Task[Any]] = []
    open_id: str | None = None
    compared, seen = 0, set()
    for move in range(MOVES):
        choice = rng.random()
        if choice < 0.3 and len(adapter.live) < EPISODES:  # while a checkpoint is open: waits to start
            identity = RolloutIdentity(f"r{len(runs)}")
            runs.append(asyncio.create_task(adapter.run(identity, {"n": len(runs)})))
        elif choice < 0.36:
            if open_id is None:
                open_id = f"c{move}"
                await prepared(participant, clock, open_id)
            else:
                await participant.resume(ControlRequest(checkpoint_id=open_id, deadline_ts=clock.now() + 60))
                open_id = None
        elif gates.waiting:
            key = rng.choice(sorted(gates.waiting))
            gates.waiting[key].set_result(rng.choices(["on", "restart", "fail"], [8, 1, 1])[0])
        await settled()
        tallied = await adapter.readiness()
        assert (sorted(tallied.blockers), sorted(tallied.restarts), dict(tallied.counts)) == walked(adapter)
        compared += 1
        seen.update(what for what, count in (("parked", tallied.counts["parked"]), ("blockers", len(tallied.blockers)),
                                             ("restarts", len(tallied.restarts))) if count)
    if open_id is not None:
        await participant.resume(ControlRequest(checkpoint_id=open_id, deadline_ts=clock.now() + 60))
    while gates.waiting:
        for future in list(gates.waiting.values()):
            future.set_result("on")
        await settled()
    results = await asyncio.gather(*runs, return_exceptions=True)
    assert all(isinstance(result, dict | GymError) for result in results)
    assert not adapter.live and walked(adapter) == ([], [], {**walked(adapter)[2]})
    assert adapter.tally.readiness(0, 0, with_lists=True).counts == {
        "episodes": 0, "parked": 0, "in_wait_step": 0, "in_replay_step": 0, "restarts": 0, "installed": 0}
    assert compared == MOVES and any(isinstance(result, GymError) for result in results)
    assert seen == {"parked", "blockers", "restarts"}  # the moves reached every state the tally counts

