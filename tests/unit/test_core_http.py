"""The app factory, the error tree and the mesh client, in process."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.responses import Response

from model_servers.policy_model.sse_reader import read_sse_json
from nemo_gym_ckpt.client import MeshClient, with_rollout_prefix
from nemo_gym_ckpt.errors import (
    ERROR_CODES,
    MAX_DETAIL_CHARS,
    InvalidRequest,
    StaleAttempt,
    Unavailable,
    UpstreamError,
    UpstreamTimeout,
    error_from_body,
)
from nemo_gym_ckpt.identity import RolloutIdentity, current_identity, parse_capture_key
from nemo_gym_ckpt.server import create_app

pytestmark = pytest.mark.unit


class Echo(BaseModel):
    value: int


def make_app() -> tuple[FastAPI, dict[str, int]]:
    app = create_app("probe")
    calls = {"flaky": 0, "post": 0}

    @app.post("/echo")
    async def echo(body: Echo) -> dict[str, object]:
        ident = current_identity()
        return {"value": body.value, "key": ident.capture_key if ident else None}

    @app.post("/stale")
    async def stale() -> None:
        raise StaleAttempt("attempt 0 of r1 is retired")

    @app.get("/flaky")
    async def flaky() -> dict[str, int]:
        calls["flaky"] += 1
        if calls["flaky"] < 3:
            raise Unavailable("warming up")
        return {"calls": calls["flaky"]}

    @app.post("/flaky-post")
    async def flaky_post() -> None:
        calls["post"] += 1
        raise Unavailable("down")

    @app.get("/slow")
    async def slow() -> None:
        await asyncio.sleep(5)

    @app.get("/text")
    async def text() -> object:
        from starlette.responses import PlainTextResponse

        return PlainTextResponse("no json", status_code=502)

    return app, calls


def client_for(app: FastAPI, **kwargs: object) -> MeshClient:
    return MeshClient(transport=httpx.ASGITransport(app=app), backoff_s=0.001, **kwargs)  # type: ignore[arg-type]


def test_every_code_maps_back_to_its_class() -> None:
    for code, cls in ERROR_CODES.items():
        error = error_from_body(cls.status, {"error": {"code": code, "detail": "d"}})
        assert type(error) is cls and error.detail == "d"
    assert isinstance(error_from_body(500, {"error": {"code": "weird"}}), UpstreamError)
    assert isinstance(error_from_body(500, "not a dict"), UpstreamError)


def deep_error_body(depth: int = 990) -> bytes:
    """Valid JSON (orjson reads up to 1,024 levels) whose detail str() cannot show: RecursionError."""
    return b'{"error":{"code":"unavailable","detail":' + b"[" * depth + b"]" * depth + b"}}"


def test_a_detail_of_any_json_value_maps_to_bounded_text() -> None:
    deep = error_from_body(503, orjson.loads(deep_error_body()))
    assert type(deep) is Unavailable and deep.detail.startswith("[[[") and len(deep.detail) < 100
    assert error_from_body(503, {"error": {"code": "unavailable", "detail": {"n": 1}}}).detail == "{'n': 1}"
    long = error_from_body(503, {"error": {"code": "unavailable", "detail": "x" * 10**6}})
    assert len(long.detail) < MAX_DETAIL_CHARS + 40 and long.detail.endswith("(1000000 characters)")
    wide = error_from_body(503, {"error": {"code": "unavailable", "detail": list(range(10**5))}})
    assert len(wide.detail) <= MAX_DETAIL_CHARS + 40
    unknown = error_from_body(500, {"error": {"code": "c" * 10**6, "detail": None}})
    assert type(unknown) is UpstreamError and len(unknown.detail) < 2 * MAX_DETAIL_CHARS


async def test_a_peer_s_deeply_nested_detail_is_raised_as_its_class() -> None:
    """Through the client and through a server route calling the peer: no RecursionError, no 500."""
    peer = httpx.MockTransport(lambda request: httpx.Response(503, content=deep_error_body()))
    async with MeshClient(transport=peer, retries=0) as client:
        with pytest.raises(Unavailable):
            await client.request("GET", "http://peer/status")
        app = create_app("caller")

        @app.get("/call")
        async def call() -> object:
            return (await client.request("GET", "http://peer/status")).json()

        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            reply = await http.get("/call")
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "unavailable"


async def test_a_streamed_event_s_deeply_nested_detail_is_raised_as_its_class() -> None:
    body = b"data: " + deep_error_body() + b"\n\n"
    response = httpx.Response(200, content=body, request=httpx.Request("POST", "http://worker/v1/completions"))
    with pytest.raises(Unavailable):
        async for _ in read_sse_json(response, asyncio.get_running_loop().time() + 5):
            pass


def test_capture_keys_round_trip() -> None:
    assert parse_capture_key("r1") == RolloutIdentity("r1", 0)
    assert parse_capture_key("r1-a2") == RolloutIdentity("r1", 2)
    assert parse_capture_key("task-3.a0") == RolloutIdentity("task-3.a0", 0)
    assert RolloutIdentity("r1", 3).capture_key == "r1-a3"
    for bad in ("../etc", "task-3-a0", "r-a01", "r1-a2-a3", "a:b", "r1-a1234567890", "r1\n", "x" * 201):
        with pytest.raises(InvalidRequest):
            parse_capture_key(bad)
    for bad_id in ("x-a1", "x-a0", "x:y"):
        with pytest.raises(InvalidRequest):
            RolloutIdentity(bad_id, 1)  # would share capture keys with other (rollout, attempt) pairs


def test_prefix_is_inserted_once() -> None:
    ident = RolloutIdentity("r9", 1)
    url = with_rollout_prefix("http://h:1/v1/x?q=1", ident)
    assert url == "http://h:1/ng-rollout/r9-a1/v1/x?q=1"
    assert with_rollout_prefix(url, ident) == url
    assert with_rollout_prefix("http://h:1/a", None) == "http://h:1/a"


async def test_health_and_structured_errors() -> None:
    app, _ = make_app()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        assert (await http.get("/health")).json() == {"status": "ok", "name": "probe"}
        cases = [
            (await http.post("/echo", json={"value": "x"}), 400, "invalid_request"),
            (await http.post("/echo", content=b"{not json", headers={"content-type": "application/json"}),
             400, "invalid_request"),
            (await http.post("/nowhere", json={}), 404, "not_found"),
            (await http.get("/echo"), 405, "method_not_allowed"),
            (await http.post("/stale"), 409, "stale_attempt"),
            (await http.post("/ng-rollout//echo", json={"value": 1}), 400, "invalid_request"),
        ]
    for response, status, code in cases:
        assert response.status_code == status
        assert response.json()["error"]["code"] == code


async def test_rollout_prefix_sets_and_passes_identity() -> None:
    app, _ = make_app()
    async with client_for(app) as client:
        direct = await client.post_json("http://t/echo", {"value": 1})
        prefixed = await client.post_json("http://t/ng-rollout/r7-a2/echo", {"value": 2})
        explicit = await client.post_json("http://t/echo", {"value": 3}, identity=RolloutIdentity("r8"))
    assert direct == {"value": 1, "key": None}
    assert prefixed == {"value": 2, "key": "r7-a2"}
    assert explicit == {"value": 3, "key": "r8"}


async def test_idempotent_calls_retry_and_posts_do_not() -> None:
    app, calls = make_app()
    async with client_for(app, retries=3) as client:
        assert await client.get_json("http://t/flaky") == {"calls": 3}
        with pytest.raises(Unavailable):
            await client.post_json("http://t/flaky-post")
    assert calls["post"] == 1


async def test_errors_are_mapped_once() -> None:
    app, _ = make_app()
    async with client_for(app) as client:
        with pytest.raises(StaleAttempt):
            await client.post_json("http://t/stale")
        with pytest.raises(UpstreamTimeout):
            await client.get_json("http://t/slow", timeout_s=0.05)
        with pytest.raises(UpstreamError):
            await client.get_json("http://t/text", idempotent=False)
        raw = await client.request("POST", "http://t/stale", check=False)
    assert raw.status_code == 409


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_reply_that_does_not_decode_as_its_encoding_says_is_an_upstream_error(encoding: str) -> None:
    """httpx's ``DecodingError`` is no transport error: mapped like the others, it never leaves the client."""
    app = create_app("probe")

    def garbled(status: int) -> Response:
        return Response(b'{"value": 1}', status_code=status, media_type="application/json",
                        headers={"content-encoding": encoding})

    @app.post("/garbled")
    async def garbled_reply() -> Response:
        return garbled(200)

    @app.post("/garbled-error")
    async def garbled_error() -> Response:
        return garbled(500)

    async with client_for(app) as client:
        with pytest.raises(UpstreamError, match="POST http://t/garbled: DecodingError"):
            await client.post_json("http://t/garbled", idempotent=True)
        with pytest.raises(UpstreamError, match="POST http://t/garbled-error: DecodingError"):
            async with client.stream("POST", "http://t/garbled-error"):
                pass
