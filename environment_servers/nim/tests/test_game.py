"""The Nim game: rules, the RNG, and state that continues exactly after a JSON round trip."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from environment_servers.nim.game import NimGame, NimRules, SplitMix64, parse_move

pytestmark = pytest.mark.unit


def test_splitmix_is_reproducible_and_spread() -> None:
    a, b = SplitMix64(42), SplitMix64(42)
    draws = [a.randint(1, 6) for _ in range(600)]
    assert draws == [b.randint(1, 6) for _ in range(600)]
    assert set(draws) == {1, 2, 3, 4, 5, 6}
    assert all(0.0 <= SplitMix64(seed).random() < 1.0 for seed in range(50))
    assert SplitMix64(1).next_u64() != SplitMix64(2).next_u64()


def test_a_game_continues_identically_after_a_json_round_trip() -> None:
    rules = NimRules(stones=40, max_take=3, seed=9, opponent_skill=0.3)
    straight, resumed = NimGame.new(rules), NimGame.new(rules)
    moves = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3]
    for take in moves:
        if straight.over:
            break
        straight.play(take)
        resumed = NimGame.from_json(json.loads(json.dumps(resumed.to_json())))
        resumed.play(take)
        assert resumed.to_json() == straight.to_json()
    assert straight.moves  # the opponent's RNG was exercised
    assert any(move["player"] == "opponent" for move in straight.moves)


def test_the_seed_changes_the_opponent() -> None:
    def opponent_moves(seed: int) -> list[int]:
        game = NimGame.new(NimRules(stones=200, max_take=5, seed=seed, opponent_skill=0.0))
        for _ in range(20):
            game.play(1)
        return [m["take"] for m in game.moves if m["player"] == "opponent"]

    assert opponent_moves(1) == opponent_moves(1)
    assert opponent_moves(1) != opponent_moves(2)


def test_taking_the_last_stone_wins() -> None:
    game = NimGame.new(NimRules(stones=3, max_take=3))
    assert game.play(3) == "You took 3, the last stone: you win."
    assert game.winner == "agent" and game.over
    with pytest.raises(ValueError, match="over"):
        game.play(1)


def test_a_perfect_opponent_wins_from_a_losing_position() -> None:
    game = NimGame.new(NimRules(stones=8, max_take=3, opponent_skill=1.0))
    game.play(1)  # 7 left: the opponent takes 3, leaving 4
    assert game.pile == 4
    game.play(2)
    assert game.winner == "opponent"


def test_invalid_moves_are_counted_and_lose_at_the_limit() -> None:
    game = NimGame.new(NimRules(stones=10, max_take=3, max_invalid=2))
    assert "not a legal move" in game.play(None)
    assert "not a legal move" in game.play(4) and game.pile == 10
    assert game.winner == "opponent" and game.invalid == 2


@pytest.mark.parametrize(
    ("text", "move"), [("I take 2.", 2), ("3", 3), ("from 7 I take 1", 1), ("none", None), (None, None),
                       ("take -1", -1), ("I take 123456789.", 123456789), ("I take 1234567890.", None),
                       ("I take 123456789012345678901.", None), ("I take " + "9" * 5000, None),
                       ("I take 0000000003", None)],
)
def test_parse_move_reads_the_last_integer(text: str | None, move: int | None) -> None:
    assert parse_move(text) == move


@pytest.mark.parametrize(
    "rules", [{"stones": 0}, {"stones": 5, "max_take": 0}, {"stones": 5, "opponent_skill": 1.5},
              {"stones": 5, "seed": 2**64}, {"stones": 5, "colour": "red"}, {}],
)
def test_bad_rules_are_refused(rules: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        NimRules.model_validate(rules)


@pytest.mark.parametrize(
    "change", [{"pile": "7"}, {"pile": -1}, {"rng_state": 2**64}, {"moves": [1]}, {"winner": "nobody"},
               {"invalid": None}, {"extra": 1}, {"moves": [{"player": "agent", "take": 10**20, "valid": False}]}],
)
def test_a_game_that_to_json_did_not_write_is_refused(change: dict[str, object]) -> None:
    data = {**NimGame.new(NimRules(stones=7)).to_json(), **change}
    with pytest.raises(ValueError):
        NimGame.from_json(data)
