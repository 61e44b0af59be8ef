"""The stateless sampler: a pure function of (seed, position, logits)."""

from __future__ import annotations

import math

import pytest

from model_servers.inference_worker.sampling import (
    RowSampling,
    derive_seed,
    position_seed,
    sample_batch,
    sample_token,
)

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.unit


def _logits(seed: int = 0, vocab: int = 50) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed))


def _draws(row_of: object, positions: range, logits: torch.Tensor) -> list[int]:
    return [sample_token(logits, row_of(p))[0] for p in positions]  # type: ignore[operator]


def test_same_inputs_same_token_regardless_of_global_rng() -> None:
    logits = _logits()
    torch.manual_seed(1)
    first = _draws(lambda p: RowSampling(7, p), range(30), logits)
    torch.manual_seed(2)
    torch.rand(100)
    assert _draws(lambda p: RowSampling(7, p), range(30), logits) == first


def test_seed_and_position_change_the_draw() -> None:
    logits = torch.zeros(50)
    seven = _draws(lambda p: RowSampling(7, p), range(30), logits)
    eight = _draws(lambda p: RowSampling(8, p), range(30), logits)
    assert seven != eight
    assert len(set(seven)) > 10, "uniform logits must spread over the vocabulary"
    assert position_seed(7, 3) != position_seed(7, 4) != position_seed(8, 3)
    assert derive_seed(0, 1) != derive_seed(0, 2) != derive_seed(1, 1)
    assert 0 <= derive_seed(0, 1) < 2**63


def test_greedy_is_argmax_and_logprob_is_the_models() -> None:
    logits = _logits(3)
    token, logprob = sample_token(logits, RowSampling(1, 0, temperature=0.0))
    assert token == int(torch.argmax(logits))
    assert logprob == pytest.approx(float(torch.log_softmax(logits.double(), -1)[token]))
    assert sample_token(logits, RowSampling(1, 0, temperature=1e-6))[0] == token


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    counts = [0, 0, 0]
    for position in range(3000):
        counts[sample_token(logits, RowSampling(42, position))[0]] += 1
    assert counts[0] / 3000 == pytest.approx(0.7, abs=0.04)
    assert counts[2] / 3000 == pytest.approx(0.1, abs=0.03)


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    nucleus = {sample_token(logits, RowSampling(9, p, top_p=0.75))[0] for p in range(400)}
    everything = {sample_token(logits, RowSampling(9, p))[0] for p in range(400)}
    assert nucleus == {0, 1} and everything == {0, 1, 2, 3}
    assert {sample_token(logits, RowSampling(9, p, top_p=0.1))[0] for p in range(50)} == {0}


def test_processed_logprobs_apply_temperature_and_top_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    row = RowSampling(5, 0, temperature=0.5, top_p=0.7)
    token, raw = sample_token(logits, row, "raw")
    same_token, processed = sample_token(logits, row, "processed")
    sharpened = torch.tensor([0.5, 0.3]) ** 2
    assert same_token == token and raw == pytest.approx(math.log([0.5, 0.3, 0.2][token]))
    assert processed == pytest.approx(math.log(float(sharpened[token] / sharpened.sum())))


def test_rows_of_a_batch_are_independent() -> None:
    logits = torch.stack([_logits(i) for i in range(6)])
    rows = [RowSampling(i, 10 + i, temperature=[0.0, 1.0, 0.7][i % 3], top_p=[1.0, 0.9][i % 2])
            for i in range(6)]
    batched = sample_batch(logits, rows)
    assert batched == [sample_token(logits[i], rows[i]) for i in range(6)]
    assert sample_batch(torch.flip(logits, [0]), rows[::-1]) == batched[::-1]
    with pytest.raises(ValueError, match="rows"):
        sample_batch(logits, rows[:2])
