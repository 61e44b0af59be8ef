"""The statistics the benches report (``bench/stats.py``)."""

from __future__ import annotations

import pytest

from nemo_gym_ckpt.bench.stats import percentile, significant

pytestmark = pytest.mark.unit


def test_a_tiny_ratio_keeps_its_significant_digits_instead_of_rounding_to_zero() -> None:
    quick = 0.2 / 669.2  # a quick bench's write speed against the floor: 0.000299
    assert significant(quick) == 0.000299 and significant(quick) > 0
    assert significant(0.35714) == 0.357 and significant(1.7649) == 1.76
    assert significant(0.0) == 0.0


def test_percentiles_are_by_nearest_rank() -> None:
    assert percentile([5.0, 1.0, 3.0], 0.5) == 3.0 and percentile([], 0.5) == 0.0
