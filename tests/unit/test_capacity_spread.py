"""Refusals past an environment's capacity spread their ``Retry-After`` over a window, in turn, so
that callers refused together do not all come back in the same instant."""

from __future__ import annotations

import pytest

from nemo_gym_ckpt.environment.capacity import RolloutCapacity
from nemo_gym_ckpt.errors import Overloaded

pytestmark = pytest.mark.unit


def _retry_afters(capacity: RolloutCapacity, count: int) -> list[str]:
    """The ``Retry-After`` headers of ``count`` calls refused one after another (the capacity full)."""
    headers = []
    with capacity.admitted():
        for _ in range(count):
            with pytest.raises(Overloaded) as refused, capacity.admitted():
                pass
            headers.append(refused.value.headers()["retry-after"])
    return headers


def test_refusals_take_turns_over_the_window() -> None:
    assert _retry_afters(RolloutCapacity(1, 10.0), 23) == [str(s) for s in [*range(10, 21), *range(10, 21), 10]]


def test_the_default_window_of_one_second_is_one_and_two() -> None:
    assert _retry_afters(RolloutCapacity(1), 4) == ["1", "2", "1", "2"]


def test_a_spread_of_zero_keeps_every_refusal_the_same() -> None:
    assert _retry_afters(RolloutCapacity(1, 3.0, retry_spread_s=0), 3) == ["3", "3", "3"]


def test_an_explicit_spread() -> None:
    capacity = RolloutCapacity(1, 5.0, retry_spread_s=2)
    assert _retry_afters(capacity, 4) == ["5", "6", "7", "5"]
    assert capacity.refused == 4 and capacity.in_flight == 0  # nothing was started by a refusal
