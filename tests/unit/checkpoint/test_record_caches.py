"""Records of state that did not move are built once: the capture costs a lookup, and the bytes are
the previous commit's (an incremental commit then references them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_gym_ckpt.agent.sessions import Activation, AgentSession, AgentSessions, Turn
from nemo_gym_ckpt.checkpoint.participant import Participant
from nemo_gym_ckpt.checkpoint.records import Record
from nemo_gym_ckpt.checkpoint.store import CheckpointStore
from nemo_gym_ckpt.environment.adapter import LiveEpisode
from nemo_gym_ckpt.environment.episode import Episode, Program, Step
from nemo_gym_ckpt.identity import RolloutIdentity

pytestmark = pytest.mark.unit


async def test_an_agent_session_record_is_built_again_only_around_its_calls(tmp_path: Path) -> None:
    sessions = AgentSessions()
    sessions.participant = Participant(kind="agent", instance="a", adapter=sessions,  # type: ignore[arg-type]
                                       store=CheckpointStore(tmp_path), lease_grace_s=60)
    state = {"step": 1}
    session = AgentSession(RolloutIdentity("r1"))
    session.running = Activation(1, "ab" * 32)
    turn = Turn(sessions, session, session.running)
    turn.track(lambda: dict(state))
    first = session.encoded()
    assert session.encoded() is first  # nothing moved: the same record, not built again
    async with turn.call("model"):
        assert session.encoded() is not first  # a call started
        during = session.encoded()
        state["step"] = 2
    after = session.encoded()
    assert after is not during and after.data["session"]["running"]["state"] == {"step": 2}


def test_an_episode_record_is_built_once_per_boundary() -> None:
    async def step(episode: Episode) -> str | None:
        return None

    program = Program.of([Step("only", step)])
    live = LiveEpisode(Episode.start(RolloutIdentity("r1"), {"q": 1}, program))
    first = live.encoded()
    assert live.encoded() is first
    live.episode.boundary = live.episode.boundary.advance(None, {"done": True})
    moved = live.encoded()
    assert moved is not first and moved.data["boundary"]["state"] == {"done": True}


def test_a_record_of_strings_has_the_bytes_from_data_gives() -> None:
    identity = RolloutIdentity("r1", 2)
    quick = Record.of_strings(identity, session_id='s"1\\u')
    assert quick == Record.from_data({"episode_id": identity.to_json(), "session_id": 's"1\\u'})
