"""Nim against a dice-rolling opponent: the game's state and RNG as plain JSON data.

Rules: a pile of ``stones``; the agent and the opponent take turns removing 1 to ``max_take``
stones, the agent first; whoever takes the last stone wins. The opponent, on each of its moves,
plays the winning move (leave a multiple of ``max_take + 1``) with probability ``opponent_skill``
when there is one, and otherwise takes a random legal number. Its randomness comes from a SplitMix64
generator whose whole state is one integer, seeded from the task row, so the game (RNG included) is
a small JSON object that can be saved between steps and continued exactly.

An answer that names no legal move counts as an invalid action: the pile is unchanged and the agent
is asked again; ``max_invalid`` of them lose the game. A number of more than ``MAX_MOVE_DIGITS``
digits names no move (no legal move is that long, and the game's state keeps only 64-bit integers).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["MAX_MOVE_DIGITS", "NimGame", "NimRules", "SplitMix64", "parse_move"]

_MASK = (1 << 64) - 1
_LAST_INT = re.compile(r"-?\d+")
MAX_MOVE_DIGITS = 9
"""The longest number read as a move; a longer one names none (an invalid action)."""


class SplitMix64:
    """A tiny, exactly reproducible PRNG whose state is a single 64-bit integer."""

    def __init__(self, state: int) -> None:
        self.state = state & _MASK

    def next_u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def random(self) -> float:
        """A float in [0, 1) from the top 53 bits."""
        return (self.next_u64() >> 11) / float(1 << 53)

    def randint(self, low: int, high: int) -> int:
        """An int in [low, high] (inclusive)."""
        return low + self.next_u64() % (high - low + 1)


class NimRules(BaseModel):
    """The game a task row asks for."""

    model_config = ConfigDict(extra="forbid")

    stones: int = Field(ge=1, le=1000)
    max_take: int = Field(3, ge=1, le=100)
    seed: int = Field(0, ge=0, le=2**63 - 1)
    opponent_skill: float = Field(0.5, ge=0.0, le=1.0)
    max_invalid: int = Field(3, ge=1, le=1000)

    @model_validator(mode="after")
    def _bounded(self) -> NimRules:
        if self.seed > _MASK:
            raise ValueError("seed must fit in 64 bits")
        return self


def parse_move(text: str | None) -> int | None:
    """The move an answer names: its last integer ("I take 2." -> 2), or None (also when that
    integer has more than ``MAX_MOVE_DIGITS`` digits)."""
    if not text:
        return None
    found = _LAST_INT.findall(text)
    if not found or len(found[-1].lstrip("-")) > MAX_MOVE_DIGITS:
        return None
    return int(found[-1])


class _Move(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    player: Literal["agent", "opponent"]
    take: int | None = Field(ge=-(10**MAX_MOVE_DIGITS), le=10**MAX_MOVE_DIGITS)
    valid: bool


class _GameState(BaseModel):
    """What ``NimGame.to_json`` writes, read back strictly (a restored boundary's game)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    rules: NimRules
    pile: int = Field(ge=0, le=1000)
    rng_state: int = Field(ge=0, le=_MASK)
    moves: list[_Move] = Field(max_length=100_000)
    invalid: int = Field(ge=0, le=1000)
    winner: Literal["agent", "opponent"] | None


class NimGame:
    """One game in progress; ``to_json``/``from_json`` carry it between episode steps."""

    def __init__(self, rules: NimRules, pile: int, rng_state: int, moves: list[dict[str, Any]],
                 invalid: int = 0, winner: str | None = None) -> None:
        self.rules = rules
        self.pile = pile
        self.rng = SplitMix64(rng_state)
        self.moves = moves
        self.invalid = invalid
        self.winner = winner

    @classmethod
    def new(cls, rules: NimRules) -> NimGame:
        return cls(rules, rules.stones, rules.seed, [])

    def to_json(self) -> dict[str, Any]:
        return {"rules": self.rules.model_dump(), "pile": self.pile, "rng_state": self.rng.state,
                "moves": self.moves, "invalid": self.invalid, "winner": self.winner}

    @classmethod
    def from_json(cls, data: Any) -> NimGame:
        """The game ``to_json`` wrote; ``ValueError`` (pydantic's) when ``data`` is not one."""
        game = _GameState.model_validate(data)
        return cls(game.rules, game.pile, game.rng_state, [move.model_dump() for move in game.moves],
                   game.invalid, game.winner)

    @property
    def over(self) -> bool:
        return self.winner is not None

    def legal(self, take: int | None) -> bool:
        return take is not None and 1 <= take <= min(self.rules.max_take, self.pile)

    def play(self, take: int | None) -> str:
        """Apply the agent's move (and the opponent's reply); answers what happened, as text."""
        if self.over:
            raise ValueError("the game is over")
        if not self.legal(take):
            return self._invalid(take)
        assert take is not None
        self._take("agent", take)
        if self.over:
            return f"You took {take}, the last stone: you win."
        reply = self._opponent_take()
        self._take("opponent", reply)
        if self.over:
            return f"You took {take}; the opponent took {reply}, the last stone: you lose."
        return f"You took {take}; the opponent took {reply}."

    def _invalid(self, take: int | None) -> str:
        self.invalid += 1
        self.moves.append({"player": "agent", "take": take, "valid": False})
        if self.invalid >= self.rules.max_invalid:
            self.winner = "opponent"
            return f"{take} is not a legal move; that was the last chance: you lose."
        return f"{take} is not a legal move."

    def _take(self, player: str, take: int) -> None:
        self.pile -= take
        self.moves.append({"player": player, "take": take, "valid": True})
        if self.pile == 0:
            self.winner = player

    def _opponent_take(self) -> int:
        limit = min(self.rules.max_take, self.pile)
        winning = self.pile % (self.rules.max_take + 1)
        if winning and self.rng.random() < self.rules.opponent_skill:
            return winning
        return self.rng.randint(1, limit)

    def observation(self) -> str:
        """Short on purpose: small models have small contexts, and the conversation grows each turn."""
        return f"{self.pile} stones left. Take 1 to {min(self.rules.max_take, self.pile)}."
