"""Environment servers as checkpoint participants, in process.

The conformance suite on both environment servers; off mounts nothing; parking at boundaries;
wait and replay steps; restart classification from the seed reply and from the agent; retire and
forget; task digest and attempt checks at ``/run``; parked time not charged; and whole rollouts
checkpointed mid-episode, "crashed" (every app dropped), restored on fresh apps and continued as
the next attempt, with the same rows as an uninterrupted run and no model or tool call made twice.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI, Request, Response

from model_servers.inference_worker.default_model_data import make_problem
from nemo_gym_ckpt.capture import without_token_arrays
from nemo_gym_ckpt.checkpoint.headers import CLOSE_HEADER
from nemo_gym_ckpt.checkpoint.models import ControlRequest
from nemo_gym_ckpt.checkpoint.participant import Participant
from nemo_gym_ckpt.checkpoint.records import Record
from nemo_gym_ckpt.checkpoint.store import CheckpointStore
from nemo_gym_ckpt.config import CheckpointConfig
from nemo_gym_ckpt.environment.adapter import EpisodesAdapter, RunLimits
from nemo_gym_ckpt.environment.episode import Episode, Program, Step, task_digest
from nemo_gym_ckpt.errors import UpstreamTimeout
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.server import create_app
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.conformance import CHECKS, Control, ParticipantUnderTest
from nemo_gym_ckpt.testing.environments import GateAgent
from nemo_gym_ckpt.testing.placement import InProcess, Stack, under_test
from tests.support.episode_participants import ENVIRONMENTS, TOKEN, WAIT_S, checkpoint_config, env_row, env_stack
from tests.support.rollout_mesh import (
    DeterministicModel,
    RolloutMesh,
    calculator_answers,
    calculator_row,
    nim_moves,
    nim_row,
    rollout_mesh,
)

pytestmark = pytest.mark.unit

AUTH = {"authorization": f"Bearer {TOKEN}"}
PROBLEMS = [make_problem(random.Random(seed)) for seed in range(4)]


# ---- harness ---------------------------------------------------------------------------------


@asynccontextmanager
async def started(
    implementation: str, root: Path, clock: FakeClock, *, enabled: bool = True, **kwargs: Any
) -> AsyncIterator[tuple[Stack, ParticipantUnderTest]]:
    placement = InProcess()
    config = checkpoint_config(root) if enabled else CheckpointConfig()
    async with (
        env_stack(implementation, placement, config, clock, **kwargs) as stack,
        under_test(stack, placement, root, clock, TOKEN) as pt,
    ):
        yield stack, pt


async def until(condition: Callable[[], Any], what: str) -> None:
    """Yield to the loop until ``condition()`` holds (a deadline, never a sleep to order events)."""
    deadline = time.monotonic() + WAIT_S
    while not await _value(condition()):
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.001)


async def _value(value: Any) -> Any:
    return await value if asyncio.iscoroutine(value) else value


async def extras(pt: ParticipantUnderTest) -> dict[str, Any]:
    extras: dict[str, Any] = (await Control(pt).status())["extras"]
    return extras


def start_run(pt: ParticipantUnderTest, key: str, row: dict[str, Any]) -> asyncio.Task[httpx.Response]:
    return asyncio.create_task(pt.client.post(f"/ng-rollout/{key}/run", json=row))


# ---- the conformance suite ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CHECKS))
@pytest.mark.parametrize("implementation", ENVIRONMENTS)
async def test_conformance(implementation: str, name: str, root: Path, clock: FakeClock) -> None:
    @asynccontextmanager
    async def make() -> AsyncIterator[ParticipantUnderTest]:
        async with started(implementation, root, clock) as (_, pt):
            yield pt

    await CHECKS[name](make)


# ---- off, identity ----------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ENVIRONMENTS)
async def test_off_mounts_nothing_and_runs_without_identity(
    implementation: str, root: Path, clock: FakeClock
) -> None:
    gate = GateAgent()
    gate.gates.everything = True
    async with started(implementation, root, clock, enabled=False, gate=gate) as (_, pt):
        status = await pt.client.get("/ng-control/v1/checkpoint/status", headers=AUTH)
        assert status.status_code == 404
        reply = await pt.client.post("/run", json=env_row(implementation))
        assert reply.status_code == 200, reply.text
        assert gate.activations[0][0].startswith("anon-")


@pytest.mark.parametrize("implementation", ENVIRONMENTS)
async def test_on_a_run_needs_a_rollout_identity(implementation: str, root: Path, clock: FakeClock) -> None:
    async with started(implementation, root, clock) as (stack, pt):
        reply = await pt.client.post("/run", json=env_row(implementation))
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "rollout_id_required"
        bad = await pt.client.post("/ng-rollout/r1/run", json={"no": "params"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"
        assert stack.server.activations == [] and (await extras(pt))["episodes"] == 0


def nested_dicts(levels: int) -> dict[str, Any]:
    """A JSON object ``levels + 1`` levels deep."""
    value: dict[str, Any] = {}
    for _ in range(levels):
        value = {"d": value}
    return value


@pytest.mark.parametrize("implementation", ENVIRONMENTS)
@pytest.mark.parametrize(("enabled", "deepest"), [(True, 249), (False, 251)])
async def test_a_row_too_deep_for_the_episode_to_keep_is_refused_up_front(
    implementation: str, enabled: bool, deepest: int, root: Path, clock: FakeClock
) -> None:
    """The state wraps a row in one level (its result), a record in two more: a row that fits the
    254 levels of the body but not those was run to its end and answered 500."""
    gate = GateAgent()
    gate.gates.everything = True
    async with started(implementation, root, clock, enabled=enabled, gate=gate) as (_, pt):
        for levels in (deepest, deepest + 1):  # the row is levels + 2 deep
            reply = await pt.client.post(f"/ng-rollout/deep{levels}/run",
                                         json=env_row(implementation, payload=nested_dicts(levels)))
            if levels == deepest:
                assert reply.status_code == 200, reply.text
            else:
                assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_request", reply.text
                assert f"at most {deepest + 2} levels" in reply.json()["error"]["detail"]
        assert [key for key, _ in gate.activations] == [f"deep{deepest}"]  # the refused row started nothing


async def test_off_a_second_run_of_a_running_capture_key_is_refused(root: Path, clock: FakeClock) -> None:
    """docs/protocol.md's error table: 400 whether checkpointing is on or off (both runs shared the
    agent's session of the key: two activations 1, two closes)."""
    gate = GateAgent()
    async with started("single_agent_turn", root, clock, enabled=False, gate=gate) as (_, pt):
        first = start_run(pt, "dup", env_row("single_agent_turn"))
        await until(lambda: ("dup", "1") in gate.activations, "the first run is live")
        reply = await pt.client.post("/ng-rollout/dup/run", json=env_row("single_agent_turn"))
        assert reply.status_code == 400 and "already running" in reply.json()["error"]["detail"]
        gate.gates.everything = True
        for event in gate.gates.events.values():
            event.set()
        assert (await asyncio.wait_for(first, WAIT_S)).status_code == 200
        assert gate.activations.count(("dup", "1")) == 1 and gate.closed.count("dup") == 1
        again = await pt.client.post("/ng-rollout/dup/run", json=env_row("single_agent_turn"))
        assert again.status_code == 200, again.text  # the key is free once its run ended


