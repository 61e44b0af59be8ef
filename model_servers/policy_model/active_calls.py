"""The policy's calls in flight while checkpointing is on: one ``Ticket`` per admitted call.

A ticket is opened when a call is admitted and closed when its reply was delivered, refused or
abandoned. Its ``state`` says where the call is:

- ``generating``: admitted; the engine works on it and nothing was delivered;
- ``held``: it finished while a checkpoint was open; the reply waits for resume and the call is
  left out of the commit (after a restore the agent makes it again);
- ``delivering``: a stream whose first event went out; it blocks a prepare until it drains.

A retire stops the tickets of the retired attempts (``stop``) and waits for them to close. A ticket
whose call is generating names the task that awaits the generation (``runner``, set by the custody
while it awaits); ``stop`` cancels that task, and the custody turns the cancellation into
``stale_attempt``. The generation runs in the request's own task, as with checkpointing off: no
task and no waiter per call.
Generation cuts (docs/protocol.md section 8) take ``cut_inventory(scope)``: per episode in scope, the
latest admitted call still generating, as ``{ticket_id, rollout_id, attempt, model_call_id,
admitted_at}``; ``cut_candidates`` gives the tickets themselves (with the ``ChatCall`` and the
rollout's lineage when the call was admitted: the parent call and how many calls the ledger held).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from model_servers.policy_model.generation import TOKEN_FIELDS, ChatCall
from model_servers.policy_model.ids import sha256_of
from nemo_gym_ckpt.checkpoint.admission import Signal
from nemo_gym_ckpt.checkpoint.records import Scope
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["ActiveCalls", "CallState", "Ticket", "conversation_digest"]


class CallState(StrEnum):
    GENERATING = "generating"
    HELD = "held"
    DELIVERING = "delivering"


def conversation_digest(call: ChatCall) -> str:
    """What a call said, to match it again after a restore: its messages without the token capture
    fields (``TOKEN_FIELDS``), its tools and its tool choice.

    A restored agent re-issues the call from its checkpointed conversation, and records never carry
    token arrays: its earlier assistant turns come back with the same text and tool calls but without
    ``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs`` or ``policy_version``
    (or with arrays put back from elsewhere). The digest leaves exactly those out; anything else (a
    role, a text, a tool call id or argument, a tool, the tool choice, the order) still changes it.
    Whether the continued prompt is the staged one is the worker's check (by prompt digest).
    """
    messages = [{key: value for key, value in message.items() if key not in TOKEN_FIELDS}
                for message in call.messages]
    return sha256_of({"messages": messages, "tools": call.tools, "tool_choice": call.tool_choice})


@dataclass(eq=False)
class Ticket:
    """One admitted call."""

    ticket_id: str
    model_call_id: str
    episode: RolloutIdentity
    admitted_at: float
    conversation_digest: str
    call: ChatCall
    parent_call_id: str | None = None  # the rollout's lineage when the call was admitted
    previous_length: int = 0
    state: CallState = CallState.GENERATING
    stopped: bool = False  # its attempt was retired
    runner: asyncio.Task[Any] | None = field(default=None, repr=False)  # the task awaiting its generation
    stop_cancels: int = 0  # cancellations of ``runner`` by ``stop`` not yet taken back by the custody

    def inventory_entry(self) -> dict[str, Any]:
        """The ticket as a generation-cut inventory lists it."""
        return {
            "ticket_id": self.ticket_id,
            "rollout_id": self.episode.rollout_id,
            "attempt": self.episode.attempt,
            "model_call_id": self.model_call_id,
            "admitted_at": float(self.admitted_at),
        }


class ActiveCalls:
    """The open tickets, and a signal that fires whenever one changes state or closes."""

    def __init__(self) -> None:
        self._open: dict[str, Ticket] = {}
        self._prefix = secrets.token_hex(4)
        self._numbers = itertools.count(1)
        self.changed = Signal()

    def __len__(self) -> int:
        return len(self._open)

    def open(
        self, episode: RolloutIdentity, call: ChatCall, admitted_at: float, *,
        parent_call_id: str | None = None, previous_length: int = 0,
    ) -> Ticket:
        ticket = Ticket(
            ticket_id=f"tk-{self._prefix}-{next(self._numbers)}",
            model_call_id=f"mc_{secrets.token_hex(12)}",
            episode=episode,
            admitted_at=admitted_at,
            conversation_digest=conversation_digest(call),
            call=call,
            parent_call_id=parent_call_id,
            previous_length=previous_length,
        )
        self._open[ticket.ticket_id] = ticket
        return ticket

    def mark(self, ticket: Ticket, state: CallState) -> None:
        ticket.state = state
        self.changed.notify()

    def close(self, ticket: Ticket) -> None:
        if self._open.pop(ticket.ticket_id, None) is not None:
            self.changed.notify()

    def count(self, state: CallState) -> int:
        return sum(1 for ticket in self._open.values() if ticket.state is state)

    def delivering_keys(self) -> list[str]:
        """Capture keys with a stream being delivered (what blocks a prepare), each once."""
        keys = (t.episode.capture_key for t in self._open.values() if t.state is CallState.DELIVERING)
        return list(dict.fromkeys(keys))

    def stop(self, episodes: Iterable[RolloutIdentity]) -> list[Ticket]:
        """Stop the calls of these attempts and of every earlier attempt of their rollouts."""
        marks: dict[str, int] = {}
        for episode in episodes:
            marks[episode.rollout_id] = max(episode.attempt, marks.get(episode.rollout_id, -1))
        stopped = [t for t in self._open.values() if t.episode.attempt <= marks.get(t.episode.rollout_id, -1)]
        for ticket in stopped:
            ticket.stopped = True
            runner = ticket.runner
            if runner is not None and runner is not asyncio.current_task() and runner.cancel():
                ticket.stop_cancels += 1
        return stopped

    async def wait_closed(self, tickets: Iterable[Ticket]) -> None:
        """Until every one of ``tickets`` is closed (the caller bounds the wait with its deadline)."""
        waited = list(tickets)
        while True:
            changed = self.changed.current
            if not any(ticket.ticket_id in self._open for ticket in waited):
                return
            await changed.wait()

    def cut_candidates(self, scope: Scope | None) -> list[Ticket]:
        """Per episode in ``scope`` (``None``: all), its latest admitted call still generating."""
        latest: dict[RolloutIdentity, Ticket] = {}
        for ticket in self._open.values():
            in_scope = scope is None or ticket.episode in scope
            if ticket.state is not CallState.GENERATING or not in_scope:
                continue
            known = latest.get(ticket.episode)
            if known is None or ticket.admitted_at >= known.admitted_at:
                latest[ticket.episode] = ticket
        return list(latest.values())

    def cut_inventory(self, scope: Scope | None) -> list[dict[str, Any]]:
        """The ``active_prefixes`` of a generation-cut request for ``scope``."""
        return [ticket.inventory_entry() for ticket in self.cut_candidates(scope)]
