"""kv_store over httpx.ASGITransport: tools, per-session isolation, sessions, verify, bad input."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any

import httpx
import pytest

from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext
from resources_servers.kv_store.app import create_app

pytestmark = pytest.mark.unit

COOKIE = "ng_session_kv"
EMPTY_RESPONSE: dict[str, Any] = {"output": []}


def no_cookie_jar() -> CookieJar:
    """A jar that keeps nothing: cookies are passed explicitly, as mesh agents do."""
    return CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))


@pytest.fixture
async def make_client() -> AsyncIterator[Callable[..., httpx.AsyncClient]]:
    contexts: list[ServerContext[Any]] = []

    def make(**settings: Any) -> httpx.AsyncClient:
        mesh = load_config_dict({"kv": {"resources_servers": {"kv_store": settings}}})
        ctx: ServerContext[Any] = ServerContext("kv", mesh.instance("kv").settings, mesh)
        contexts.append(ctx)
        transport = httpx.ASGITransport(app=create_app(ctx))
        return httpx.AsyncClient(transport=transport, base_url="http://kv", cookies=no_cookie_jar())

    yield make
    for ctx in contexts:
        await ctx.aclose()


@pytest.fixture
async def client(make_client: Callable[..., httpx.AsyncClient]) -> AsyncIterator[httpx.AsyncClient]:
    async with make_client() as http:
        yield http


def cookie(value: str) -> dict[str, str]:
    return {"cookie": f"{COOKIE}={value}"}


async def seed(http: httpx.AsyncClient, prefix: str = "", **row: Any) -> dict[str, str]:
    """Seed a session; answers the cookie header to pass on explicitly."""
    reply = await http.post(f"{prefix}/seed_session", json={"responses_create_params": {"input": "q"}, **row})
    assert reply.status_code == 200, reply.text
    return cookie(reply.cookies[COOKIE])


async def call(http: httpx.AsyncClient, tool: str, cookies: dict[str, str] | None, prefix: str = "",
               **args: Any) -> httpx.Response:
    return await http.post(f"{prefix}/{tool}", json=args, headers=cookies)


async def test_tools_change_and_read_the_store(client: httpx.AsyncClient) -> None:
    cookies = await seed(client)
    replies = [
        await call(client, "kv_set", cookies, key="city", value="Paris"),
        await call(client, "kv_set", cookies, key="city", value="Rome"),
        await call(client, "kv_get", cookies, key="city"),
        await call(client, "kv_get", cookies, key="nope"),
        await call(client, "kv_set", cookies, key="a", value=""),
        await call(client, "kv_list", cookies),
        await call(client, "kv_delete", cookies, key="city"),
        await call(client, "kv_delete", cookies, key="city"),
        await call(client, "kv_list", cookies),
    ]
    assert [r.status_code for r in replies] == [200] * len(replies)
    assert [r.json() for r in replies] == [
        {"key": "city", "value": "Paris"},
        {"key": "city", "value": "Rome"},
        {"key": "city", "value": "Rome", "found": True},
        {"key": "nope", "value": None, "found": False},
        {"key": "a", "value": ""},
        {"keys": ["a", "city"]},
        {"key": "city", "deleted": True},
        {"key": "city", "deleted": False},
        {"keys": ["a"]},
    ]


async def test_two_cookies_two_states(client: httpx.AsyncClient) -> None:
    first, second = await seed(client), await seed(client, initial_state={"x": "1"})
    assert first != second
    await call(client, "kv_set", first, key="k", value="first")
    await call(client, "kv_set", second, key="k", value="second")
    assert (await call(client, "kv_get", first, key="k")).json()["value"] == "first"
    assert (await call(client, "kv_get", second, key="k")).json()["value"] == "second"
    assert (await call(client, "kv_list", first)).json() == {"keys": ["k"]}
    assert (await call(client, "kv_list", second)).json() == {"keys": ["k", "x"]}


async def test_seed_declares_wait_and_not_restart(client: httpx.AsyncClient) -> None:
    reply = await client.post("/seed_session", json={"responses_create_params": {"input": "q"}})
    assert reply.headers["x-ng-checkpoint-verify"] == "wait"
    assert "x-ng-checkpoint-restart" not in reply.headers
    assert reply.json() == {"resources_session_id": reply.cookies[COOKIE], "resources_tools": None,
                            "sandbox_access": None}


@pytest.mark.parametrize(
    ("row", "detail"),
    [
        ({"initial_state": {"k": 1}}, "initial_state.k"),
        ({"initial_state": ["k"]}, "initial_state"),
        ({"initial_state": {"": "v"}}, "initial_state"),
        ({"responses_create_params": "q"}, "responses_create_params"),
    ],
)
async def test_bad_seed_rows_are_400(client: httpx.AsyncClient, row: dict[str, Any], detail: str) -> None:
    reply = await client.post("/seed_session", json=row)
    assert (reply.status_code, reply.json()["error"]["code"]) == (400, "invalid_request")
    assert detail in reply.json()["error"]["detail"]
    assert COOKIE not in reply.cookies


async def test_tool_calls_need_a_live_session(client: httpx.AsyncClient) -> None:
    reply = await call(client, "kv_get", None, key="k")
    assert (reply.status_code, reply.json()["error"]["code"]) == (400, "invalid_request")
    assert "call /seed_session first" in reply.json()["error"]["detail"]
    reply = await call(client, "kv_get", cookie("forged"), key="k")
    assert reply.status_code == 400 and "unknown session 'forged'" in reply.json()["error"]["detail"]
    cookies = await seed(client)
    session_id = cookies["cookie"].split("=", 1)[1]
    closed = await client.post("/close_session", headers=cookies)
    assert closed.json() == {"resources_session_id": session_id}  # NeMo Gym's close reply
    assert (await client.post("/close_session", headers=cookies)).json() == {"resources_session_id": session_id}
    reply = await call(client, "kv_list", cookies)
    assert reply.status_code == 400 and "unknown session" in reply.json()["error"]["detail"]


async def test_a_session_belongs_to_its_rollout_attempt(client: httpx.AsyncClient) -> None:
    cookies = await seed(client, prefix="/ng-rollout/r1")
    assert (await call(client, "kv_set", cookies, "/ng-rollout/r1", key="k", value="v")).status_code == 200
    assert (await call(client, "kv_get", cookies, key="k")).status_code == 200
    reply = await call(client, "kv_get", cookies, "/ng-rollout/r1-a1", key="k")
    assert (reply.status_code, reply.json()["error"]["code"]) == (409, "stale_attempt")
    assert "r1-a1" in reply.json()["error"]["detail"]


@pytest.mark.parametrize(
    ("tool", "args", "detail"),
    [
        ("kv_set", {"key": "k"}, "value: Field required"),
        ("kv_set", {"key": "k", "value": 5}, "value: Input should be a valid string"),
        ("kv_set", {"key": "", "value": "v"}, "key: String should have at least 1 character"),
        ("kv_set", {"key": "k" * 129, "value": "v"}, "key: String should have at most 128"),
        ("kv_set", {"key": "k", "value": "v" * 4097}, "value: String should have at most 4096"),
        ("kv_get", {"key": None}, "key: Input should be a valid string"),
        ("kv_get", {"name": "k"}, "key: Field required"),
        ("kv_delete", {}, "key: Field required"),
        ("kv_list", {"key": "k"}, "key: Extra inputs are not permitted"),
    ],
)
async def test_bad_tool_arguments_are_400(client: httpx.AsyncClient, tool: str, args: dict[str, Any],
                                          detail: str) -> None:
    cookies = await seed(client)
    reply = await call(client, tool, cookies, **args)
    assert (reply.status_code, reply.json()["error"]["code"]) == (400, "invalid_request")
    assert detail in reply.json()["error"]["detail"]


async def test_garbage_bodies_and_unknown_tools(client: httpx.AsyncClient) -> None:
    cookies = await seed(client)
    for body in (b"garbage", b"[]", b"null", b"12"):
        reply = await client.post("/kv_set", content=body, headers=cookies)
        assert (reply.status_code, reply.json()["error"]["code"]) == (400, "invalid_request"), body
    assert (await client.post("/kv_list", content=b"", headers=cookies)).json() == {"keys": []}
    reply = await client.post("/kv_increment", json={"key": "k"}, headers=cookies)
    assert (reply.status_code, reply.json()["error"]["code"]) == (404, "not_found")


async def test_the_store_is_bounded(make_client: Callable[..., httpx.AsyncClient]) -> None:
    async with make_client(max_keys=2) as http:
        cookies = await seed(http, initial_state={"a": "1"})
        assert (await call(http, "kv_set", cookies, key="b", value="2")).status_code == 200
        reply = await call(http, "kv_set", cookies, key="c", value="3")
        assert reply.status_code == 400 and "the store is full" in reply.json()["error"]["detail"]
        assert (await call(http, "kv_set", cookies, key="a", value="replaced")).status_code == 200
        reply = await http.post("/seed_session", json={"initial_state": {"a": "", "b": "", "c": ""}})
        assert reply.status_code == 400 and "max_keys=2" in reply.json()["error"]["detail"]


async def test_verify_compares_the_final_state(client: httpx.AsyncClient) -> None:
    cookies = await seed(client, initial_state={"keep": "1", "drop": "2"})
    await call(client, "kv_delete", cookies, key="drop")
    await call(client, "kv_set", cookies, key="new", value="3")
    row = {"expected_state": {"keep": "1", "new": "3"}, "response": EMPTY_RESPONSE, "task": 9}
    reply = await client.post("/verify", json=row, headers=cookies)
    assert reply.json() == {**row, "reward": 1.0, "final_state": {"keep": "1", "new": "3"},
                            "mismatched_keys": []}
    row = {"expected_state": {"keep": "2", "other": "x"}, "response": EMPTY_RESPONSE}
    body = (await client.post("/verify", json=row, headers=cookies)).json()
    assert (body["reward"], body["mismatched_keys"]) == (0.0, ["keep", "new", "other"])


@pytest.mark.parametrize(
    "row",
    [
        {"response": EMPTY_RESPONSE},
        {"expected_state": {"k": 1}, "response": EMPTY_RESPONSE},
        {"expected_state": {}},
        {"expected_state": {}, "response": []},
    ],
)
async def test_bad_verify_bodies_are_400(client: httpx.AsyncClient, row: dict[str, Any]) -> None:
    cookies = await seed(client)
    reply = await client.post("/verify", json=row, headers=cookies)
    assert (reply.status_code, reply.json()["error"]["code"]) == (400, "invalid_request")


async def test_verify_needs_the_session(client: httpx.AsyncClient) -> None:
    reply = await client.post("/verify", json={"expected_state": {}, "response": EMPTY_RESPONSE})
    assert reply.status_code == 400 and "call /seed_session first" in reply.json()["error"]["detail"]


async def test_tool_definitions(client: httpx.AsyncClient) -> None:
    tools = {t["name"]: t for t in (await client.get("/tools")).json()}
    assert list(tools) == ["kv_set", "kv_get", "kv_delete", "kv_list"]
    assert tools["kv_set"]["parameters"]["required"] == ["key", "value"]
    empty = {"additionalProperties": False, "properties": {}, "type": "object"}
    assert tools["kv_list"]["parameters"] == empty
    assert all(t["description"] for t in tools.values())
