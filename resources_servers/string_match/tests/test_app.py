"""string_match over httpx.ASGITransport: verify modes, seed headers, bad input."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.errors import ConfigError
from resources_servers.string_match.answers import extract, grade
from resources_servers.string_match.app import create_app

pytestmark = pytest.mark.unit



def answer(text: str) -> dict[str, Any]:
    message = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    return {"output": [message]}


@pytest.fixture
async def make_client() -> AsyncIterator[Callable[..., httpx.AsyncClient]]:
    contexts: list[ServerContext[Any]] = []

    def make(**settings: Any) -> httpx.AsyncClient:
        mesh = load_config_dict({"sm": {"resources_servers": {"string_match": settings}}})
        ctx: ServerContext[Any] = ServerContext("sm", mesh.instance("sm").settings, mesh)
        contexts.append(ctx)
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)), base_url="http://sm")

    yield make
    for ctx in contexts:
        await ctx.aclose()


@pytest.fixture
async def client(make_client: Callable[..., httpx.AsyncClient]) -> AsyncIterator[httpx.AsyncClient]:
    async with make_client() as http:
        yield http


async def reward(http: httpx.AsyncClient, text: str, expected: Any) -> float:
    reply = await http.post("/verify", json={"expected_answer": expected, "response": answer(text)})
    assert reply.status_code == 200, reply.text
    return float(reply.json()["reward"])


async def test_exact_match_normalises_whitespace(client: httpx.AsyncClient) -> None:
    assert await reward(client, "  hello \n\t world ", "hello world") == 1.0
    assert await reward(client, "hello world!", "hello world") == 0.0
    assert await reward(client, "Hello world", "hello world") == 0.0


async def test_verify_echoes_the_row_and_adds_fields(client: httpx.AsyncClient) -> None:
    row = {"responses_create_params": {"input": "q"}, "expected_answer": "Paris", "task_id": 7,
           "response": answer("Paris")}
    body = (await client.post("/verify", json=row)).json()
    assert body == {**row, "reward": 1.0, "extracted_answer": "Paris"}


async def test_any_of_a_list_of_answers(client: httpx.AsyncClient) -> None:
    assert await reward(client, "colour", ["color", "colour"]) == 1.0
    assert await reward(client, "hue", ["color", "colour"]) == 0.0


async def test_case_insensitive_and_substring(make_client: Callable[..., httpx.AsyncClient]) -> None:
    async with make_client(case_sensitive=False) as http:
        assert await reward(http, "PARIS", "paris") == 1.0
        assert await reward(http, "It is Paris", "paris") == 0.0
    async with make_client(mode="substring", case_sensitive=False) as http:
        assert await reward(http, "It is  PARIS.", "paris") == 1.0
        assert await reward(http, "It is Rome.", "paris") == 0.0
    async with make_client(mode="substring") as http:
        assert await reward(http, "It is PARIS.", "Paris") == 0.0


async def test_last_message_is_the_answer(client: httpx.AsyncClient) -> None:
    output = [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Paris"}]},
        {"type": "function_call", "name": "x", "arguments": "{}", "call_id": "c1"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rome"}]},
    ]
    row = {"expected_answer": "Rome", "response": {"output": output}}
    body = (await client.post("/verify", json=row)).json()
    assert (body["reward"], body["extracted_answer"]) == (1.0, "Rome")


async def test_no_message_is_reward_zero(client: httpx.AsyncClient) -> None:
    reply = await client.post("/verify", json={"expected_answer": "x", "response": {"output": []}})
    assert (reply.status_code, reply.json()["reward"], reply.json()["extracted_answer"]) == (200, 0.0, None)


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        (b"not json", "not valid JSON"),
        (b"[1, 2]", "is a JSON object"),
        (b'{"response": {"output": []}}', "expected_answer"),
        (b'{"expected_answer": "x"}', "response"),
        (b'{"expected_answer": "x", "response": {"output": "text"}}', "response.output"),
        (b'{"expected_answer": 5, "response": {"output": []}}', "expected_answer"),
        (b'{"expected_answer": [], "response": {"output": []}}', "expected_answer"),
    ],
)
async def test_bad_verify_bodies_are_400(client: httpx.AsyncClient, body: bytes, detail: str) -> None:
    reply = await client.post("/verify", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "invalid_request"
    assert detail in reply.json()["error"]["detail"]


async def test_seed_session_declares_replay_and_no_restart(client: httpx.AsyncClient) -> None:
    reply = await client.post("/seed_session", json={"responses_create_params": {"input": "q"}, "extra": 1})
    assert reply.status_code == 200
    assert reply.headers["x-ng-checkpoint-verify"] == "replay"
    assert "x-ng-checkpoint-restart" not in reply.headers
    assert reply.cookies["ng_session_sm"] == reply.json()["resources_session_id"]


async def test_no_tools_and_unknown_tool_is_404(client: httpx.AsyncClient) -> None:
    assert (await client.get("/tools")).json() == []
    reply = await client.post("/add", json={"a": 1, "b": 2})
    assert (reply.status_code, reply.json()["error"]["code"]) == (404, "not_found")


def test_config_typos_and_checkpoint_overrides_are_errors() -> None:
    with pytest.raises(ConfigError, match="mode"):
        load_config_dict({"sm": {"resources_servers": {"string_match": {"mode": "fuzzy"}}}})
    with pytest.raises(ConfigError, match="checkpoint_mode"):
        load_config_dict({"sm": {"resources_servers": {"string_match": {"checkpoint_mode": "exported"}}}})


def test_nemo_gyms_settings_keys_are_accepted() -> None:
    settings = {"entrypoint": "app.py", "domain": "knowledge", "verified": False,
                "description": "General-purpose string matching", "value": "Verify answers"}
    mesh = load_config_dict({"string_match": {"resources_servers": {"string_match": settings}}})
    assert mesh.instance("string_match").settings.description == "General-purpose string matching"


# ---- rows in NeMo Gym's string_match shape: extraction_mode and case_sensitive ----------------------


async def nemo_gym_verdict(http: httpx.AsyncClient, output: list[dict[str, Any]], expected: str, mode: str,
                           **row: Any) -> tuple[float, Any]:
    body = {"expected_answer": expected, "extraction_mode": mode, "response": {"output": output}, **row}
    reply = await http.post("/verify", json=body)
    assert reply.status_code == 200, reply.text
    assert {key: reply.json()[key] for key in body} == body  # the row passes through
    return reply.json()["reward"], reply.json()["extracted_answer"]


def said(*texts: str) -> list[dict[str, Any]]:
    return [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
            for text in texts]


@pytest.mark.parametrize(
    ("text", "mode", "expected", "verdict"),
    [
        ("The capital of France is \\(\\boxed{\\text{Paris}}\\).", "boxed", "Paris", (1.0, "Paris")),
        ("\\boxed{1} then \\boxed{ {2} }", "boxed", "{2}", (1.0, "{2}")),
        ("no box here", "boxed", "x", (0.0, None)),
        ("Reasoning...\nFinal answer: Saturn.", "final_answer", "saturn", (1.0, "Saturn")),
        ("Answer: 12\nanswer\uff1a 15", "final_answer", "15", (1.0, "15")),
        ("so it is \\boxed{80}", "final_answer", "80", (1.0, "80")),  # no answer line: the box
        ("thinking\n\nPacific Ocean\n  \n", "last_line", "Pacific Ocean", (1.0, "Pacific Ocean")),
        ("  all of it  ", "full_response", "All of it", (1.0, "all of it")),
        ("", "full_response", "x", (0.0, None)),
        ("Final answer: \"Paris\"", "final_answer", "Paris!", (1.0, "\"Paris\"")),  # quotes and ! dropped
        ("Final answer: \"Paris\"!", "final_answer", "paris", (0.0, "\"Paris\"!")),  # quotes first, then !
        ("Final answer: 80.0", "final_answer", "80", (1.0, "80.0")),  # as numbers
        ("Final answer: $1,000", "final_answer", "1000", (0.98, "$1,000")),  # $ and commas apart: near numbers
        ("Final answer: 1,000", "final_answer", "1000", (1.0, "1,000")),
        ("Final answer: \\textbf{x} and $y$", "final_answer", "x and y", (1.0, "\\textbf{x} and $y$")),
        ("Final answer: Rome", "final_answer", "Paris", (0.0, "Rome")),
        ("Final answer: 99.6", "final_answer", "100", (0.98, "99.6")),  # near numbers
        ("Final answer: 90", "final_answer", "100", (0.0, "90")),
    ],
)
async def test_extraction_modes_and_grading_as_nemo_gym(
    client: httpx.AsyncClient, text: str, mode: str, expected: str, verdict: tuple[float, Any]
) -> None:
    assert await nemo_gym_verdict(client, said(text), expected, mode) == verdict


async def test_the_answer_is_read_from_every_assistant_message(client: httpx.AsyncClient) -> None:
    output = [*said("\\boxed{Paris}"), {"type": "function_call", "name": "x", "arguments": "{}", "call_id": "c"},
              {"type": "message", "role": "user", "content": "\\boxed{Rome}"}, *said("done")]
    assert await nemo_gym_verdict(client, output, "Paris", "boxed") == (1.0, "Paris")
    assert await nemo_gym_verdict(client, output, "done", "last_line") == (1.0, "done")


async def test_case_sensitive_rows(make_client: Callable[..., httpx.AsyncClient]) -> None:
    async with make_client() as http:  # the config says case_sensitive: true (this server's default)
        assert await nemo_gym_verdict(http, said("\\boxed{paris}"), "Paris", "boxed") == (1.0, "paris")
        assert await nemo_gym_verdict(http, said("\\boxed{paris}"), "Paris", "boxed", case_sensitive=True) == (
            0.0, "paris")
        assert await nemo_gym_verdict(http, said("\\boxed{ Paris }"), "Paris ", "boxed", case_sensitive=True) == (
            1.0, "Paris")
        assert await reward(http, "PARIS", "paris") == 0.0
        body = {"expected_answer": "paris", "case_sensitive": False, "response": answer("PARIS")}
        assert (await http.post("/verify", json=body)).json()["reward"] == 1.0  # the row's wins over the config


@pytest.mark.parametrize(
    ("adversarial", "plain"),
    [
        ("\\boxed{\\text{" + " " * 1000 + "}a}", "\\boxed{\\text{" + "x" * 1000 + "}a}"),  # was cubic
        ("\\boxed{" * 1000, "\\boxed{" + "x" * 7000),  # was quadratic: every unclosed box scanned to the end
        ("\\text{" * 1000, "\\text{" + "x" * 6000),  # the same in grade's LaTeX unwrapping
    ],
)
def test_extraction_and_grading_are_linear_on_adversarial_text(adversarial: str, plain: str) -> None:
    """Text built to make extraction backtrack or rescan costs about what other text of its length costs."""
    def cost(text: str) -> float:
        best = float("inf")
        for _ in range(3):
            began = time.perf_counter()
            grade(extract(text, "boxed") or text, "a", case_sensitive=False)
            best = min(best, time.perf_counter() - began)
        return best

    assert cost(adversarial) < 20 * cost(plain) + 0.005


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("\\boxed{\\text{ \\text{  Paris } }}", "Paris"),
        ("\\boxed{\\text{a}b\\text{c}}", "a}b\\text{c"),
        ("\\boxed{\\text{}}", ""),
        ("\\boxed{\\text{x} }", "x"),
        ("\\boxed{\\text{x}", None),
        ("\\boxed{ {1} } \\boxed{2", "{1}"),
    ],
)
def test_text_wrappers_around_the_whole_box_are_removed(text: str, answer: str | None) -> None:
    assert extract(text, "boxed") == answer


@pytest.mark.parametrize(
    ("got", "expected", "score"),
    [
        ("1e400", "2e400", 0.0),  # a float makes both inf
        ("1e400", "-1e400", 0.0),
        ("1e400", "inf", 0.0),
        ("1e400", "10e399", 1.0),  # the same number
        ("1.5E400", "15e399", 1.0),
        ("$1e400", "1e400", 1.0),
        ("1e9999999999999999999", "2e9999999999999999999", 0.0),  # past a decimal's exponent: as written
        ("inf", "Infinity", 1.0),
        ("1e-400", "-1e-400", 0.98),  # a float makes both 0: not equal now, only near (as 1e-12, -1e-12 are)
        ("2.5", "2.50", 1.0),
        ("1.001e400", "1e400", 0.98),  # within 1% of each other, by their exact values
        ("-1.001e400", "-1e400", 0.98),
        ("1.5e400", "1e400", 0.0),
        ("1e400", "0", 0.0),
        ("1e9999999999999999999", "1.001e9999999999999999999", 0.0),  # past a decimal's exponent too
    ],
)
def test_numbers_a_float_cannot_hold_keep_their_value(got: str, expected: str, score: float) -> None:
    assert grade(got, expected, case_sensitive=False) == score


async def test_different_huge_boxed_numbers_are_wrong(client: httpx.AsyncClient) -> None:
    assert await nemo_gym_verdict(client, said("\\boxed{1e400}"), "2e400", "boxed") == (0.0, "1e400")
