"""``export_at_once`` hands over, in one list, what each adapter's ``export`` streams: the same
records (the same objects, so the same bytes; the order may differ) once the pipeline has kept those
in scope, for every scope; and it declines (``None``) where it cannot, so the stream runs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest

from nemo_gym_ckpt.agent.sessions import AgentSession, AgentSessions
from nemo_gym_ckpt.checkpoint.adapter import ExportAtOnce, ExportItem
from nemo_gym_ckpt.checkpoint.participant import Participant
from nemo_gym_ckpt.checkpoint.records import Record, Scope
from nemo_gym_ckpt.checkpoint.store import CheckpointStore
from nemo_gym_ckpt.environment.adapter import EpisodesAdapter, Installed, LiveEpisode, RunLimits
from nemo_gym_ckpt.environment.episode import Episode, Program, Step
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.resources.adapter import ResourcesAdapter
from nemo_gym_ckpt.resources.sessions import Session, SessionTable
from nemo_gym_ckpt.testing.clock import FakeClock

pytestmark = pytest.mark.unit

WAIT_S = 5.0


async def _streamed(export: AsyncIterator[ExportItem]) -> list[Record]:
    return [item if isinstance(item, Record) else Record.from_data(item) async for item in export]


async def _agree(adapter: Any, scopes: list[Scope | None]) -> None:
    assert isinstance(adapter, ExportAtOnce)
    for scope in scopes:
        at_once = adapter.export_at_once(scope)
        assert at_once is not None
        kept = [record for record in at_once if scope is None or record.episode in scope]  # as the pipeline does
        streamed = await _streamed(adapter.export(scope))
        assert sorted(record.raw for record in kept) == sorted(record.raw for record in streamed)
        assert {id(record) for record in kept} == {id(record) for record in streamed}


# ---- environment -------------------------------------------------------------------------------


async def _act(episode: Episode) -> str | None:
    return None


PROGRAM = Program.of([Step("first", _act, "replay"), Step("second", _act, "replay")])


def _episode(rollout: str, attempt: int = 0, *, moved: bool = False) -> Episode:
    episode = Episode.start(RolloutIdentity(rollout, attempt), {"row": rollout}, PROGRAM)
    if moved:
        episode.boundary = episode.boundary.advance("second", {"seen": rollout})
    return episode


def _environment() -> tuple[EpisodesAdapter, dict[str, RolloutIdentity]]:
    """Live episodes in every state the export tells apart: encoded at their boundary, moved since
    their record was encoded, never encoded, a restart, restored and not moved, restored and moved."""
    adapter = EpisodesAdapter(PROGRAM, RunLimits(None, 1.0))
    encoded, moved, fresh, restart = (LiveEpisode(_episode(name)) for name in ("enc", "moved", "fresh", "restart"))
    encoded.encoded()
    moved.encoded()
    moved.episode.boundary = moved.episode.boundary.advance("second", {"n": 1})
    restart.episode.restart = True
    restart.encoded()
    source = Record.from_data({"episode_id": {"rollout_id": "back", "attempt": 0}, "task_digest": "0" * 64,
                               "boundary": None})
    back = LiveEpisode(_episode("back", 1), restored=source)
    back.restored_boundary = back.episode.boundary
    gone = LiveEpisode(_episode("gone", 1), restored=source)
    gone.restored_boundary = gone.episode.boundary
    gone.episode.boundary = gone.episode.boundary.advance("second", {"n": 2})
    for live in (encoded, moved, fresh, restart, back, gone):
        adapter.live[live.key] = live
    names = {live.key: live.episode.identity for live in (encoded, moved, fresh, restart, back, gone)}
    names["back-a0"] = source.episode
    return adapter, names


async def test_the_environment_hands_over_what_it_streams() -> None:
    adapter, names = _environment()
    everything = frozenset(names.values())
    scopes: list[Scope | None] = [None, everything, frozenset({names["enc"], names["moved"]}),
                                  frozenset({names["back-a0"]}), frozenset({names["back-a1"]}), frozenset()]
    await _agree(adapter, scopes)
    assert len(adapter.export_at_once(everything) or []) == 5  # every live episode but the restart


async def test_the_environment_declines_while_a_restored_boundary_waits_for_its_run() -> None:
    adapter, _ = _environment()
    record = Record.from_data({"episode_id": {"rollout_id": "wait", "attempt": 0}, "task_digest": "0" * 64,
                               "boundary": None})
    adapter.installed["wait-a1"] = Installed(RolloutIdentity("wait", 1), "0" * 64, None, record)
    assert adapter.export_at_once(None) is None


class _Gates:
    """A program of two ``replay`` steps, each waiting for its episode's gate to open."""

    def __init__(self) -> None:
        self.gates: dict[tuple[str, str], asyncio.Event] = {}

    def gate(self, key: str, step: str) -> asyncio.Event:
        return self.gates.setdefault((key, step), asyncio.Event())

    def program(self) -> Program:
        async def first(episode: Episode) -> str | None:
            await self.gate(episode.identity.capture_key, "first").wait()
            return "second"

        async def second(episode: Episode) -> str | None:
            await self.gate(episode.identity.capture_key, "second").wait()
            return None

        return Program.of([Step("first", first, "replay"), Step("second", second, "replay")])


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_the_records_at_hand_follow_the_episodes_as_they_move_restart_and_leave(
    root: Path, clock: FakeClock
) -> None:
    gates = _Gates()
    adapter = EpisodesAdapter(gates.program(), RunLimits(None, 1.0))
    adapter.participant = Participant(kind="environment", instance="env", adapter=adapter,
                                      store=CheckpointStore(root), lease_grace_s=600.0, clock=clock)
    lives = [adapter._start(RolloutIdentity(name), {"row": name}) for name in ("a", "b", "c")]
    scopes: list[Scope | None] = [None, frozenset(live.episode.identity for live in lives),
                                  frozenset({lives[0].episode.identity})]
    await _agree(adapter, scopes)  # no episode has reached a boundary yet: looked up in turn
    tasks = [asyncio.create_task(adapter._drive(live)) for live in lives]
    await _settle()
    assert set(adapter._at_hand) == {"a", "b", "c"}
    await _agree(adapter, scopes)
    gates.gate("a", "first").set()  # a moves to its next boundary
    lives[1].episode.mark_restart()  # b is never exported again
    gates.gate("c", "first").set()
    gates.gate("c", "second").set()  # c finishes and leaves
    await _settle()
    assert set(adapter._at_hand) == {"a"} and set(adapter.live) == {"a", "b"} and tasks[2].done()
    assert (adapter.export_at_once(None) or [])[0].data["boundary"]["index"] == 1
    await _agree(adapter, scopes)
    for key in ("a", "b"):
        gates.gate(key, "first").set()
        gates.gate(key, "second").set()
    await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
    assert adapter._at_hand == {} and adapter.export_at_once(None) == []


