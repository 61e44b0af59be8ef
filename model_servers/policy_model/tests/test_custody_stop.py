"""A retire stops a call in flight by cancelling the request's own task (no task per call).

The custody awaits the generation in the caller's task and names that task on the ticket;
``ActiveCalls.stop`` cancels it. The custody turns that cancellation into ``stale_attempt`` and takes
it back (the task is not left cancelling), while a cancellation from outside (the request went away)
stays a cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest
from fastapi import FastAPI

from model_servers.policy_model.custody import CustodyBackend
from model_servers.policy_model.generation import ChatCall, ChatResult, Sampling, StreamEvent, StreamStarted
from model_servers.policy_model.participant import PolicyParticipant, mount_policy_participant
from model_servers.policy_model.tests.policy_harness import policy_context
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.errors import StaleAttempt
from nemo_gym_ckpt.identity import CURRENT_IDENTITY, RolloutIdentity

pytestmark = pytest.mark.unit

WAIT_S = 10.0
R1 = RolloutIdentity("r1", 0)
CALL = ChatCall(messages=[{"role": "user", "content": "hi"}], tools=None, sampling=Sampling(1.0, 1.0, 8))


class GatedBackend:
    """Generates only when ``gate`` is set; says when a call started and whether it was cancelled."""

    model_name = "gated"

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.gate = asyncio.Event()
        self.cancelled = 0

    async def start(self) -> None:
        return None

    async def complete(self, call: ChatCall) -> ChatResult:
        self.started.set()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return ChatResult("ok", [], "stop", 1, 1, "d" * 32, prompt_digest="a" * 64, output_digest="b" * 64)

    def stream(self, call: ChatCall) -> AsyncGenerator[StreamEvent, None]:
        raise NotImplementedError("the gated backend only completes")


class OneEventStream(GatedBackend):
    """Streams its start, then its final result at once."""

    async def stream(self, call: ChatCall) -> AsyncGenerator[StreamEvent, None]:
        yield StreamStarted("d" * 32)
        yield ChatResult("ok", [], "stop", 1, 1, "d" * 32, prompt_digest="a" * 64, output_digest="b" * 64)


def mounted(tmp_path: Path, inner: GatedBackend) -> PolicyParticipant:
    ctx = policy_context(MeshClient(), tmp_path, tmp_path / "ckpt", 600.0)
    policy = mount_policy_participant(FastAPI(), ctx, inner)
    assert policy is not None
    return policy


async def call_as(backend: CustodyBackend, episode: RolloutIdentity) -> tuple[str, int]:
    """The outcome of one call and how many cancellations of this task are left pending after it."""
    CURRENT_IDENTITY.set(episode)
    task = asyncio.current_task()
    assert task is not None
    try:
        await backend.complete(CALL)
    except StaleAttempt:
        return "stale_attempt", task.cancelling()
    return "delivered", task.cancelling()


async def test_a_retire_cancels_the_generation_and_answers_stale_attempt(tmp_path: Path) -> None:
    inner = GatedBackend()
    policy = mounted(tmp_path, inner)
    call = asyncio.create_task(call_as(policy.backend, R1))
    await asyncio.wait_for(inner.started.wait(), WAIT_S)
    stopped = policy.adapter.calls.stop([R1])
    assert len(stopped) == 1
    assert await asyncio.wait_for(call, WAIT_S) == ("stale_attempt", 0)
    assert inner.cancelled == 1
    assert len(policy.adapter.calls) == 0
    assert len(policy.adapter.ledgers) == 0  # the stopped call has no row


async def test_a_call_of_another_rollout_goes_on(tmp_path: Path) -> None:
    inner = GatedBackend()
    policy = mounted(tmp_path, inner)
    call = asyncio.create_task(call_as(policy.backend, R1))
    await asyncio.wait_for(inner.started.wait(), WAIT_S)
    assert policy.adapter.calls.stop([RolloutIdentity("r2", 0)]) == []
    inner.gate.set()
    assert await asyncio.wait_for(call, WAIT_S) == ("delivered", 0)
    assert inner.cancelled == 0
    assert policy.adapter.ledgers.row_count == 1


async def test_a_request_cancelled_from_outside_stays_cancelled(tmp_path: Path) -> None:
    inner = GatedBackend()
    policy = mounted(tmp_path, inner)
    call = asyncio.create_task(call_as(policy.backend, R1))
    await asyncio.wait_for(inner.started.wait(), WAIT_S)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(call, WAIT_S)
    assert inner.cancelled == 1
    assert len(policy.adapter.calls) == 0


async def test_a_retire_and_a_cancel_from_outside_together_stay_a_cancellation(tmp_path: Path) -> None:
    inner = GatedBackend()
    policy = mounted(tmp_path, inner)
    call = asyncio.create_task(call_as(policy.backend, R1))
    await asyncio.wait_for(inner.started.wait(), WAIT_S)
    policy.adapter.calls.stop([R1])
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(call, WAIT_S)
    assert len(policy.adapter.calls) == 0


async def test_a_stream_stopped_while_its_final_event_went_out_writes_no_row(tmp_path: Path) -> None:
    """Stopped by a retire (which then ran past its deadline) and forgotten while the final event
    was being passed on: the stream answers ``stale_attempt`` instead of writing the row."""
    policy = mounted(tmp_path, OneEventStream())

    async def stream_as(episode: RolloutIdentity) -> str:
        CURRENT_IDENTITY.set(episode)
        events = policy.backend.stream(CALL)
        try:
            assert isinstance(await anext(events), StreamStarted)
            assert isinstance(await anext(events), ChatResult)  # being passed on
            assert len(policy.adapter.calls.stop([R1])) == 1
            policy.adapter.ledgers.forget(["r1"])
            async for _ in events:
                return "more events"
        except StaleAttempt:
            return "stale_attempt"
        finally:
            await events.aclose()
        return "delivered"

    assert await asyncio.wait_for(asyncio.create_task(stream_as(R1)), WAIT_S) == "stale_attempt"
    assert len(policy.adapter.calls) == 0
    assert len(policy.adapter.ledgers) == 0  # no ledger comes back for the forgotten rollout
