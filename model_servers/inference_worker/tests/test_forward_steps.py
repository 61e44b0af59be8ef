"""The steppers on a real (random-weight) tiny Llama: the batch KV cache against full recompute."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
import torch

from model_servers.inference_worker.forward_steps import COLUMN_SLACK, CachedDecode, FullRecompute

pytestmark = pytest.mark.unit


@dataclass(eq=False)
class Seq:
    ids: list[int]
    cache: Any = None


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    path = str(tiny_model_dir)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def step(cached: CachedDecode, full: FullRecompute, active: list[Seq]) -> None:
    """One step of both steppers over ``active``: equal logits; every sequence takes the argmax."""
    with torch.inference_mode():
        got, want = cached.logits(active), full.logits(active)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for seq, token in zip(active, want.argmax(-1).tolist(), strict=True):
        seq.ids.append(token)


def test_batch_cache_matches_full_recompute_as_sequences_join_and_leave(model: Any) -> None:
    rng = random.Random(7)
    cached, full = CachedDecode(model, pad_id=0), FullRecompute(model, pad_id=0)
    active = [Seq([1, *rng.choices(range(6, 90), k=rng.randint(1, 12))]) for _ in range(3)]
    finished: list[Seq] = []
    for number in range(COLUMN_SLACK + 40):  # past the spare columns: the store reallocates
        step(cached, full, active)
        leaving = [seq for seq in active if rng.random() < 0.08]
        active = [seq for seq in active if seq not in leaving]
        finished += leaving
        if number % 7 == 0:  # a long prompt joins: the window grows to the left
            active.append(Seq([1, *rng.choices(range(6, 90), k=rng.randint(1, 40 + number))]))
        if finished and number % 5 == 0:  # the next turn of a finished conversation: its cache is reused
            done = finished.pop(0)
            active.append(Seq([*done.ids, *rng.choices(range(6, 90), k=rng.randint(1, 6))]))
        if not active:
            active.append(Seq([1, 9]))
    assert cached.reused_tokens > 0, "the next turns must reuse the caches of the finished turns"


def test_a_sequence_dropped_and_back_continues_exactly(model: Any) -> None:
    cached, full = CachedDecode(model, pad_id=0), FullRecompute(model, pad_id=0)
    first, second = Seq([1, 20, 21, 22]), Seq([1, 30])
    for _ in range(5):
        step(cached, full, [first, second])
    step(cached, full, [second])  # first is absent: its row leaves the store for the pool
    assert first.cache is None and cached.rows == [second]
    reused, expected = cached.reused_tokens, len(first.ids) - 1  # the cache covers all but the last id
    step(cached, full, [first, second])
    assert cached.reused_tokens - reused == expected


def test_a_repeated_prompt_is_prefilled_again_so_logprobs_repeat_bit_for_bit(model: Any) -> None:
    cached = CachedDecode(model, pad_id=0)
    firsts = []
    with torch.inference_mode():
        for companion in (Seq([1, 50]), Seq([1, 60])):
            seq = Seq([1, 40, 41, 42, 43])
            firsts.append(cached.logits([seq])[0])
            seq.ids.append(44)
            cached.logits([companion])  # seq leaves (its cache goes to the pool), companion joins
            companion.ids.append(51)
    assert cached.reused_tokens == 0, "a prompt that does not extend a cached sequence is prefilled"
    assert torch.equal(firsts[0], firsts[1])


def test_the_prefix_pool_keeps_to_its_bounds_and_hands_each_entry_out_once() -> None:
    from model_servers.inference_worker.forward_steps import _PrefixPool

    def cache(length: int) -> list[tuple[Any, Any]]:  # one layer, 2 heads, head_dim 4: 64 bytes a column
        return [(torch.zeros(2, length, 4), torch.zeros(2, length, 4))]

    pool = _PrefixPool(capacity=3, max_bytes=64 * 10)
    pool.put((1, 2, 3), cache(3))
    pool.put((1, 5, 6, 7), cache(4))
    pool.put((1, 9, 9, 9), cache(4))  # over the byte bound: the oldest entry goes
    assert len(pool) == 2 and pool.nbytes == 64 * 8
    assert pool.take([1, 2, 3, 4]) is None
    assert pool.take([1, 5, 6, 7]) is None, "an entry must be a proper prefix: one token at least is fed"
    taken = pool.take([1, 5, 6, 7, 8, 8])
    assert taken is not None and taken.length == 4 and taken.layers[0][0].shape == (2, 4, 4)
    assert pool.take([1, 5, 6, 7, 8, 8]) is None and len(pool) == 1 and pool.nbytes == 64 * 4
    pool.put((2,) * 20, cache(20))  # larger than the whole pool: not kept
    assert len(pool) == 1
