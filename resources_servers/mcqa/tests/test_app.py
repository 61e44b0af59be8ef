"""mcqa over httpx.ASGITransport: letter extraction, verify, declarations, bad input."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext
from resources_servers.mcqa.app import create_app, extract_choice

pytestmark = pytest.mark.unit

OPTIONS = {"A": "Oxygen", "B": "Carbon dioxide", "C": "Nitrogen", "D": "Helium"}
NG_OPTIONS = [{letter: text} for letter, text in OPTIONS.items()]  # NeMo Gym's format


def answer(text: str) -> dict[str, Any]:
    message = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    return {"output": [message]}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    mesh = load_config_dict({"mc": {"resources_servers": {"mcqa": {}}}})
    ctx: ServerContext[Any] = ServerContext("mc", mesh.instance("mc").settings, mesh)
    transport = httpx.ASGITransport(app=create_app(ctx))
    async with httpx.AsyncClient(transport=transport, base_url="http://mc") as http:
        yield http
    await ctx.aclose()


@pytest.mark.parametrize(
    ("text", "choice"),
    [
        ("Answer: B", "B"),
        ("**Answer:** C", "C"),
        ("I think A... no. The answer is (D).", "D"),
        ("The answer is C. Final answer: B", "B"),
        ("answer: b", None),
        ("the answer is a gas", None),
        ("B", "B"),
        (" (C) ", "C"),
        ("D.", "D"),
        ("Between (A) and (C), I pick (C)", "C"),
        ("carbon  Dioxide", "B"),
        ("Answer: E", None),
        ("Answer: E (A)", "A"),
        ("I do not know", None),
        ("", None),
        ("so the answer is \\boxed{C}", "C"),
        ("\\boxed{\\text{D}}", "D"),
        ("\\boxed{(A)}", "A"),
        ("\\boxed{B: Carbon dioxide}. Answer: A", "B"),
        ("\\boxed{E} Answer: C", "C"),
    ],
)
def test_extract_choice(text: str, choice: str | None) -> None:
    assert extract_choice(text, OPTIONS) == choice


def test_extraction_is_linear_on_adversarial_text() -> None:
    """Whitespace after a boxed letter, never closed, costs about what other text of its shape costs.

    The former boxed regex backtracked cubically on it (2 KB of it held the event loop for 8 s).
    """
    def cost(text: str) -> float:
        best = float("inf")
        for _ in range(3):
            began = time.perf_counter()
            assert extract_choice(text, OPTIONS) is None
            best = min(best, time.perf_counter() - began)
        return best

    piece = "\\boxed{A: " + " " * 300
    adversarial, plain = piece * 50, piece.replace(" ", "x") * 50
    assert cost(adversarial) < 20 * cost(plain) + 0.005


@pytest.mark.parametrize(
    ("options", "expected", "text", "reward", "extracted"),
    [
        (NG_OPTIONS, "B", "Answer: B", 1.0, "B"),
        (NG_OPTIONS, "b", "Answer: B", 1.0, "B"),
        (NG_OPTIONS, "B", "Answer: A", 0.0, "A"),
        (NG_OPTIONS, "D", "Helium", 1.0, "D"),
        (NG_OPTIONS, "C", "\\boxed{C}", 1.0, "C"),
        ([{"A": "yes"}, {"B": "no"}], "A", "Answer: C", 0.0, None),
    ],
)
async def test_verify(client: httpx.AsyncClient, options: Any, expected: str, text: str, reward: float,
                      extracted: str | None) -> None:
    row = {"responses_create_params": {"input": "q"}, "options": options, "expected_answer": expected,
           "response": answer(text)}
    reply = await client.post("/verify", json=row)
    assert reply.status_code == 200, reply.text
    assert reply.json() == {**row, "reward": reward, "extracted_answer": extracted}


@pytest.mark.parametrize(
    ("row", "detail"),
    [
        ({"options": [{"A": "x"}, {"B": "y"}], "expected_answer": "C"}, "not one of"),
        ({"options": [{"a": "x"}, {"B": "y"}], "expected_answer": "B"}, "single capital letters"),
        ({"options": [{"AB": "x"}], "expected_answer": "AB"}, "single capital letters"),
        ({"options": [{"A": "x", "B": "y"}], "expected_answer": "A"}, "one key"),
        ({"options": [{"A": "x"}, {"A": "y"}], "expected_answer": "A"}, "distinct"),
        ({"options": ["x", "y"], "expected_answer": "A"}, "options"),
        ({"options": {"A": "x"}, "expected_answer": "A"}, "options"),
        ({"options": [], "expected_answer": "A"}, "options"),
        ({"options": "ABCD", "expected_answer": "A"}, "options"),
        ({"options": [{chr(65 + i % 26): str(i)} for i in range(27)], "expected_answer": "A"}, "options"),
        ({"options": [{"A": "x"}]}, "expected_answer"),
        ({"expected_answer": "A"}, "options"),
    ],
)
async def test_bad_verify_bodies_are_400(client: httpx.AsyncClient, row: dict[str, Any], detail: str) -> None:
    reply = await client.post("/verify", json={**row, "response": answer("Answer: A")})
    assert (reply.status_code, reply.json()["error"]["code"]) == (400, "invalid_request")
    assert detail in reply.json()["error"]["detail"]


async def test_garbage_body_is_400(client: httpx.AsyncClient) -> None:
    reply = await client.post("/verify", content=b"\xff\xfe", headers={"content-type": "application/json"})
    assert (reply.status_code, reply.json()["error"]["code"]) == (400, "invalid_request")


async def test_seed_session_and_no_tools(client: httpx.AsyncClient) -> None:
    reply = await client.post("/seed_session", json={"options": [{"A": "x"}], "expected_answer": "A"})
    assert reply.status_code == 200
    assert reply.headers["x-ng-checkpoint-verify"] == "replay"
    assert "x-ng-checkpoint-restart" not in reply.headers
    assert (await client.get("/tools")).json() == []
    assert (await client.post("/kv_get", json={"key": "x"})).status_code == 404


async def test_a_nemo_gym_shaped_row_is_verified_and_passes_through(client: httpx.AsyncClient) -> None:
    """A row in NeMo Gym's mcqa layout (``uuid``, ``grading_mode``, ``metadata``) is taken as it is."""
    row = {"responses_create_params": {"input": [{"role": "user", "content": "Which gas?"}]},
           "options": NG_OPTIONS, "expected_answer": "B", "grading_mode": "strict_single_letter_boxed",
           "uuid": "0b7c2f0e-1", "metadata": {"source": "here"}, "response": answer("\\boxed{B}")}
    reply = await client.post("/verify", json=row)
    assert reply.status_code == 200, reply.text
    assert reply.json() == {**row, "reward": 1.0, "extracted_answer": "B"}
