"""Custody of the policy's calls while checkpointing is on: a ``Backend`` around the real one.

docs/protocol.md section 8, first half. Every model call goes through ``CustodyBackend``:

1. **Admission**: ``participant.admit`` (no rollout identity: 400 ``rollout_id_required``; during
   an open checkpoint a new call waits for resume; a retired attempt: 409 ``stale_attempt``), then
   a ticket is opened in ``ActiveCalls``.
2. **Generation** by the wrapped backend, keeping on through a checkpoint; a request without a
   seed gets one derived from its rollout id and prompt (``ChatCall.seed_scope``). A call of a
   restored rollout whose last assistant turn comes without token fields (its caller lost them in
   the crash) is given the ids its earlier attempts delivered (``ChatCall.ledger_prefixes``, from
   the token sidecar), so its prompt is spliced from them rather than re-tokenized (review E10). A retire of the
   attempt cancels it (``stale_attempt``): the generation is awaited in the request's own task, which
   ``ActiveCalls.stop`` cancels (no extra task or waiter per call). With generation cuts on, the call is sent with its
   ``model_call`` (id and lineage at admission, so a cut can find it on the worker), and a call
   that repeats a restored cut's conversation continues from its staged prefix (``continuation``).
3. **Delivery**. A reply (or an error) that finishes while a checkpoint is open is held until
   resume. A stream whose first event comes while a checkpoint is open has not started to be
   delivered: it is read to its end and held the same way. A stream that started to be delivered
   blocks readiness until it drains. The ledger row is written as the reply goes out: a whole
   reply when it is returned, a stream once its final event was passed on and the next one asked
   for. A held reply has no row when the commit exports, so after a restore the call is made again.
   A stream being delivered is stopped by a retire at its next event, and before its row is
   written (``stale_attempt``): once the retire stopped its call, even if a forget then cleared
   the rollout's mark (a retire that ran past its deadline leaves the call stopped).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import TypeVar

from model_servers.policy_model.active_calls import ActiveCalls, CallState, Ticket
from model_servers.policy_model.backend import Backend
from model_servers.policy_model.generation import (
    ChatCall,
    ChatResult,
    ModelCallRef,
    StreamEvent,
    StreamStarted,
)
from model_servers.policy_model.ledger import LedgerBook
from model_servers.policy_model.token_splice import lost_its_tokens
from nemo_gym_ckpt.checkpoint.participant import Participant
from nemo_gym_ckpt.checkpoint.phases import Phase
from nemo_gym_ckpt.errors import GymError, StaleAttempt
from nemo_gym_ckpt.identity import current_identity

__all__ = ["Custody", "CustodyBackend", "StreamEvents"]

T = TypeVar("T")
R = TypeVar("R")


class StreamEvents:
    """A stream's events: those read ahead (a held reply, then its error), then the live rest."""

    def __init__(
        self, ahead: list[StreamEvent], error: GymError | None, live: AsyncIterator[StreamEvent]
    ) -> None:
        self._ahead = deque(ahead)
        self._error = error
        self._live = live

    def __aiter__(self) -> StreamEvents:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._ahead:
            return self._ahead.popleft()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return await anext(self._live)


