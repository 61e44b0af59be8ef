"""``measure_throughput`` over the engine interface (a scripted engine keeps it fast)."""

from __future__ import annotations

import pytest

from model_servers.inference_worker.tests.scripted_engine import ScriptedEngine
from model_servers.inference_worker.throughput import measure_throughput

pytestmark = pytest.mark.unit


async def test_measure_throughput_counts_every_token() -> None:
    engine = ScriptedEngine.from_text("abc", context_length=64)
    report = await measure_throughput(engine, [1, 3], 5)
    assert [row["batch_size"] for row in report["results"]] == [1, 3]
    assert [row["tokens"] for row in report["results"]] == [5, 15]
    assert all(row["tokens_per_s"] > 0 for row in report["results"])
    assert report["prompt_tokens"] == len("What is 17 times 23?")
    assert len(engine.admitted) == 1 + 1 + 3 and all(r.ignore_eos for r in engine.admitted)
    with pytest.raises(ValueError, match="does not fit"):
        await measure_throughput(engine, [1], 60)