# ---- parking ----------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ENVIRONMENTS)
async def test_an_episode_reaching_a_boundary_during_a_checkpoint_parks_until_resume(
    implementation: str, root: Path, clock: FakeClock
) -> None:
    async with started(implementation, root, clock) as (stack, pt):
        control, gate = Control(pt), stack.server
        run = start_run(pt, "p1", env_row(implementation))
        await until(lambda: ("p1", "1") in gate.activations, "the activation arrived")
        prepared = await control.ok("prepare", checkpoint_id="c1")
        assert prepared["report"]["ready"] is True  # inside a replay step: not a blocker
        assert prepared["report"]["counts"]["in_replay_step"] == 1
        await stack.helpers["agent"].post("/_test/release/p1")
        await until(lambda: _parked(pt), "the episode parked at its next boundary")
        assert gate.closed == [] and not run.done()  # close_agent (a wait step) was not entered
        await control.ok("resume", checkpoint_id="c1")
        reply = await asyncio.wait_for(run, WAIT_S)
        assert reply.status_code == 200, reply.text
        assert gate.closed == ["p1"] and (await extras(pt))["episodes"] == 0


async def test_a_commit_looks_up_the_record_encoded_when_the_episode_reached_its_boundary(
    root: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    encoded: list[dict[str, Any]] = []
    from_data = Record.from_data.__func__  # type: ignore[attr-defined]

    def counted(cls: type[Record], data: dict[str, Any]) -> Record:
        encoded.append(dict(data))
        return from_data(cls, data)  # type: ignore[no-any-return]

    monkeypatch.setattr(Record, "from_data", classmethod(counted))
    async with started("single_agent_turn", root, clock) as (stack, pt):
        control, gate = Control(pt), stack.server
        run = start_run(pt, "p1", env_row("single_agent_turn"))
        await until(lambda: ("p1", "1") in gate.activations, "the activation arrived")
        before = len(encoded)
        assert before >= 1  # on the data plane, as the episode entered its steps
        await control.ok("prepare", checkpoint_id="c1")
        committed = await control.ok("commit", checkpoint_id="c1", checkpoint_dir=str(root / "c1"))
        assert committed["episode_ids"] == ["p1"] and len(encoded) == before
        await control.ok("resume", checkpoint_id="c1")
        await stack.helpers["agent"].post("/_test/release/p1")
        assert (await asyncio.wait_for(run, WAIT_S)).status_code == 200


async def _parked(pt: ParticipantUnderTest) -> bool:
    return bool((await extras(pt))["parked"] == 1)


async def test_a_new_run_waits_while_a_checkpoint_is_open(root: Path, clock: FakeClock) -> None:
    async with started("nim", root, clock) as (stack, pt):
        control = Control(pt)
        await control.ok("prepare", checkpoint_id="c1")
        run = start_run(pt, "late", env_row("nim"))
        await until(lambda: _waiting(pt), "the run waits for resume")
        assert stack.server.activations == []
        await control.ok("resume", checkpoint_id="c1")
        await stack.helpers["agent"].post("/_test/release/late")
        assert (await asyncio.wait_for(run, WAIT_S)).status_code == 200


async def _waiting(pt: ParticipantUnderTest) -> bool:
    return bool((await Control(pt).status())["waiting_requests"] == 1)


# ---- verify modes and restarts (a resources server announcing them) -----------------------------


class AnnouncingResources:
    """The resources routes an environment calls, announcing ``verify`` / ``restart`` at seed time
    and holding ``/verify`` until ``released`` is set."""

    def __init__(self, verify: str, restart: bool = False) -> None:
        self.verify, self.restart = verify, restart
        self.released = asyncio.Event()
        self.verifying = 0

    def app(self) -> FastAPI:
        app = create_app("calculator_tools")

        async def seed(request: Request) -> Response:
            headers = {"x-ng-checkpoint-verify": self.verify}
            if self.restart:
                headers["x-ng-checkpoint-restart"] = "1"
            body = orjson.dumps({"session_id": "s1"})
            reply = Response(body, headers=headers, media_type="application/json")
            reply.set_cookie("ng_session_calculator_tools", "s1")
            return reply

        async def verify(request: Request) -> dict[str, Any]:
            self.verifying += 1
            await self.released.wait()
            return {**(await request.json()), "reward": 1.0}

        async def close() -> dict[str, bool]:
            return {"closed": True}

        app.add_api_route("/seed_session", seed, methods=["POST"])
        app.add_api_route("/verify", verify, methods=["POST"])
        app.add_api_route("/close_session", close, methods=["POST"])
        return app


async def test_a_replay_verify_never_blocks_and_a_wait_verify_does(root: Path, clock: FakeClock) -> None:
    for mode in ("replay", "wait"):
        resources = AnnouncingResources(mode)
        async with resources_env(resources, root, clock) as pt:
            control = Control(pt)
            run = start_run(pt, f"v-{mode}", env_row("single_agent_turn"))
            await until(lambda r=resources: r.verifying == 1, "verify is in flight")
            prepare = asyncio.create_task(control.ok("prepare", checkpoint_id="c1"))
            if mode == "wait":
                await until(lambda: _reported(pt), "the prepare reported")
                assert (await control.status())["report"]["blockers"] == [f"v-{mode}"]
                assert not prepare.done()
                resources.released.set()
            prepared = await asyncio.wait_for(prepare, WAIT_S)
            assert prepared["report"]["ready"] is True and prepared["report"]["blockers"] == []
            resources.released.set()
            await control.ok("resume", checkpoint_id="c1")
            assert (await asyncio.wait_for(run, WAIT_S)).status_code == 200


async def _reported(pt: ParticipantUnderTest) -> bool:
    return (await Control(pt).status())["report"] is not None


@asynccontextmanager
async def resources_env(
    resources: AnnouncingResources, root: Path, clock: FakeClock, gate: GateAgent | None = None
) -> AsyncIterator[ParticipantUnderTest]:
    """single_agent_turn (checkpointing on) over ``resources`` and a gate agent that answers at once."""
    gate = gate or GateAgent()
    gate.gates.everything = True
    placement = InProcess()
    config = checkpoint_config(root)
    async with (
        placement.run(resources.app()) as url,
        env_stack("single_agent_turn", placement, config, clock, gate=gate, resources_url=url) as stack,
        under_test(stack, placement, root, clock, TOKEN) as pt,
    ):
        yield pt


async def test_a_restart_only_resources_server_makes_the_episode_a_restart(
    root: Path, clock: FakeClock
) -> None:
    resources = AnnouncingResources("wait", restart=True)
    async with resources_env(resources, root, clock) as pt:
        control = Control(pt)
        run = start_run(pt, "rs", env_row("single_agent_turn"))
        await until(lambda: resources.verifying == 1, "verify (a wait step) is in flight")
        prepared = await control.ok("prepare", checkpoint_id="c1")
        report = prepared["report"]
        assert report["ready"] is True and report["restarts"] == ["rs"] and report["blockers"] == []
        await control.refused("restart_in_scope", "commit", checkpoint_id="c1",
                              checkpoint_dir=str(root / "ck1"), episode_ids=[{"rollout_id": "rs"}])
        await control.ok("resume", checkpoint_id="c1")
        assert (await control.ok("prepare", checkpoint_id="c2"))["report"]["restarts"] == ["rs"]
        resources.released.set()
        reply = await asyncio.wait_for(run, WAIT_S)  # a restart never parks: it ends during the checkpoint
        assert reply.status_code == 200, reply.text
        committed = await control.ok("commit", checkpoint_id="c2", checkpoint_dir=str(root / "ck2"))
        assert committed["manifest"]["record_count"] == 0
        await control.ok("resume", checkpoint_id="c2")


class RestartOnlyGate(GateAgent):
    """A gate agent that declares itself restart-only on every reply."""

    def app(self) -> FastAPI:
        app = super().app()

        @app.middleware("http")
        async def declare(request: Request, call_next: Any) -> Any:
            response = await call_next(request)
            response.headers["x-ng-checkpoint-restart"] = "1"
            return response

        return app


async def test_a_restart_only_agent_makes_episodes_restarts_from_then_on(
    root: Path, clock: FakeClock
) -> None:
    async with started("nim", root, clock, gate=RestartOnlyGate()) as (stack, pt):
        control, agent = Control(pt), stack.helpers["agent"]
        first = start_run(pt, "n1", env_row("nim", nim={"stones": 9, "max_take": 3, "seed": 1}))
        await until(lambda: ("n1", "1") in stack.server.activations, "activation 1 arrived")
        assert (await control.ok("prepare", checkpoint_id="c0"))["report"]["restarts"] == []
        await control.ok("resume", checkpoint_id="c0")
        await agent.post("/_test/release/n1")  # its reply declares the agent restart-only
        await until(lambda: ("n1", "2") in stack.server.activations, "activation 2 arrived")
        second = start_run(pt, "n2", env_row("nim"))
        await until(lambda: ("n2", "1") in stack.server.activations, "the second episode's activation")
        prepared = await control.ok("prepare", checkpoint_id="c1")
        assert sorted(prepared["report"]["restarts"]) == ["n1", "n2"]  # n2: from its first step
        await agent.post("/_test/release_all")
        assert (await asyncio.wait_for(first, WAIT_S)).status_code == 200  # never parked
        assert (await asyncio.wait_for(second, WAIT_S)).status_code == 200
        await control.ok("resume", checkpoint_id="c1")


class ReplayableCloseGate(GateAgent):
    """A gate agent whose activation replies say its ``/close`` may run again, as a checkpointed
    simple agent's do."""

    def app(self) -> FastAPI:
        app = super().app()

        @app.middleware("http")
        async def declare(request: Request, call_next: Any) -> Any:
            response = await call_next(request)
            if request.url.path.endswith("/v1/responses"):
                response.headers[CLOSE_HEADER] = "replay"
            return response

        return app


@pytest.mark.parametrize("implementation", ENVIRONMENTS)
async def test_a_close_the_agent_may_run_again_never_blocks_and_runs_again_after_a_restore(
    implementation: str, root: Path, clock: FakeClock
) -> None:
    directory, scope = root / "ck", [{"rollout_id": "k1"}]
    async with started(implementation, root, clock, gate=ReplayableCloseGate()) as (stack, pt):
        control, agent = Control(pt), stack.helpers["agent"]
        await agent.post("/_test/arm/k1")  # its activations answer at once, its /close is held
        run = start_run(pt, "k1", env_row(implementation))
        await until(lambda: "k1" in stack.server.closed, "the close arrived")
        report = (await control.ok("prepare", checkpoint_id="c1"))["report"]
        assert report["ready"] is True and report["blockers"] == [] and report["counts"]["in_replay_step"] == 1
        await control.ok("commit", checkpoint_id="c1", checkpoint_dir=str(directory), episode_ids=scope)
        await control.ok("resume", checkpoint_id="c1")
        await agent.post("/_test/release/k1")
        assert (await asyncio.wait_for(run, WAIT_S)).status_code == 200
    [records] = directory.rglob("records-*.jsonl")
    [record] = [orjson.loads(line) for line in records.read_bytes().splitlines()]
    assert record["boundary"]["next_step"] == "close_agent"  # exported at the boundary before the close
    fresh = ReplayableCloseGate()
    fresh.gates.everything = True
    async with started(implementation, root, clock, gate=fresh) as (_, pt):
        control = Control(pt)
        await control.ok("restore", checkpoint_id="back", checkpoint_dir=str(directory), episode_ids=scope)
        await control.ok("resume", checkpoint_id="back")
        reply = await pt.client.post("/ng-rollout/k1-a1/run", json=env_row(implementation))
        assert reply.status_code == 200, reply.text
    assert fresh.closed == ["k1-a1"] and fresh.activations == []  # the close ran again, nothing else did


# ---- retire, forget, /run checks ----------------------------------------------------------------


@pytest.mark.parametrize("implementation", ENVIRONMENTS)
async def test_retire_stops_the_episode_waits_for_its_cleanup_and_frees_it(
    implementation: str, root: Path, clock: FakeClock
) -> None:
    async with started(implementation, root, clock) as (stack, pt):
        control, gate = Control(pt), stack.server
        run = start_run(pt, "x", env_row(implementation))
        await until(lambda: ("x", "1") in gate.activations, "the episode is inside invoke_agent")
        assert (await extras(pt))["episodes"] == 1
        await control.ok("retire", checkpoint_id="h1", episode_ids=[{"rollout_id": "x"}])
        assert gate.closed == ["x"]  # the cleanup ran before retire answered
        reply = await asyncio.wait_for(run, WAIT_S)
        assert reply.status_code == 409 and reply.json()["error"]["code"] == "stale_attempt"
        status = await control.status()
        assert status["extras"]["episodes"] == 0 and status["retired_rollouts"] == 1
        again = await pt.client.post("/ng-rollout/x/run", json=env_row(implementation))
        assert again.json()["error"]["code"] == "stale_attempt"
        await control.ok("forget", checkpoint_id="h2", rollout_ids=["x"])
        status = await control.status()
        assert status["retired_rollouts"] == 0 and status["extras"]["episodes"] == 0


async def test_a_second_run_of_a_live_episode_is_refused(root: Path, clock: FakeClock) -> None:
    async with started("nim", root, clock) as (stack, pt):
        start_run(pt, "d", env_row("nim"))
        await until(lambda: ("d", "1") in stack.server.activations, "the first run is live")
        reply = await pt.client.post("/ng-rollout/d/run", json=env_row("nim"))
        assert reply.status_code == 400 and "already running" in reply.json()["error"]["detail"]


# ---- parked time is not charged ---------------------------------------------------------------


def _budgeted(program: Program, root: Path, clock: FakeClock, timeout_s: float = 5.0) -> tuple[
        EpisodesAdapter, Participant]:
    """An environment adapter over ``program`` with an episode timeout, on the fake clock."""
    adapter = EpisodesAdapter(program, RunLimits(timeout_s, 1.0))
    participant = Participant(kind="environment", instance="env", adapter=adapter,
                              store=CheckpointStore(root), lease_grace_s=600.0, clock=clock)
    adapter.participant = participant
    return adapter, participant


async def _finish(episode: Episode) -> None:
    await asyncio.sleep(0)  # a step that yields: a timeout already due fires here
    episode.state["result"] = {"ok": True}
    return None


async def test_parked_time_is_not_charged_to_the_episode_timeout(root: Path, clock: FakeClock) -> None:
    go = asyncio.Event()

    async def first(episode: Episode) -> str:
        await go.wait()
        clock.advance(1.0)
        return "second"

    program = Program.of([Step("first", first, "wait"), Step("second", _finish, "wait")])
    adapter, participant = _budgeted(program, root, clock)
    run = asyncio.create_task(adapter.run(RolloutIdentity("t"), {"responses_create_params": {"input": "x"}}))
    await until(lambda: "t" in adapter.live and adapter.live["t"].episode.mode == "wait", "in the first step")
    request = ControlRequest(checkpoint_id="c1", deadline_ts=clock.now() + 3000)
    prepare = asyncio.create_task(participant.prepare(request))
    go.set()
    assert (await asyncio.wait_for(prepare, WAIT_S))["report"]["ready"] is True
    assert adapter.live["t"].parked
    clock.advance(1000.0)  # a long checkpoint, parked at the boundary after the first step
    await participant.resume(request)
    assert (await asyncio.wait_for(run, WAIT_S))["result"] == {"ok": True}
    await participant.aclose()


async def test_a_replay_step_waiting_on_a_parked_peer_is_not_charged_while_the_checkpoint_is_open(
    root: Path, clock: FakeClock
) -> None:
    answered = asyncio.Event()  # the peer (an agent, the policy model) answers after the resume

    async def call_peer(episode: Episode) -> str:
        clock.advance(2.0)
        await answered.wait()
        return "finish"

    program = Program.of([Step("call_peer", call_peer, "replay"), Step("finish", _finish, "replay")])
    adapter, participant = _budgeted(program, root, clock)
    run = asyncio.create_task(adapter.run(RolloutIdentity("t"), {"responses_create_params": {"input": "x"}}))
    await until(lambda: "t" in adapter.live and adapter.live["t"].episode.mode == "replay", "in the step")
    request = ControlRequest(checkpoint_id="c1", deadline_ts=clock.now() + 3000)
    prepared = await asyncio.wait_for(participant.prepare(request), WAIT_S)
    assert prepared["report"]["ready"] is True and prepared["report"]["counts"]["in_replay_step"] == 1
    await until(lambda: adapter.budget_clock.paused, "the budget stands still")
    clock.advance(1000.0)  # the checkpoint stays open far longer than the episode's whole timeout
    await asyncio.sleep(0)
    await participant.resume(request)
    await until(lambda: not adapter.budget_clock.paused, "the budget runs again")
    clock.advance(2.5)  # 2 + 2.5 s charged: still within the 5 s
    await asyncio.sleep(0)
    answered.set()
    assert (await asyncio.wait_for(run, WAIT_S))["result"] == {"ok": True}
    await participant.aclose()


async def test_a_lease_that_runs_out_ends_the_pause(root: Path, clock: FakeClock) -> None:
    async def call_peer(episode: Episode) -> str:
        await asyncio.Event().wait()  # a peer that never answers
        return "finish"

    program = Program.of([Step("call_peer", call_peer, "replay"), Step("finish", _finish, "replay")])
    adapter, participant = _budgeted(program, root, clock, timeout_s=100.0)
    run = asyncio.create_task(adapter.run(RolloutIdentity("t"), {"responses_create_params": {"input": "x"}}))
    await until(lambda: "t" in adapter.live and adapter.live["t"].episode.mode == "replay", "in the step")
    request = ControlRequest(checkpoint_id="c1", deadline_ts=clock.now() + 10)
    await asyncio.wait_for(participant.prepare(request), WAIT_S)
    await until(lambda: adapter.budget_clock.paused, "the budget stands still")
    clock.advance(610.0)  # deadline + grace: the controller is gone, the lease runs out
    await until(lambda: participant.checkpoint_id is None and not adapter.budget_clock.paused,
                "the lease ran out and the budget runs again")
    clock.advance(99.0)
    for _ in range(10):
        await asyncio.sleep(0)
    assert not run.done()  # 99 s charged
    clock.advance(1.0)
    with pytest.raises(UpstreamTimeout, match="the episode timeout of 100 s ran out"):
        await asyncio.wait_for(run, WAIT_S)
    await participant.aclose()


async def test_a_replay_step_waiting_with_no_checkpoint_open_is_charged(root: Path, clock: FakeClock) -> None:
    async def call_peer(episode: Episode) -> str:
        await asyncio.Event().wait()  # a peer that never answers
        return "finish"

    program = Program.of([Step("call_peer", call_peer, "replay"), Step("finish", _finish, "replay")])
    adapter, participant = _budgeted(program, root, clock)
    run = asyncio.create_task(adapter.run(RolloutIdentity("t"), {"responses_create_params": {"input": "x"}}))
    await until(lambda: "t" in adapter.live and adapter.live["t"].episode.mode == "replay", "in the step")
    clock.advance(5.0)
    with pytest.raises(UpstreamTimeout, match="step call_peer failed: the episode timeout of 5 s ran out"):
        await asyncio.wait_for(run, WAIT_S)
    await participant.aclose()


async def test_time_inside_steps_is_still_charged(root: Path, clock: FakeClock) -> None:
    async def slow(episode: Episode) -> str:
        clock.advance(10.0)
        await asyncio.sleep(0)  # a step that yields: the timeout can fire here
        return "slow"

    program = Program.of([Step("slow", slow, "replay")])
    adapter, participant = _budgeted(program, root, clock)
    with pytest.raises(UpstreamTimeout, match="episode timeout"):
        await adapter.run(RolloutIdentity("t"), {"responses_create_params": {"input": "x"}})
    await participant.aclose()


# ---- whole rollouts: checkpoint, crash, restore, continue -----------------------------------------


def calculator_model(hold: Any = None) -> DeterministicModel:
    return DeterministicModel(calculator_answers({p["question"]: p for p in PROBLEMS}), hold=hold)


def rows_of(environment: str) -> dict[str, dict[str, Any]]:
    if environment == "nim":
        return {f"n{i}": nim_row(stones=9 + i, seed=i) for i in range(3)}
    return {f"c{i}": calculator_row(problem) for i, problem in enumerate(PROBLEMS)}


def model_of(environment: str, hold: Any = None) -> DeterministicModel:
    return DeterministicModel(nim_moves, hold=hold) if environment == "nim" else calculator_model(hold)


def holds_midway(environment: str) -> Any:
    """Hold the second model call of every rollout (nim: its third move)."""
    def hold(key: str | None, body: dict[str, Any]) -> bool:
        if environment == "nim":
            return sum(1 for item in body["input"] if item.get("role") == "assistant") == 2
        return body["input"][-1].get("type") == "function_call_output"

    return hold


async def uninterrupted(environment: str, root: Path) -> tuple[dict[str, Any], int]:
    model = model_of(environment)
    async with rollout_mesh(environment, root / "plain", model, checkpoint=False) as mesh:
        runs = {rid: mesh.dispatch(row, RolloutIdentity(rid)) for rid, row in rows_of(environment).items()}
        results = {rid: (await asyncio.wait_for(run, WAIT_S)).json() for rid, run in runs.items()}
    return results, len(model.calls)


async def checkpoint_midway(mesh: RolloutMesh, environment: str, directory: Path) -> list[RolloutIdentity]:
    rows = rows_of(environment)
    for rid, row in rows.items():
        mesh.dispatch(row, RolloutIdentity(rid))
    await until(lambda: sum(mesh.model.holding.values()) == len(rows), "every rollout is mid-episode")
    episodes = [RolloutIdentity(rid) for rid in rows]
    async with mesh.coordinator() as coordinator:
        deadline = time.time() + 30
        prepared = await coordinator.prepare("mid", deadline_ts=deadline)
        assert prepared.prepared, prepared.to_json()
        scope = prepared.continued(episodes)
        assert scope == episodes
        committed = await coordinator.commit("mid", deadline_ts=deadline, checkpoint_dir=str(directory),
                                             episode_ids=scope)
        assert sorted(committed.episode_ids()) == sorted(e.capture_key for e in episodes)
    return scope


@pytest.mark.parametrize("environment", ENVIRONMENTS)
async def test_a_checkpoint_without_a_crash_changes_no_row(environment: str, root: Path) -> None:
    reference, calls = await uninterrupted(environment, root)
    model = model_of(environment, hold=holds_midway(environment))
    async with rollout_mesh(environment, root, model) as mesh:
        await checkpoint_midway(mesh, environment, root / "ck")
        async with mesh.coordinator() as coordinator:
            await coordinator.resume("mid", deadline_ts=time.time() + 30)
        model.release()
        results = {rid: (await asyncio.wait_for(run, WAIT_S)).json()
                   for rid, run in zip(rows_of(environment), mesh.dispatched, strict=True)}
    assert results == reference and len(model.calls) == calls


@pytest.mark.parametrize("environment", ENVIRONMENTS)
async def test_a_crash_after_the_commit_continues_each_rollout_as_its_next_attempt(
    environment: str, root: Path
) -> None:
    reference, calls = await uninterrupted(environment, root)
    held = model_of(environment, hold=holds_midway(environment))
    async with rollout_mesh(environment, root, held) as mesh:
        scope = await checkpoint_midway(mesh, environment, root / "ck")
        before = await mesh.status("agent")
    # the crash: every app above is gone; fresh ones restore and continue
    fresh = model_of(environment)
    async with rollout_mesh(environment, root, fresh) as mesh:
        async with mesh.coordinator() as coordinator:
            deadline = time.time() + 30
            restored = await coordinator.restore(
                "back", deadline_ts=deadline, checkpoint_dir=str(root / "ck"), episode_ids=scope)
            assert restored.continued() == [e.next_attempt() for e in scope] and restored.restarts() == []
            await coordinator.resume("back", deadline_ts=deadline)
        rows = rows_of(environment)
        runs = {e.rollout_id: mesh.dispatch(rows[e.rollout_id], e) for e in restored.continued()}
        results = {rid: (await asyncio.wait_for(run, WAIT_S)).json() for rid, run in runs.items()}
        after = await mesh.status("agent")
    # restored turns come back without token arrays (records never carry them); all else is equal
    assert without_token_arrays(results) == without_token_arrays(reference)
    assert all(_tokens_kept_after_restore(results[rid]) for rid in results)
    hold = holds_midway(environment)
    delivered_before = sum(1 for call in held.calls if not hold(None, call.body))
    assert delivered_before + len(fresh.calls) == calls  # no completed model call was made again
    assert all(key.endswith("-a1") for key in fresh.capture_keys())
    tools_before, tools_after = before["extras"]["tool_calls"], after["extras"]["tool_calls"]
    expected_tools = 0 if environment == "nim" else len(rows)
    assert (tools_before, tools_after) == (expected_tools, 0)  # no completed tool call was made again


def _tokens_kept_after_restore(row: dict[str, Any]) -> bool:
    """The last model output of a continued rollout (made after the restore) has its token ids."""
    output = row["response"]["output"]
    made_by_model = [item for item in output
                     if item.get("role") == "assistant" or item["type"] == "function_call"]
    return "generation_token_ids" in made_by_model[-1]


async def test_a_rerun_with_another_task_row_is_refused(root: Path) -> None:
    model = model_of("single_agent_turn", hold=holds_midway("single_agent_turn"))
    async with rollout_mesh("single_agent_turn", root, model) as mesh:
        scope = await checkpoint_midway(mesh, "single_agent_turn", root / "ck")
    async with rollout_mesh("single_agent_turn", root, calculator_model()) as mesh:
        async with mesh.coordinator() as coordinator:
            await coordinator.restore("back", deadline_ts=time.time() + 30, checkpoint_dir=str(root / "ck"),
                                      episode_ids=scope)
            await coordinator.resume("back", deadline_ts=time.time() + 30)
        first = scope[0].next_attempt()
        other = calculator_row(PROBLEMS[1] if first.rollout_id == "c0" else PROBLEMS[0])
        refused = await asyncio.wait_for(mesh.dispatch(other, first), WAIT_S)
        assert refused.status_code == 422 and refused.json()["error"]["code"] == "invalid_checkpoint_state"
        assert task_digest(other)[:12] in refused.json()["error"]["detail"]
        right = rows_of("single_agent_turn")[first.rollout_id]
        assert (await asyncio.wait_for(mesh.dispatch(right, first), WAIT_S)).status_code == 200


@pytest.mark.parametrize(
    ("record", "detail"),
    [
        ({"episode_id": {"rollout_id": "r", "attempt": 0}, "task_digest": "ab", "boundary": None}, "SHA-256"),
        ({"episode_id": {"rollout_id": "r", "attempt": 0}, "boundary": None}, "fields"),
        ({"episode_id": {"rollout_id": "r", "attempt": 0}, "task_digest": "0" * 64,
          "boundary": {"index": 1, "next_step": "nowhere", "state": {}}}, "nowhere"),
        ({"episode_id": {"rollout_id": "r", "attempt": 0}, "task_digest": "0" * 64,
          "boundary": {"index": -1, "next_step": "act", "state": {}}}, "index"),
        ({"episode_id": {"rollout_id": "r", "attempt": 0}, "task_digest": "0" * 64,
          "boundary": {"index": 2**64 - 1, "next_step": "act", "state": {}}}, "index"),
        ({"episode_id": {"rollout_id": "r", "attempt": 0}, "task_digest": "0" * 64,
          "boundary": {"index": 1, "next_step": "start", "state": nested_dicts(299)}}, "written again"),
        ({"episode_id": {"rollout_id": "r", "attempt": 0}, "task_digest": "0" * 64,
          "boundary": {"index": 1, "next_step": "act", "state": {}}}, "record of r: the state"),
        ({"episode_id": {"rollout_id": "r", "attempt": 0}, "task_digest": "0" * 64,
          "boundary": {"index": 4, "next_step": None, "state": {}}}, "result"),
    ],
)
async def test_a_malformed_record_is_refused_and_nothing_is_installed(
    record: dict[str, Any], detail: str, root: Path, clock: FakeClock
) -> None:
    good = {"episode_id": {"rollout_id": "ok", "attempt": 0}, "task_digest": "0" * 64, "boundary": None}
    directory = write_env_checkpoint(root, [good, record])
    async with started("nim", root, clock) as (_, pt):
        control = Control(pt)
        scope = [{"rollout_id": "ok"}, {"rollout_id": "r"}]
        error = await control.refused("invalid_checkpoint_state", "restore", checkpoint_id="bad",
                                      checkpoint_dir=str(directory), episode_ids=scope)
        assert detail in error["detail"]
        assert (await extras(pt))["installed"] == 0


def write_env_checkpoint(root: Path, records: list[dict[str, Any]]) -> Path:
    directory = root / "written"
    from nemo_gym_ckpt.checkpoint.store import StopSignal

    writer = CheckpointStore(root).open_writer(directory, "environment", "env", StopSignal())
    writer.write_lines([_record_line(record) for record in records])
    writer.finish("environment", "env", "written")
    return directory


def _record_line(record: dict[str, Any]) -> bytes:
    """The line of a record; one nested deeper than orjson writes (it reads 1,024) by the standard library."""
    try:
        return orjson.dumps(record)
    except orjson.JSONEncodeError:
        return json.dumps(record, separators=(",", ":")).encode()


MakeParticipant = Callable[[], AbstractAsyncContextManager[ParticipantUnderTest]]


@pytest.mark.parametrize(("levels", "installed"), [(251, 1), (252, 0)])
async def test_a_restored_state_must_fit_in_a_record_again(
    levels: int, installed: int, root: Path, clock: FakeClock
) -> None:
    """A record holds a state two levels down: one deeper than 252 levels installed, and the first
    record of the episode (or an export) failed later, as a 500."""
    record = {"episode_id": {"rollout_id": "r", "attempt": 0}, "task_digest": "0" * 64,
              "boundary": {"index": 1, "next_step": "start", "state": nested_dicts(levels)}}
    directory = write_env_checkpoint(root, [record])
    async with started("nim", root, clock) as (_, pt):
        reply = await pt.client.post("/ng-control/v1/checkpoint/restore", headers=AUTH, json={
            "checkpoint_id": "c", "deadline_ts": clock.now() + 30, "checkpoint_dir": str(directory),
            "episode_ids": [{"rollout_id": "r"}]})
        assert reply.status_code == (200 if installed else 422), reply.text
        assert (await extras(pt))["installed"] == installed


@pytest.mark.parametrize(("implementation", "next_step"), [
    ("nim", "act"), ("nim", "close_agent"), ("nim", "return"),
    ("single_agent_turn", "invoke_agent"), ("single_agent_turn", "close_agent"), ("single_agent_turn", "verify"),
    ("single_agent_turn", "close_session"), ("single_agent_turn", "return"),
])
async def test_a_restored_state_lacking_what_its_steps_read_is_refused(
    implementation: str, next_step: str, root: Path, clock: FakeClock
) -> None:
    """Digest, count, fields and next step right, the state empty: installed, and the /run of the
    next attempt raised KeyError (500) at the first key its step read."""
    row = env_row(implementation)
    record = {"episode_id": {"rollout_id": "r", "attempt": 0}, "task_digest": task_digest(row),
              "boundary": {"index": 1, "next_step": next_step, "state": {}}}
    directory = write_env_checkpoint(root, [record])
    async with started(implementation, root, clock) as (_, pt):
        error = await Control(pt).refused("invalid_checkpoint_state", "restore", checkpoint_id="c",
                                          checkpoint_dir=str(directory), episode_ids=[{"rollout_id": "r"}])
        assert error["detail"].startswith("record of r: the state of its boundary")
        assert (await extras(pt))["installed"] == 0
