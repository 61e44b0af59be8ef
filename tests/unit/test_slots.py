"""The one bounded count of the library (``nemo_gym_ckpt/slots.py``): the take past the bound is
refused with the owner's words and ``Retry-After``, and a slot is given back exactly once however
its holder ends, so the count never goes below zero nor keeps a slot nobody holds."""

from __future__ import annotations

import asyncio

import pytest

from nemo_gym_ckpt.errors import Overloaded
from nemo_gym_ckpt.slots import Slots

pytestmark = pytest.mark.unit

WAIT_S = 5.0


def _slots(limit: int | None) -> Slots:
    return Slots(limit, 3.0, limit_name="max_things", refusal="this holds 2 things (max_things)")


def test_the_take_past_the_bound_is_refused_with_the_owners_words() -> None:
    slots = _slots(2)
    first, second = slots.take(), slots.take()
    with pytest.raises(Overloaded) as refused:
        slots.take()
    assert (refused.value.code, refused.value.status) == ("capacity_exceeded", 429)
    assert refused.value.detail == "this holds 2 things (max_things)"
    assert refused.value.headers() == {"retry-after": "3"}
    assert (slots.held, slots.refused) == (2, 1)
    first.release()
    with slots.take():  # a slot given back is free again
        assert slots.held == 2
    second.release()
    assert slots.held == 0


def test_no_limit_refuses_nothing_and_a_limit_below_one_is_refused() -> None:
    slots = _slots(None)
    taken = [slots.take() for _ in range(1000)]
    assert (slots.held, slots.refused) == (1000, 0)
    for slot in taken:
        slot.release()
    with pytest.raises(ValueError, match="max_things must be >= 1"):
        _slots(0)


def test_a_slot_is_given_back_once_however_often_it_is_released() -> None:
    slots = _slots(1)
    with slots.take() as slot:
        slot.release()
        slot.release()
        assert slots.held == 0
    assert slots.held == 0  # leaving the block gave back nothing more: never below zero
    with slots.take(), pytest.raises(Overloaded):  # and the bound still counts right
        slots.take()


def test_a_passed_on_slot_is_given_back_by_its_new_holder_only() -> None:
    slots = _slots(1)
    with slots.take() as slot:
        passed = slot.pass_on()
    assert slots.held == 1  # the block's end gave nothing back: the slot is the new holder's
    slot.release()
    assert slots.held == 1
    passed.release()
    passed.release()
    assert slots.held == 0


def test_an_error_gives_the_slot_back() -> None:
    slots = _slots(1)
    with pytest.raises(RuntimeError), slots.take():
        raise RuntimeError("the request failed")
    assert slots.held == 0


async def test_a_cancellation_gives_the_slot_back() -> None:
    slots = _slots(1)
    entered = asyncio.Event()

    async def holder() -> None:
        with slots.take():
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.ensure_future(holder())
    async with asyncio.timeout(WAIT_S):
        await entered.wait()
        assert slots.held == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert (slots.held, slots.refused) == (0, 0)
