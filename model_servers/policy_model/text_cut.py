"""Where the visible text of a generation ends, for whole replies and for streams.

A generation's decoded text ends at the first *end marker*: the eos token's text (the worker
includes the stop token in its ids) or a caller's stop string. While streaming, content is
released only when it cannot turn out to be part of a marker or of a tool-call block: text from
the first ``<tool_call>`` on waits for the final parse, and a tail that could still grow into a
marker (``<|en`` before ``<|end|>``), or an incomplete UTF-8 character, is held back.

Sent text is never taken back, and a stream never stalls. A later id can change text already
sent: with SentencePiece's byte fallback a run of byte tokens is decoded whole, so "é" (two bytes)
followed by the byte ``<0xFF>`` becomes three U+FFFD; transformers' clean-up turns " ." into ".".
While the text ends in U+FFFD such a change may still be undone (a character whose bytes have not
all come), so nothing is sent; once it does not, the stream goes on from where the text and what
was sent part: every later character of the content is sent, after the sent text it cannot take
back. vLLM's OpenAI server does the same in kind (it holds back text ending in U+FFFD and never
takes back sent text); it slices its later text by position (past the length sent), which, once
sent text changed, can skip characters of the content, where this sends all of them. So the deltas join to the
non-streamed content whenever no sent text changed; otherwise they join to that content with the
text that changed left in, where it was sent.

A stream costs time linear in its length: its text is decoded incrementally (the inference
worker's ``IncrementalDetokenizer``), and each chunk looks only at the characters it may have
changed (markers are searched from ``len(longest marker) - 1`` before them) and at those not yet
sent. The deltas are exactly those of decoding all the ids and reading all the text at every chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

from model_servers.inference_worker.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, TokenDecoder

__all__ = ["ContentStreamer", "cut_at_markers"]


def cut_at_markers(text: str, markers: Sequence[str]) -> str:
    """``text`` up to the earliest occurrence of any non-empty marker."""
    found = _earliest_marker(text, markers)
    return text if found is None else text[:found]


def _earliest_marker(text: str, markers: Sequence[str]) -> int | None:
    """Where the earliest non-empty marker begins in ``text`` (``None``: nowhere)."""
    found = [index for index in (text.find(marker) for marker in markers if marker) if index >= 0]
    return min(found, default=None)


def _common_prefix_length(first: str, second: str) -> int:
    size = min(len(first), len(second))
    return next((index for index in range(size) if first[index] != second[index]), size)


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
    """Turns the ids of one generation, chunk by chunk, into content deltas that never retract.

    The stream follows the *delivered* text: what was sent, as far as the text still reads it. Each
    delta is what the content seen whole (the text of all the ids so far, cut at the earliest
    marker, less a tail that may become a marker, less trailing U+FFFD) adds past the delivered
    text. When the text no longer starts with the delivered text and does not end in U+FFFD, the
    delivered text is cut back to where they part (what was sent past it stays sent).
    """

    def __init__(self, tokenizer: TokenDecoder, markers: Sequence[str]) -> None:
        self._text = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
        self._markers = [marker for marker in markers if marker]
        self._longest = max((len(marker) for marker in self._markers), default=1)
        self._cut: int | None = None  # where the earliest marker begins in the text
        self._visible = 0  # where the visible text (before its U+FFFD are stripped) ended last chunk
        self._deltas: list[str] = []  # every delta sent
        self._delivered: list[str] = []  # the delivered text, in pieces
        self._delivered_length = 0
        self._agree = 0  # the length of the common prefix of the text and the delivered text

    @property
    def emitted(self) -> str:
        """All the content sent so far."""
        if len(self._deltas) > 1:
            self._deltas[:] = ["".join(self._deltas)]
        return "".join(self._deltas)

    def add(self, ids: Sequence[int]) -> str:
        """Take one chunk's ids; returns the new safe content ("" if nothing new)."""
        if not ids:
            return ""
        unchanged = min([self._text.add(token_id) for token_id in ids])
        self._compare_delivered(unchanged)
        visible = self._visible_end(unchanged)
        if visible == self._visible and visible <= unchanged and not self._parted():
            return ""  # the same visible text as last chunk
        self._visible = visible
        return self._advance(visible)

    def finish(self, content: str) -> str:
        """The rest of the final content after the delivered text (all of it past where they part)."""
        delivered = "".join(self._delivered)
        agree = len(delivered) if content.startswith(delivered) else _common_prefix_length(content, delivered)
        delta = content[agree:]
        self._send(delta)
        self._delivered[:] = [content]
        self._delivered_length = self._agree = len(content)
        return delta

    def _parted(self) -> bool:
        """Whether the text no longer starts with the delivered text."""
        return self._agree < self._delivered_length

    def _compare_delivered(self, unchanged: int) -> None:
        """Keep ``_agree`` for the new text, whose first ``unchanged`` characters are the old ones'."""
        if self._agree < unchanged or unchanged >= self._delivered_length:
            return  # a difference within the unchanged text stays; a delivered text within it still agrees
        size = self._delivered_length - unchanged
        text = self._text.text_from(unchanged)[:size]
        self._agree = unchanged + _common_prefix_length(text, self._delivered_suffix(size))

    def _delivered_suffix(self, size: int) -> str:
        """The last ``size`` characters of the delivered text."""
        parts: list[str] = []
        for piece in reversed(self._delivered):
            if size <= 0:
                break
            parts.append(piece[-size:])
            size -= len(piece)
        return "".join(reversed(parts))

    def _visible_end(self, unchanged: int) -> int:
        """Where the text is cut: at the earliest marker, else before a tail that may become one."""
        start = max(0, unchanged - self._longest + 1)  # a marker found now ends past ``unchanged``
        if self._cut is None or self._cut >= start:
            found = _earliest_marker(self._text.text_from(start), self._markers)
            self._cut = None if found is None else start + found
        if self._cut is not None:
            return self._cut
        length = len(self._text)
        end = self._text.text_from(max(0, length - self._longest + 1))
        return length - _held_tail(end, self._markers)

    def _advance(self, visible: int) -> str:
        """Send the visible text past the delivered text, less trailing U+FFFD; where the text parted
        from the delivered text, first cut that back to where they part, unless the text ends in
        U+FFFD (an id still to come may undo the change)."""
        if self._parted():
            if self._text.text_from(len(self._text) - 1) == REPLACEMENT_CHAR:
                return ""
            self._cut_delivered(self._agree)
        if visible <= self._delivered_length:
            return ""
        start = self._delivered_length
        delta = self._text.text_from(start)[: visible - start].rstrip(REPLACEMENT_CHAR)
        if delta:
            self._send(delta)
            self._delivered.append(delta)
            self._delivered_length = self._agree = start + len(delta)
        return delta

    def _send(self, delta: str) -> None:
        if delta:
            self._deltas.append(delta)

    def _cut_delivered(self, length: int) -> None:
        """Keep the delivered text's first ``length`` characters."""
        while self._delivered and self._delivered_length - len(self._delivered[-1]) >= length:
            self._delivered_length -= len(self._delivered.pop())
        if self._delivered_length > length:
            self._delivered[-1] = self._delivered[-1][: length - self._delivered_length]
            self._delivered_length = length
