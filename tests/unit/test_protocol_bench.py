"""The checkpoint bench's in-process suites, small: their shape, and what ``session_growth``,
``incremental_chain`` and ``sidecar_copy`` compare."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_gym_ckpt.bench.protocol import incremental_chain, session_growth
from nemo_gym_ckpt.bench.sidecar import sidecar_copy

pytestmark = pytest.mark.unit


def test_session_growth_writes_the_turns_that_grew_not_the_sessions(tmp_path: Path) -> None:
    result = session_growth(sessions=60, turns=10, grown_share=0.5, message_bytes=300, root=tmp_path)
    assert result["grown"] == 30 and result["full_bytes"] > result["grown_records_whole_bytes"] > 0
    assert result["incremental_over_grown_whole"] < 0.5  # patches and spans, not whole records
    assert 0 < result["incremental_over_full"] < 0.25 and result["incremental_commit_ms"] > 0


def test_incremental_chain_times_a_full_commit_and_both_ends_of_a_chain(tmp_path: Path) -> None:
    result = incremental_chain(records=200, record_bytes=500, changed_share=0.05, commits=3, fulls=2, root=tmp_path)
    assert result["changed_per_commit"] == 10 and result["commits"] == 3
    assert 0 < result["last_incremental_bytes"] < 0.5 * result["full_bytes"]  # spans and patches, not records
    assert all(result[key] > 0 for key in ("full_write_cpu_ms", "first_incremental_write_cpu_ms",
                                           "last_incremental_write_cpu_ms", "last_over_full_cpu"))


def test_sidecar_copy_holds_one_chunk_whatever_the_sidecar(tmp_path: Path) -> None:
    result = sidecar_copy(sizes_mb=(2, 12), line_bytes=4_000, root=tmp_path)
    small, large = result["small"], result["large"]
    assert large["lines"] > 5 * small["lines"] > 0 and 11 < large["sidecar_mb"] < 13
    assert all(row[key] > 0 for row in (small, large)
               for key in ("commit_ms", "write_mb_s", "over_floor", "restore_ms", "restore_mb_s"))
    assert large["peak_traced_mb"] < 0.5 * large["sidecar_mb"]  # a few chunks, not every line at once
    assert result["large_over_small_peak"] < 2
    # the records (about half a token line each here: 0.48-0.51 of the sidecar), not the token lines
    # (which would add the whole sidecar)
    assert large["restore_held_mb"] < 0.75 * large["sidecar_mb"]
    assert large["restore_peak_mb"] < large["sidecar_mb"]  # the records read, not an index read to its bound
    assert large["restore_tenth_ms"] > 0 and large["restore_tenth_over_all"] > 0
    assert list(tmp_path.iterdir()) == []
