"""Stateless per-position sampling: each token is a pure function of (seed, position, logits).

The token at absolute sequence position ``p`` (0-based index in prompt + generated ids) of a request
with seed ``s`` is::

    temperature == 0:  argmax(logits)                                   (first index on ties)
    otherwise:         argmax(top_p_mask(logits / T) + Gumbel(noise(s, p)))

where the Gumbel noise comes from a ``torch.Generator`` seeded with a hash of ``(s, p)``: never the
global RNG, never state carried from one step to the next. So a generation cut after ``k`` tokens
and continued from prompt + those ``k`` ids (same seed) draws exactly the tokens the uninterrupted
run draws, and concurrent requests cannot disturb each other. Gumbel-max draws from
``softmax(logits / T)`` restricted to the nucleus.

Logprobs come in two modes: ``raw`` (``log_softmax(logits)``, the model's own distribution, vLLM's
default) and ``processed`` (the distribution actually sampled from: temperature and top-p applied;
greedy rows report the raw value).

torch is imported lazily: ``app.py`` imports ``derive_seed`` from here while configs load.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

__all__ = [
    "GREEDY_TEMPERATURE",
    "LogprobsMode",
    "RowSampling",
    "derive_seed",
    "position_seed",
    "sample_batch",
    "sample_token",
]

LogprobsMode = Literal["raw", "processed"]
#: Temperatures below this are greedy (as in vLLM): dividing by them would overflow.
GREEDY_TEMPERATURE = 1e-5
_SEED_MASK = (1 << 63) - 1


def _hash63(text: str) -> int:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


def position_seed(seed: int, position: int) -> int:
    """The generator seed for the token at ``position`` of a request seeded with ``seed``."""
    return _hash63(f"ng-sample:{seed}:{position}")


def derive_seed(worker_seed: int, counter: int) -> int:
    """The seed given to the ``counter``-th request that came without one (recorded and returned)."""
    return _hash63(f"ng-request:{worker_seed}:{counter}")


@dataclass(frozen=True, slots=True)
class RowSampling:
    """How to draw the token of one row: request seed, absolute position, temperature, top-p."""

    seed: int
    position: int
    temperature: float = 1.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _gumbel(rows: Sequence[RowSampling], size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise, one row per sampling row, each drawn after seeding with its (seed, position)."""
    import torch

    generator = torch.Generator(device="cpu")
    uniform = torch.empty(len(rows), size, dtype=torch.float64)
    for index, row in enumerate(rows):
        uniform[index].uniform_(generator=generator.manual_seed(position_seed(row.seed, row.position)))
    uniform.clamp_(min=torch.finfo(torch.float64).tiny)
    return -torch.log(-torch.log(uniform))


def _top_p_mask(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``scaled`` with every token outside each row's nucleus set to -inf (the top token stays)."""
    import torch

    probs = torch.softmax(scaled, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = before >= top_p.unsqueeze(-1)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scaled.masked_fill(drop, float("-inf"))


def _sample_rows(logits: torch.Tensor, rows: Sequence[RowSampling]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and processed log-distributions of the non-greedy ``rows`` (logits: float64 [n, V])."""
    import torch

    temperature = torch.tensor([row.temperature for row in rows], dtype=torch.float64)
    top_p = torch.tensor([row.top_p for row in rows], dtype=torch.float64)
    scaled = logits / temperature.unsqueeze(-1)
    if bool((top_p < 1.0).any()):
        scaled = _top_p_mask(scaled, top_p)
    tokens = torch.argmax(scaled + _gumbel(rows, logits.shape[-1]), dim=-1)
    return tokens, torch.log_softmax(scaled, dim=-1)


def sample_batch(
    logits: torch.Tensor, rows: Sequence[RowSampling], mode: LogprobsMode = "raw"
) -> list[tuple[int, float]]:
    """(token id, logprob) for each row of ``logits`` ([len(rows), V]); each row independent."""
    import torch

    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {len(rows)} rows")
    logits = logits.to(torch.float64)
    tokens = torch.argmax(logits, dim=-1)
    logprobs = torch.log_softmax(logits, dim=-1)
    sampled = [i for i, row in enumerate(rows) if not row.greedy]
    if sampled:
        index = torch.tensor(sampled)
        drawn, processed = _sample_rows(logits[index], [rows[i] for i in sampled])
        tokens[index] = drawn
        if mode == "processed":
            logprobs[index] = processed
    picked = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return list(zip(tokens.tolist(), picked.tolist(), strict=True))


def sample_token(logits: torch.Tensor, row: RowSampling, mode: LogprobsMode = "raw") -> tuple[int, float]:
    """(token id, logprob) drawn from one row of logits ([V])."""
    return sample_batch(logits.unsqueeze(0), [row], mode)[0]
