"""The mesh client measures a streamed reply's lines chunk by chunk, as they arrive: whatever the
chunks, a line past the bound is found, and a stream of lines within it passes."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nemo_gym_ckpt.client import _longest_line

pytestmark = pytest.mark.unit

chunk = st.lists(st.sampled_from([b"x", b"\n", b"\r"]), max_size=40).map(b"".join)


@given(chunks=st.lists(chunk, max_size=8), limit=st.integers(min_value=1, max_value=12))
def test_a_line_past_the_limit_is_found_across_any_chunking(chunks: list[bytes], limit: int) -> None:
    longest = open_line = 0
    for piece in chunks:
        seen, open_line = _longest_line(open_line, piece, limit)
        longest = max(longest, seen)
    whole = max(len(line) for line in re.split(rb"[\r\n]", b"".join(chunks)))
    assert (longest > limit) == (whole > limit)
    assert longest <= whole


def test_the_line_left_open_is_carried_into_the_next_chunk() -> None:
    assert _longest_line(0, b"data: 12", 100) == (8, 8)
    assert _longest_line(8, b"34\n\ndata: 5", 100) == (10, 7)
    assert _longest_line(0, b"a\n" + b"y" * 200 + b"\nb", 100) == (200, 1)  # a long line inside one chunk
