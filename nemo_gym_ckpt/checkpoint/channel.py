"""Calls both ways over one stream of frames: the link between a worker and its coordinator.

Messages (``checkpoint/frames.py`` carries each in one frame):

- a call ``{"id": n, "kind": str, "body": {...}}``, answered by ``{"reply_to": n, "ok": true,
  "body": {...}}`` or ``{"reply_to": n, "ok": false, "error": {"status", "code", "detail"}}``;
- a note ``{"kind": str, "body": {...}}``: no reply, handled before the next frame is read, so a
  note and the calls written after it arrive in that order (the coordinator's gate changes rely on
  it).

``call`` waits at most its timeout; a call that times out, a channel that is closed or ends, and a
write that fails are all ``CoordinatorUnavailable`` (503). A remote ``GymError`` is raised again
here as the same class (by its code); a reply that cannot be framed (over the bound) is answered
with that refusal instead. A frame that breaks the rules closes the channel (the reason is
logged). Handlers run as tasks, one per call; ``on_closed`` runs once when the channel ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nemo_gym_ckpt.checkpoint.frames import MAX_FRAME_BYTES, encode_frame, read_frame
from nemo_gym_ckpt.errors import ERROR_CODES, CoordinatorUnavailable, GymError, InternalError, InvalidCheckpointState

__all__ = ["Channel", "Handler", "Note"]

logger = logging.getLogger(__name__)
Handler = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
Note = Callable[[str, dict[str, Any]], None]
# What a handler may raise besides GymError and still get a structured reply (500, logged).
_HANDLER_BUGS = (RuntimeError, ValueError, TypeError, KeyError, AssertionError, OSError)


class Channel:
    """One end of a worker channel."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        on_call: Handler,
        on_note: Note,
        name: str,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        on_closed: Callable[[], None] | None = None,
    ) -> None:
        self.reader, self.writer, self.name = reader, writer, name
        self.on_call, self.on_note, self.on_closed = on_call, on_note, on_closed
        self.max_frame_bytes = max_frame_bytes
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed = False

    async def serve(self) -> None:
        """Read frames until the stream ends or breaks the rules; then close."""
        try:
            while (message := await read_frame(self.reader, self.max_frame_bytes)) is not None:
                self._dispatch(message)
        except InvalidCheckpointState as error:
            logger.warning("worker channel %s: %s; closing it", self.name, error.detail)
        except (ConnectionError, OSError) as error:
            logger.warning("worker channel %s: %s", self.name, error)
        finally:
            self.close()

    async def call(self, kind: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send a call and wait (at most ``timeout_s``) for its reply body."""
        if self.closed:
            raise CoordinatorUnavailable(f"the worker channel {self.name} is closed")
        number = next(self._ids)
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[number] = reply
        try:
            self._write({"id": number, "kind": kind, "body": body})
            async with asyncio.timeout(max(timeout_s, 0.0)):
                return await reply
        except TimeoutError:
            raise CoordinatorUnavailable(f"{kind} over the worker channel {self.name} got no reply "
                                         f"within {timeout_s:.1f} s") from None
        finally:
            self._pending.pop(number, None)

    def note(self, kind: str, body: dict[str, Any]) -> None:
        """Send a note (no reply); ``CoordinatorUnavailable`` when the channel is closed."""
        if self.closed:
            raise CoordinatorUnavailable(f"the worker channel {self.name} is closed")
        self._write({"kind": kind, "body": body})

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for reply in self._pending.values():
            if not reply.done():
                reply.set_exception(CoordinatorUnavailable(f"the worker channel {self.name} closed"))
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(RuntimeError, OSError):
            self.writer.close()
        if self.on_closed is not None:
            self.on_closed()

    def _write(self, message: dict[str, Any]) -> None:
        frame = encode_frame(message, self.max_frame_bytes)
        try:
            self.writer.write(frame)
        except (ConnectionError, OSError, RuntimeError) as error:
            self.close()
            raise CoordinatorUnavailable(f"the worker channel {self.name} broke: {error}") from None

    def _dispatch(self, message: dict[str, Any]) -> None:
        if "reply_to" in message:
            self._resolve(message)
            return
        kind, body, number = message.get("kind"), message.get("body"), message.get("id")
        if not isinstance(kind, str) or not isinstance(body, dict):
            raise InvalidCheckpointState("a frame must hold a string kind and an object body")
        if number is None:
            try:
                self.on_note(kind, body)
            except (ValueError, TypeError, KeyError) as error:  # a note that makes no sense here
                raise InvalidCheckpointState(f"a {kind!r} note could not be used: {error}") from None
        elif type(number) is int:
            task = asyncio.create_task(self._answer(number, kind, body))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            raise InvalidCheckpointState("a call's id must be an integer")

    def _resolve(self, message: dict[str, Any]) -> None:
        reply = self._pending.get(message["reply_to"]) if type(message["reply_to"]) is int else None
        if reply is None or reply.done():
            return  # a reply to a call that already timed out
        if message.get("ok") is True and isinstance(message.get("body"), dict):
            reply.set_result(message["body"])
            return
        error = message.get("error")
        if not isinstance(error, dict):
            raise InvalidCheckpointState("a failed reply must hold an error object")
        cls = ERROR_CODES.get(str(error.get("code")), InternalError)
        reply.set_exception(cls(str(error.get("detail", ""))))

    async def _answer(self, number: int, kind: str, body: dict[str, Any]) -> None:
        try:
            result = await self.on_call(kind, body)
            reply: dict[str, Any] = {"reply_to": number, "ok": True, "body": result}
        except GymError as error:
            reply = _failed(number, error)
        except _HANDLER_BUGS as error:
            logger.error("worker channel %s: %s failed", self.name, kind, exc_info=error)
            reply = _failed(number, InternalError(f"{kind} failed: {type(error).__name__}"))
        if not self.closed:
            with contextlib.suppress(CoordinatorUnavailable):
                self._reply(kind, reply)

    def _reply(self, kind: str, reply: dict[str, Any]) -> None:
        """Send ``reply``; one that cannot be framed (over the bound, not JSON) is answered with why."""
        try:
            self._write(reply)
        except InvalidCheckpointState as error:
            logger.error("worker channel %s: the reply to %s cannot be sent: %s", self.name, kind, error.detail)
            self._write(_failed(reply["reply_to"], error))


def _failed(number: int, error: GymError) -> dict[str, Any]:
    return {"reply_to": number, "ok": False,
            "error": {"status": error.status, "code": error.code, "detail": error.detail}}
