"""What the routes need from whatever generates: our inference worker or an external server.

Every model call of the server goes through one ``Backend``: ``complete`` for a whole reply,
``stream`` for an event stream that starts with ``StreamStarted`` (yielded only once the call
was accepted, so a refusal is still a plain error reply), then ``TextDelta`` pieces, and ends
with the ``ChatResult``. That single choke point is where the checkpoint participant of
docs/protocol.md section 8 gates admission, holds finished replies and records the capture ledger:
``custody.CustodyBackend`` wraps the real ``Backend``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

from model_servers.policy_model.generation import ChatCall, ChatResult, StreamEvent

__all__ = ["Backend"]


class Backend(Protocol):
    @property
    def model_name(self) -> str:
        """The name served in replies and ``/v1/models``."""
        ...

    async def start(self) -> None:
        """Load what the backend needs before the first call (tokenizer...)."""

    async def complete(self, call: ChatCall) -> ChatResult: ...

    def stream(self, call: ChatCall) -> AsyncGenerator[StreamEvent, None]: ...
