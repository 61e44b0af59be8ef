"""kv_store: a small key-value store per session; verify compares the final store with the task's.

Tools ``kv_set``, ``kv_get``, ``kv_delete`` and ``kv_list`` change and read the store of the
caller's session (the session cookie from ``/seed_session``). A task may seed the store with
``initial_state``; verify gives 1.0 when the final store equals ``expected_state`` exactly.

The session state is plain JSON, ``{"items": {key: value}}``, kept in the base's session table:
the server declares ``exported`` + ``wait``. Its checkpoint hooks export that state and check a
restored one (``KvState``, at most ``max_keys`` keys); it keeps the default ``park_session`` and
``retire_session``, since every tool call finishes inside its request and nothing lives outside
the state.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.errors import InvalidRequest
from nemo_gym_ckpt.resources.base import (
    ResourcesConfig,
    ResourcesServer,
    Session,
    TaskRow,
    ToolArgs,
    Verdict,
    VerifyRequest,
    tool,
)
from nemo_gym_ckpt.server import close_on_shutdown

__all__ = [
    "Config",
    "KeyArgs",
    "KvSeedTask",
    "KvState",
    "KvStore",
    "KvVerdict",
    "KvVerifyTask",
    "NoArgs",
    "SetArgs",
    "create_app",
    "items_of",
]

Key = Annotated[str, Field(strict=True, min_length=1, max_length=128)]
Value = Annotated[str, Field(strict=True, max_length=4096)]


class Config(ResourcesConfig):
    max_keys: int = Field(256, ge=1, le=100_000)


class KeyArgs(ToolArgs):
    key: Key


class SetArgs(ToolArgs):
    key: Key
    value: Value


class NoArgs(ToolArgs):
    pass


class KvSeedTask(TaskRow):
    initial_state: dict[Key, Value] = Field(default_factory=dict)


class KvVerifyTask(VerifyRequest):
    expected_state: dict[Key, Value]


class KvVerdict(Verdict):
    final_state: dict[str, str]
    mismatched_keys: list[str]


class KvState(BaseModel):
    """The exported state of one session (its checkpoint record's ``state``)."""

    model_config = ConfigDict(extra="forbid")

    items: dict[Key, Value]


def items_of(session: Session) -> dict[str, str]:
    """The session's store (the ``items`` of its JSON state)."""
    items: dict[str, str] = session.state.setdefault("items", {})
    return items


class KvStore(ResourcesServer[Config]):
    checkpoint_mode = "exported"
    checkpoint_verify = "wait"

    async def initial_state(self, task: KvSeedTask) -> dict[str, Any]:
        if len(task.initial_state) > self.settings.max_keys:
            raise InvalidRequest(f"initial_state has more than max_keys={self.settings.max_keys} keys")
        return {"items": dict(task.initial_state)}

    @tool
    async def kv_set(self, args: SetArgs, session: Session) -> dict[str, Any]:
        """Store a string value under a key (replacing any previous value)."""
        items = items_of(session)
        if args.key not in items and len(items) >= self.settings.max_keys:
            raise InvalidRequest(f"the store is full ({self.settings.max_keys} keys): delete a key first")
        items[args.key] = args.value
        return {"key": args.key, "value": args.value}

    @tool
    async def kv_get(self, args: KeyArgs, session: Session) -> dict[str, Any]:
        """Read the value stored under a key (found is false when there is none)."""
        value = items_of(session).get(args.key)
        return {"key": args.key, "value": value, "found": value is not None}

    @tool
    async def kv_delete(self, args: KeyArgs, session: Session) -> dict[str, Any]:
        """Delete a key (deleted is false when it was not there)."""
        return {"key": args.key, "deleted": items_of(session).pop(args.key, None) is not None}

    @tool
    async def kv_list(self, args: NoArgs, session: Session) -> dict[str, Any]:
        """List the stored keys, sorted."""
        return {"keys": sorted(items_of(session))}

    async def export_session(self, session: Session) -> dict[str, Any]:
        return {"items": items_of(session)}

    async def restore_session(self, state: Any) -> dict[str, Any]:
        items = KvState.model_validate(state).items  # a ValidationError is a ValueError
        if len(items) > self.settings.max_keys:
            raise ValueError(f"{len(items)} keys, more than max_keys={self.settings.max_keys}")
        return {"items": dict(items)}

    async def verify(self, task: KvVerifyTask, session: Session) -> KvVerdict:
        final, expected = items_of(session), task.expected_state
        wrong = sorted(key for key in final.keys() | expected.keys() if final.get(key) != expected.get(key))
        return KvVerdict(reward=0.0 if wrong else 1.0, final_state=dict(final), mismatched_keys=wrong)


def create_app(ctx: ServerContext[Config]) -> FastAPI:
    return close_on_shutdown(KvStore(ctx).build_app(), ctx.aclose)
