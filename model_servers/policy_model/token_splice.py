"""Prompt token ids that reuse the ids of earlier turns instead of re-tokenizing their text.

A conversation that comes back with an assistant turn carrying ``prompt_token_ids`` and
``generation_token_ids`` (what this server returned for that turn) already has exact ids for
everything up to the end of that turn. The next prompt is those ids followed by the encoding of
only the newly rendered suffix. The known ids are trusted only if their decoded text is exactly
the start of the newly rendered prompt; otherwise the whole prompt is encoded afresh (and logged),
because a spliced prompt whose text disagrees with the conversation would be silently wrong.

After a restore (review E10, fix W1: cross-attempt parent resolution), the caller may send its
earlier assistant turns back without token fields: records never carry token arrays, so a
restored agent lost them. The policy model then knows them from its capture ledger (the token
sidecar of the checkpoint, keyed by the rows' digests) and passes the prompt + generation ids of
the calls the earlier attempts delivered as ``restored`` candidates (``lost_its_tokens`` says when:
the last assistant turn has no token fields). The longest candidate whose decoded text starts the
rendered prompt is spliced, exactly as the uninterrupted run would have spliced the ids the
caller sent back; when none matches (the caller changed the text), the prompt is encoded afresh
and a warning names the mismatch. A restored conversation is never re-tokenized when the ledger
knows its ids.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from nemo_gym_ckpt.errors import InvalidRequest

__all__ = ["PromptIds", "Tokenizes", "known_prefix", "lost_its_tokens", "prompt_ids"]

logger = logging.getLogger(__name__)


class Tokenizes(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class PromptIds:
    ids: list[int]
    reused: int  # how many leading ids came from an earlier turn unchanged
    source: str | None = None  # where they came from: "message" (the caller's) or "ledger" (restored)


def known_prefix(messages: Sequence[dict[str, Any]]) -> list[int] | None:
    """Prompt + generation ids of the last assistant turn that carries them."""
    for message in reversed(messages):
        if message.get("role") != "assistant":
            continue
        prompt, generation = message.get("prompt_token_ids"), message.get("generation_token_ids")
        if prompt is not None and generation is not None:
            return [*prompt, *generation]
    return None


def lost_its_tokens(messages: Sequence[dict[str, Any]]) -> bool:
    """The last assistant turn came back without token fields (there is one)."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return message.get("prompt_token_ids") is None or message.get("generation_token_ids") is None
    return False


def prompt_ids(
    fmt: Tokenizes, text: str, known: list[int] | None, restored: Sequence[list[int]] = ()
) -> PromptIds:
    """The ids of the rendered prompt ``text``, starting with the longest of ``known`` (the caller's)
    and ``restored`` (the ledger's, already checked against its digests) whose text starts it."""
    if known:
        _check_range(known, fmt.vocab_size)
    candidates = [(ids, "message") for ids in [known] if ids] + [(ids, "ledger") for ids in restored if ids]
    if not candidates:
        return PromptIds(fmt.encode(text), 0)
    for ids, source in sorted(candidates, key=lambda candidate: len(candidate[0]), reverse=True):
        known_text = fmt.decode(ids)
        if text.startswith(known_text):
            return PromptIds([*ids, *fmt.encode(text[len(known_text) :])], len(ids), source)
    logger.warning(
        "known token ids (%s) do not decode to the start of the rendered prompt; encoding the whole "
        "prompt (%d chars) afresh", ", ".join(f"{len(ids)} from the {source}" for ids, source in candidates),
        len(text),
    )
    return PromptIds(fmt.encode(text), 0)


def _check_range(ids: Sequence[int], vocab_size: int) -> None:
    bad = next((token for token in ids if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary (size {vocab_size})")
