"""A reply's echoes of its request, left out of what a checkpoint keeps and put back from the request.

NeMo Gym's replies repeat their requests: a Responses object carries the request's ``tools``,
``instructions`` and sampling parameters; a verifier's ``/verify`` reply carries the whole request
(the task row's ``responses_create_params``, the agent's ``response``). A participant that keeps
such a reply at a checkpoint, and gets the same request again after a restore (its digest checked),
need not write the repeated values: ``without_echoes`` nulls every value of the reply equal (as
canonical JSON) to the request's value of the same name and names those keys; ``with_echoes`` puts
the request's values back in place, so the reply is the one that was answered, key order included.
Scalars are never left out (a null saves nothing on them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nemo_gym_ckpt.canonical import canonical_json

__all__ = ["echoed_keys", "with_echoes", "without_echoes"]


def echoed_keys(reply: Mapping[str, Any], request: Mapping[str, Any]) -> list[str]:
    """The keys of ``reply`` whose object, array or string value equals ``request``'s of that name."""
    return [key for key, value in reply.items()
            if isinstance(value, dict | list | str) and key in request
            and canonical_json(value) == canonical_json(request[key])]


def without_echoes(reply: Mapping[str, Any], echoed: Sequence[str]) -> dict[str, Any]:
    """``reply`` with the ``echoed`` keys' values null (the keys stay, in place); the values are shared."""
    return {key: None if key in echoed else value for key, value in reply.items()}


def with_echoes(reply: Mapping[str, Any], echoed: Sequence[str], request: Mapping[str, Any]) -> dict[str, Any]:
    """``reply`` with the ``echoed`` keys' values taken from ``request``; ``ValueError`` when
    either lacks one of them (a checkpoint that does not fit its request)."""
    missing = [key for key in echoed if key not in reply or key not in request]
    if missing:
        raise ValueError(f"the reply echoes {missing}, which it or its request lacks")
    return {key: request[key] if key in echoed else value for key, value in reply.items()}
