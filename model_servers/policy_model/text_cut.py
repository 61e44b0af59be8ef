"""Where the visible text of a generation ends, for whole replies and for streams.

A generation's decoded text ends at the first *end marker*: the eos token's text (the worker
includes the stop token in its ids) or a caller's stop string. While streaming, content is
released only when it cannot turn out to be part of a marker or of a tool-call block: text from
the first ``<tool_call>`` on waits for the final parse, and a tail that could still grow into a
marker (``<|en`` before ``<|end|>``), or an incomplete UTF-8 character, is held back.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ContentStreamer", "cut_at_markers"]

_REPLACEMENT = "\ufffd"


def cut_at_markers(text: str, markers: Sequence[str]) -> str:
    """``text`` up to the earliest occurrence of any non-empty marker."""
    cut = len(text)
    for marker in markers:
        if marker:
            found = text.find(marker)
            if 0 <= found < cut:
                cut = found
    return text[:cut]


def _held_tail(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


class ContentStreamer:
    """Turns the growing decoded text of one generation into content deltas that never retract."""

    def __init__(self, markers: Sequence[str]) -> None:
        self._markers = [marker for marker in markers if marker]
        self.emitted = ""

    def feed(self, text: str) -> str:
        """The new safe content given the whole decoded text so far ("" if nothing new)."""
        return self._advance(self._safe(text))

    def finish(self, content: str) -> str:
        """The rest of the final content after everything already emitted."""
        return self._advance(content)

    def _safe(self, text: str) -> str:
        visible = cut_at_markers(text, self._markers)
        if len(visible) == len(text):
            visible = visible[: len(visible) - _held_tail(visible, self._markers)]
        return visible.rstrip(_REPLACEMENT)

    def _advance(self, visible: str) -> str:
        if not visible.startswith(self.emitted):
            return ""
        delta = visible[len(self.emitted) :]
        self.emitted = visible
        return delta