class Custody:
    """The steps of one call under checkpointing: admit, generate, hold, deliver, release."""

    def __init__(
        self, participant: Participant, calls: ActiveCalls, ledgers: LedgerBook, *,
        generation_cuts: bool = False,
    ) -> None:
        self.participant = participant
        self.calls = calls
        self.ledgers = ledgers
        self.generation_cuts = generation_cuts

    @property
    def checkpoint_open(self) -> bool:
        return self.participant.phase is not Phase.IDLE

    async def admit(self, call: ChatCall) -> Ticket:
        identity = current_identity()
        await self.participant.admit(identity)
        assert identity is not None  # admit refuses a call without one
        parent, length = self.ledgers.lineage(identity)
        return self.calls.open(identity, call, self.participant.clock.now(), parent_call_id=parent,
                               previous_length=length)

    def as_sent(self, call: ChatCall, ticket: Ticket) -> ChatCall:
        """The call as the backend gets it: without a seed, one derived from the rollout and prompt;
        with cuts on, named for the worker, and continuing a restored cut it repeats."""
        if call.sampling.seed is None:
            call = _replaced(call, seed_scope=ticket.episode.rollout_id)
        if lost_its_tokens(call.messages):
            prefixes = self.ledgers.restored_prefixes(ticket.episode)
            if prefixes:
                call = dataclasses.replace(call, ledger_prefixes=tuple(prefixes))
        if not self.generation_cuts:
            return call
        model_call = ModelCallRef(ticket.model_call_id, ticket.parent_call_id, ticket.previous_length)
        cut = self.ledgers.restored_cut(ticket.episode, ticket.conversation_digest)
        return dataclasses.replace(call, model_call=model_call,
                                   continuation=cut.continuation() if cut is not None else None)

    async def generated(self, ticket: Ticket, work: Awaitable[T]) -> T:
        """The result of ``work``; an error is held like a reply before it is raised."""
        try:
            return await self._unless_stopped(ticket, work)
        except GymError:
            await self.hold(ticket)
            raise

    async def hold(self, ticket: Ticket) -> None:
        """Wait for resume if a checkpoint is open (at once otherwise); refuse a retired attempt."""
        if self.checkpoint_open:
            self.calls.mark(ticket, CallState.HELD)
        await self.participant.admit(ticket.episode)

    async def opened(self, ticket: Ticket, events: AsyncIterator[StreamEvent]) -> StreamEvents:
        """A stream's events once it may start to be delivered (held to its end if need be)."""
        first = self.named(ticket, await self.generated(ticket, anext(events)))
        if not self.checkpoint_open:
            return StreamEvents([first], None, events)
        ahead, error = await self._unless_stopped(ticket, _read_to_end(events))
        await self.hold(ticket)
        return StreamEvents([first, *ahead], error, events)

    def delivering(self, ticket: Ticket) -> None:
        self.calls.mark(ticket, CallState.DELIVERING)

    def check_retired(self, ticket: Ticket) -> None:
        """A stream being delivered stops at its next event once its attempt is retired: once the
        retire stopped the call (``ticket.stopped``, which a forget clearing the mark after a retire
        that ran past its deadline leaves set) or the attempt is at or below its rollout's mark."""
        if ticket.stopped:
            raise _stale(ticket)
        self.participant.marks.check(ticket.episode)

    def deliver(self, ticket: Ticket, result: ChatResult) -> None:
        self.ledgers.deliver(ticket, result)

    @staticmethod
    def named(ticket: Ticket, event: T) -> T:
        """The reply's start or result, named with the ticket's model call id (a reply header)."""
        if isinstance(event, ChatResult | StreamStarted):
            return _replaced(event, model_call_id=ticket.model_call_id)
        return event

    def release(self, ticket: Ticket) -> None:
        self.calls.close(ticket)
        self.participant.notify_changed()

    async def _unless_stopped(self, ticket: Ticket, work: Awaitable[T]) -> T:
        """``work`` awaited in this task, which a retire of the attempt cancels: then ``StaleAttempt``."""
        if ticket.stopped:
            _discard(work)
            raise _stale(ticket)
        runner = asyncio.current_task()
        assert runner is not None
        ticket.runner = runner
        try:
            result = await work
        except asyncio.CancelledError:
            if not _take_back_stop(ticket, runner):
                raise  # cancelled from outside (the request went away), not (only) by a retire
            raise _stale(ticket) from None
        except BaseException:
            if _take_back_stop(ticket, runner):  # the work turned the retire's cancellation into an error
                raise _stale(ticket) from None
            raise
        finally:
            ticket.runner = None
        if _take_back_stop(ticket, runner):  # the work swallowed the retire's cancellation
            raise _stale(ticket)
        return result


def _take_back_stop(ticket: Ticket, runner: asyncio.Task[object]) -> bool:
    """Undo the cancellations ``ActiveCalls.stop`` made of ``runner``; ``True`` if there were any and
    no other cancellation of it is pending (a retire alone stopped the work)."""
    cancels, ticket.stop_cancels = ticket.stop_cancels, 0
    for _ in range(cancels):
        runner.uncancel()
    return cancels > 0 and runner.cancelling() == 0


def _replaced(value: R, **changes: object) -> R:
    """``dataclasses.replace`` for the plain frozen dataclasses of ``generation`` (no ``__post_init__``,
    no slots), as a shallow copy of their fields: a sixth of its cost, on every call."""
    copied = object.__new__(type(value))
    copied.__dict__.update(value.__dict__, **changes)
    return copied


def _stale(ticket: Ticket) -> StaleAttempt:
    return StaleAttempt(f"attempt {ticket.episode.capture_key} was retired during the call")


def _discard(work: Awaitable[object]) -> None:
    """Close work that will never be awaited (a coroutine not started)."""
    close = getattr(work, "close", None)
    if callable(close):
        close()


async def _read_to_end(events: AsyncIterator[StreamEvent]) -> tuple[list[StreamEvent], GymError | None]:
    ahead: list[StreamEvent] = []
    try:
        async for event in events:
            ahead.append(event)
    except GymError as error:
        return ahead, error
    return ahead, None


class CustodyBackend:
    """A ``Backend`` that runs every call of ``inner`` under ``custody``."""

    def __init__(self, inner: Backend, custody: Custody) -> None:
        self._inner = inner
        self._custody = custody

    @property
    def model_name(self) -> str:
        return self._inner.model_name

    async def start(self) -> None:
        await self._inner.start()

    async def complete(self, call: ChatCall) -> ChatResult:
        custody = self._custody
        ticket = await custody.admit(call)
        try:
            result = await custody.generated(ticket, self._inner.complete(custody.as_sent(call, ticket)))
            await custody.hold(ticket)
            custody.deliver(ticket, result)
            return custody.named(ticket, result)
        finally:
            custody.release(ticket)

    async def stream(self, call: ChatCall) -> AsyncGenerator[StreamEvent, None]:
        custody = self._custody
        ticket = await custody.admit(call)
        try:
            events = self._inner.stream(custody.as_sent(call, ticket))
            async with contextlib.aclosing(events):
                source = await custody.opened(ticket, events)
                custody.delivering(ticket)
                async for event in source:
                    custody.check_retired(ticket)
                    yield event
                    if isinstance(event, ChatResult):
                        custody.check_retired(ticket)  # retired while it went out: no row
                        custody.deliver(ticket, event)
        finally:
            custody.release(ticket)