# ---- resources server ----------------------------------------------------------------------------


class _Host:
    """A stateless (or exported) resources server: only its declaration and its session table."""

    def __init__(self, mode: str) -> None:
        self.checkpoint_mode, self.checkpoint_verify, self.sessions = mode, "replay", SessionTable()

    async def export_session(self, session: Session) -> dict[str, Any]:
        return {"n": len(session.state)}


def _resources(mode: str) -> tuple[ResourcesAdapter, dict[str, RolloutIdentity]]:
    """Sessions kept encoded, never encoded, encoded under an earlier identity, without identity,
    restored, and one being retired."""
    host = _Host(mode)
    adapter = ResourcesAdapter(cast(Any, host))
    names = {name: RolloutIdentity(name) for name in ("kept", "new", "rebound", "back", "retiring")}
    for name in ("kept", "new", "rebound", "retiring"):
        host.sessions.open(names[name], {}, session_id=f"s-{name}")
    host.sessions.open(None, {}, session_id="s-none")
    sessions = {session.session_id: session for session in host.sessions}
    adapter.export_at_once(None)  # what a seed does: each record built once, then looked up
    sessions["s-new"].encoded = None
    sessions["s-rebound"].identity = names["rebound"] = RolloutIdentity("rebound", 1)
    restored = host.sessions.open(RolloutIdentity("back", 1), {}, session_id="s-back")
    restored.restored = Record.of_strings(names["back"], session_id="s-back")
    adapter._retiring["s-retiring"] = names["retiring"]
    return adapter, names


async def test_a_stateless_resources_server_hands_over_what_it_streams() -> None:
    adapter, names = _resources("stateless")
    everything = frozenset(names.values())
    await _agree(adapter, [None, everything, frozenset({names["kept"], names["back"]}),
                           frozenset({RolloutIdentity("back", 1)}), frozenset()])
    assert len(adapter.export_at_once(everything) or []) == 4  # not the retiring one, not the one without identity


async def test_an_exported_resources_server_declines_and_a_restart_only_one_has_nothing() -> None:
    assert _resources("exported")[0].export_at_once(None) is None
    adapter = _resources("restart_only")[0]
    assert adapter.export_at_once(None) == [] and await _streamed(adapter.export(None)) == []


# ---- agent -----------------------------------------------------------------------------------------


async def test_the_agent_hands_over_what_it_streams() -> None:
    agent = AgentSessions()
    names = {name: RolloutIdentity(name) for name in ("a", "b", "restart")}
    for name, identity in names.items():
        agent.sessions[identity.capture_key] = AgentSession(identity, restart=name == "restart")
    back = AgentSession(RolloutIdentity("back", 1))
    back.restored = Record.of_strings(RolloutIdentity("back"), session="s")
    agent.sessions[back.key] = back
    agent.sessions["a"].encoded()
    agent.sessions["a"].completed = 1  # moved since its record was built
    await _agree(agent, [None, frozenset(names.values()) | {back.identity, RolloutIdentity("back")},
                         frozenset({names["b"]}), frozenset({RolloutIdentity("back")}), frozenset()])
    assert len(agent.export_at_once(None)) == 3  # not the restart
