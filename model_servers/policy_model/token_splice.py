"""Prompt token ids that reuse the ids of earlier turns instead of re-tokenizing their text.

A conversation that comes back with an assistant turn carrying ``prompt_token_ids`` and
``generation_token_ids`` (what this server returned for that turn) already has exact ids for
everything up to the end of that turn. The next prompt is those ids followed by the encoding of
only the newly rendered suffix. The known ids are trusted only if their decoded text is exactly
the start of the newly rendered prompt; otherwise the whole prompt is encoded afresh (and logged),
because a spliced prompt whose text disagrees with the conversation would be silently wrong.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from nemo_gym_ckpt.errors import InvalidRequest

__all__ = ["PromptIds", "Tokenizes", "known_prefix", "prompt_ids"]

logger = logging.getLogger(__name__)


class Tokenizes(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class PromptIds:
    ids: list[int]
    reused: int  # how many leading ids came from an earlier turn unchanged


def known_prefix(messages: Sequence[dict[str, Any]]) -> list[int] | None:
    """Prompt + generation ids of the last assistant turn that carries them."""
    for message in reversed(messages):
        if message.get("role") != "assistant":
            continue
        prompt, generation = message.get("prompt_token_ids"), message.get("generation_token_ids")
        if prompt is not None and generation is not None:
            return [*prompt, *generation]
    return None


def prompt_ids(fmt: Tokenizes, text: str, known: list[int] | None) -> PromptIds:
    """The ids of the rendered prompt ``text``, starting with ``known`` when it matches."""
    if not known:
        return PromptIds(fmt.encode(text), 0)
    _check_range(known, fmt.vocab_size)
    known_text = fmt.decode(known)
    if not text.startswith(known_text):
        logger.warning(
            "known token ids (%d) do not decode to the start of the rendered prompt; "
            "encoding the whole prompt (%d chars) afresh", len(known), len(text),
        )
        return PromptIds(fmt.encode(text), 0)
    return PromptIds([*known, *fmt.encode(text[len(known_text) :])], len(known))


def _check_range(ids: Sequence[int], vocab_size: int) -> None:
    bad = next((token for token in ids if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary (size {vocab_size})")
