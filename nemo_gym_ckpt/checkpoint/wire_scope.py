"""Episode lists and records as a worker channel carries them (JSON, no Python objects).

A scope is a list of ``{rollout_id, attempt}`` objects or ``None`` (everything); a record is
``{"raw": <its exact JSON text>}`` when it is a ``Record`` (bytes kept for a byte-for-byte export
again) or ``{"data": <object>}`` when an adapter exported a fresh one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from nemo_gym_ckpt.checkpoint.adapter import ExportItem
from nemo_gym_ckpt.checkpoint.records import Record, Scope
from nemo_gym_ckpt.errors import GymError, InvalidCheckpointState
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = ["episodes_from_wire", "episodes_to_wire", "item_from_wire", "item_to_wire", "scope_from_wire",
           "scope_to_wire"]


def episodes_to_wire(episodes: Iterable[RolloutIdentity]) -> list[dict[str, Any]]:
    return [{"rollout_id": episode.rollout_id, "attempt": episode.attempt} for episode in episodes]


def episodes_from_wire(value: Any) -> list[RolloutIdentity]:
    if not isinstance(value, list):
        raise InvalidCheckpointState("a worker message's episode list is not a list")
    try:
        return [RolloutIdentity(item["rollout_id"], item["attempt"]) for item in value]
    except (KeyError, TypeError, ValueError, GymError) as error:
        raise InvalidCheckpointState(f"a worker message names a bad episode: {error}") from None


def scope_to_wire(scope: Scope | None) -> list[dict[str, Any]] | None:
    return None if scope is None else episodes_to_wire(sorted(scope, key=lambda e: (e.rollout_id, e.attempt)))


def scope_from_wire(value: Any) -> Scope | None:
    return None if value is None else frozenset(episodes_from_wire(value))


def item_to_wire(item: ExportItem) -> dict[str, Any]:
    if isinstance(item, Record):
        return {"raw": item.raw.decode()}
    return {"data": dict(item)}


def item_from_wire(value: Any) -> ExportItem:
    if isinstance(value, Mapping) and isinstance(value.get("raw"), str):
        return Record.from_raw(value["raw"].encode())
    if isinstance(value, Mapping) and isinstance(value.get("data"), dict):
        return value["data"]
    raise InvalidCheckpointState("a worker's record is neither {raw} nor {data}")
