"""The conformance suite against the minimal participant, in process, with a fake clock."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import pytest

from nemo_gym_ckpt.testing.conformance import CHECKS, ParticipantUnderTest, check_participant

pytestmark = pytest.mark.unit

Make = Callable[[], AbstractAsyncContextManager[ParticipantUnderTest]]


@pytest.mark.parametrize("name", sorted(CHECKS))
async def test_conformance(name: str, make_participant: Make) -> None:
    await CHECKS[name](make_participant)


async def test_check_participant_runs_every_check(make_participant: Make) -> None:
    results = await check_participant(make_participant, skip=("bodies_are_strict",))
    assert set(results) == set(CHECKS) - {"bodies_are_strict"}
    assert set(results.values()) == {"passed"}
