"""The checkpoint bench's in-process suites, small: their shape, and what ``session_growth`` compares."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_gym_ckpt.bench.protocol import session_growth

pytestmark = pytest.mark.unit


def test_session_growth_writes_the_turns_that_grew_not_the_sessions(tmp_path: Path) -> None:
    result = session_growth(sessions=60, turns=10, grown_share=0.5, message_bytes=300, root=tmp_path)
    assert result["grown"] == 30 and result["full_bytes"] > result["grown_records_whole_bytes"] > 0
    assert result["incremental_over_grown_whole"] < 0.5  # patches and spans, not whole records
    assert 0 < result["incremental_over_full"] < 0.25 and result["incremental_commit_ms"] > 0
