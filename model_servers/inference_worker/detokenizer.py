"""The text of a growing list of generated token ids, kept up to date one token at a time.

``IncrementalDetokenizer.text`` is always exactly ``tokenizer.decode(ids)`` of the ids added so
far, but a new id costs a decode of a few ids, not of all of them: the reply of a 16k-token
generation decoded its whole list again at every token before (quadratic, ~28 s of event loop).

The ids are split into a **settled** head, whose text is known to start every later text, and the
few ids after it. Each step decodes a short **window**: some settled ids (the context a decoder
looks back at: a first space it strips, a byte-fallback run, " n't" that clean-up joins) and every
id after them; the window's text past the text of its settled ids is what follows the settled
text. The head settles up to the newest id once the text does not end in U+FFFD: a token can hold
part of a UTF-8 character, which decodes to U+FFFD until the ids that complete it arrive and then
changes; until then those ids stay in the window. The window's settled ids are at least
``CONTEXT_TOKENS`` and ``CONTEXT_CHARS`` characters' worth, and decode on their own to the end of
the settled text (so a window never starts inside a unit the decoder reads whole).

Should a new id change how the window's settled ids decode (the window's text no longer starts
with theirs: clean-up turning " ." into "."; a byte that makes a whole byte-fallback run U+FFFD),
that step decodes all the ids. So the text is exact for every decoder that looks back at most as
far as the window and whose text of whole characters no later id changes: byte-level BPE,
SentencePiece's metaspace and byte fallback, WordPiece, characters, transformers' clean-up of
spaces (``tests/test_incremental_text.py`` compares them with decoding all the ids). A run of ids
whose text keeps ending in U+FFFD (bytes that never form a character) stays in the window, and
costs as before.

The inference worker builds its replies' text with it (``completions``), and the policy model its
streamed content (``model_servers/policy_model/text_cut.py``): anything with a tokenizer's
``decode`` (``TokenDecoder``) will do.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

__all__ = [
    "CONTEXT_CHARS",
    "CONTEXT_TOKENS",
    "KEPT_CHARS",
    "RECENT_CHARS",
    "REPLACEMENT_CHAR",
    "IncrementalDetokenizer",
    "TokenDecoder",
]

#: Settled ids decoded again with each new one, as the decoder's context: at least this many...
CONTEXT_TOKENS = 4
#: ...and at least as many as hold this many characters (transformers' clean-up of spaces turns
#: " n't" into "n't": it looks 3 characters back). A window grows with each token to twice both,
#: then moves up (one more decode): each token costs one decode of a dozen or so ids.
CONTEXT_CHARS = 8
#: What a decoder writes for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT_CHAR = "\ufffd"
#: The end of the settled text is kept as one string of up to this many characters (a new token's
#: text is appended to it); past that, all but its last ``KEPT_CHARS`` go to the older pieces.
RECENT_CHARS = 4096
#: What ``text_from`` reads without joining the older pieces: more than the longest stop string.
KEPT_CHARS = 1024


class TokenDecoder(Protocol):
    """What the detokenizer needs of a tokenizer: the text of a list of ids."""

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    """The text ``tokenizer.decode(ids, skip_special_tokens=...)`` of the ids given to ``add``.

    The settled text is kept in pieces, joined only when ``text`` is read whole: ``len`` and
    ``text_from`` near the end (``KEPT_CHARS``) cost what they return, not the length of the text.
    """

    def __init__(self, tokenizer: TokenDecoder, *, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._settled = 0  # ids[:settled] decode to the settled text, which starts every later text
        self._pieces: list[str] = []  # the settled text before recent
        self._recent = ""  # the end of the settled text
        self._settled_length = 0
        self._tail = ""  # the text after the settled text
        self._window = 0  # each step decodes ids[window:]; ids[window:settled] decode to window_text
        self._window_text = ""
        self._marks: deque[tuple[int, int]] = deque([(0, 0)])  # (ids, text length) where it settled
        self.full_decodes = 0
        """Steps that had to decode every id (see the module docstring)."""

    def __len__(self) -> int:
        return self._settled_length + len(self._tail)

    @property
    def text(self) -> str:
        """The whole text (joins the settled pieces: read it once, at the end)."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return "".join((*self._pieces, self._recent, self._tail))

    def text_from(self, start: int) -> str:
        """``text[start:]``: in time proportional to its length when it starts at most ``KEPT_CHARS``
        before the unsettled end, else it joins the whole text."""
        if start >= self._settled_length:
            return self._tail[start - self._settled_length :]
        recent_start = self._settled_length - len(self._recent)
        if start >= recent_start:
            return self._recent[start - recent_start :] + self._tail
        return self.text[start:]

    def add(self, token_id: int) -> int:
        """Take the next id; returns how many leading characters of the text it left unchanged."""
        self._ids.append(token_id)
        window = self._decode(self._window, len(self._ids))
        if window.startswith(self._window_text):
            self._tail = window[len(self._window_text) :]
            unchanged = self._settled_length
        else:  # the new id changed how the window's settled ids decode
            self.full_decodes += 1
            self._unsettle()
            window = self._tail = self._decode(0, len(self._ids))
            unchanged = 0
        if not self._tail.endswith(REPLACEMENT_CHAR):
            self._settle(window)
        return unchanged

    def _settle(self, window: str) -> None:
        """Settle every id; ``window`` is the text of ``ids[window:]``, which ends the settled text."""
        if self._tail:
            self._recent += self._tail
            self._settled_length += len(self._tail)
            self._tail = ""
            if len(self._recent) > RECENT_CHARS:
                self._pieces.append(self._recent[:-KEPT_CHARS])
                self._recent = self._recent[-KEPT_CHARS:]
        self._settled = len(self._ids)
        self._marks.append((self._settled, self._settled_length))
        self._window_text = window
        if self._settled - self._window > 2 * CONTEXT_TOKENS and len(window) > 2 * CONTEXT_CHARS:
            self._move_window()

    def _move_window(self) -> None:
        """Start the windows at the latest settled point at least ``CONTEXT_TOKENS`` ids and
        ``CONTEXT_CHARS`` characters back, if its ids alone decode to the end of the settled text
        (a window must not start inside what a decoder reads as one unit, such as a run of
        byte-fallback tokens, which one more byte can turn into U+FFFD whole); else keep it."""
        marks = self._marks
        while len(marks) > 1 and self._far_enough(marks[1]):
            marks.popleft()
        start = marks[0][0]
        if start <= self._window or not self._far_enough(marks[0]):
            return
        text = self._decode(start, self._settled)
        head = self._settled_length - len(text)
        if len(text) >= CONTEXT_CHARS and head >= 0 and self.text_from(head) == text:
            self._window, self._window_text = start, text

    def _far_enough(self, mark: tuple[int, int]) -> bool:
        ids, length = mark
        return self._settled - ids >= CONTEXT_TOKENS and self._settled_length - length >= CONTEXT_CHARS

    def _unsettle(self) -> None:
        self._settled = self._window = self._settled_length = 0
        self._pieces.clear()
        self._recent = self._window_text = ""
        self._marks.clear()
        self._marks.append((0, 0))

    def _decode(self, start: int, stop: int) -> str:
        if start >= stop:
            return ""
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip_special_tokens)
