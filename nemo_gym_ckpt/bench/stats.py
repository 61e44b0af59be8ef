"""The statistics every bench reports: nearest-rank percentiles, the p50/p99/max of samples, and ratios
rounded to significant digits."""

from __future__ import annotations

from typing import Any

__all__ = ["percentile", "quantiles_ms", "significant"]


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def quantiles_ms(samples_ms: list[float], digits: int = 1) -> dict[str, Any]:
    """``p50_ms``, ``p99_ms``, ``max_ms`` (rounded to ``digits``) and ``n`` of millisecond samples."""
    return {
        "p50_ms": round(percentile(samples_ms, 0.5), digits),
        "p99_ms": round(percentile(samples_ms, 0.99), digits),
        "max_ms": round(max(samples_ms, default=0.0), digits),
        "n": len(samples_ms),
    }


def significant(value: float, digits: int = 3) -> float:
    """``value`` rounded to ``digits`` significant digits: a ratio of tiny figures (a quick bench's
    few KB against a floor of hundreds of MB/s) stays what it is instead of rounding to 0."""
    return float(f"{value:.{digits}g}")
