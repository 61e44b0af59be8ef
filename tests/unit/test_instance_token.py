"""The instance token on a server's /health replies, and the launcher's reading of a /health reply."""

from __future__ import annotations

import httpx
import pytest

from nemo_gym_ckpt.errors import ConfigError, Unavailable
from nemo_gym_ckpt.launch.health import HEALTH_BODY_MAX_BYTES, read_health
from nemo_gym_ckpt.launch.instance_token import (
    INSTANCE_TOKEN_ENV,
    INSTANCE_TOKEN_HEADER,
    new_token,
    read_instance_token,
    with_instance_token,
)
from nemo_gym_ckpt.server import create_app

pytestmark = pytest.mark.unit


def dead_engine() -> None:
    raise Unavailable("the engine is gone")


async def get(app: object, path: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://sm") as http:  # type: ignore[arg-type]
        return await http.get(path)


async def test_health_replies_carry_the_token_and_keep_their_body() -> None:
    token = new_token()
    app = with_instance_token(create_app("sm"), token)
    health, missing = await get(app, "/health"), await get(app, "/nothing")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "name": "sm"}  # what NeMo Gym's tools and ours read
    assert health.headers[INSTANCE_TOKEN_HEADER] == token
    assert missing.status_code == 404 and INSTANCE_TOKEN_HEADER not in missing.headers


async def test_an_unhealthy_reply_carries_the_token_too() -> None:
    token = new_token()
    reply = await get(with_instance_token(create_app("w", health_check=dead_engine), token), "/health")
    assert reply.status_code == 503 and reply.headers[INSTANCE_TOKEN_HEADER] == token


async def test_without_a_token_the_app_is_served_unchanged() -> None:
    app = create_app("sm")
    assert with_instance_token(app, read_instance_token({})) is app
    assert INSTANCE_TOKEN_HEADER not in (await get(app, "/health")).headers


def test_tokens_are_fresh_and_a_malformed_one_is_a_config_error() -> None:
    tokens = {new_token() for _ in range(100)}
    assert len(tokens) == 100
    assert all(read_instance_token({INSTANCE_TOKEN_ENV: token}) == token for token in tokens)
    for bad in ("", "abc", "G" * 32, "A" * 32, "a" * 33, "a" * 31 + "\n"):
        with pytest.raises(ConfigError, match=f"{INSTANCE_TOKEN_ENV} must be 32 lowercase hex digits"):
            read_instance_token({INSTANCE_TOKEN_ENV: bad})


def reply_of(response: httpx.Response) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(lambda _: response))


def test_a_reply_counts_only_from_the_process_with_the_token() -> None:
    token = new_token()
    body = {"status": "ok", "name": "sm"}
    with reply_of(httpx.Response(200, json=body, headers={INSTANCE_TOKEN_HEADER: token})) as http:
        ours = read_health(http, "http://sm")
    with reply_of(httpx.Response(200, json=body)) as http:
        stranger = read_health(http, "http://sm")
    assert ours is not None and stranger is not None
    assert ours.from_process(token) and ours.healthy_as("sm") and not ours.healthy_as("other")
    assert not stranger.from_process(token) and stranger.healthy_as("sm")
    assert stranger.describe() == "status 200 naming itself 'sm'"


def test_a_huge_health_body_is_read_bounded_and_is_no_healthy_answer() -> None:
    padded = b'{"status": "ok", "name": "sm"}' + b" " * (4 * HEALTH_BODY_MAX_BYTES)
    with reply_of(httpx.Response(200, content=padded)) as http:
        reply = read_health(http, "http://sm")
    assert reply is not None and len(reply.body) == HEALTH_BODY_MAX_BYTES + 1
    assert not reply.healthy_as("sm")
    assert reply.describe() == "status 200"


def test_nothing_answering_is_no_reply() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with httpx.Client(transport=httpx.MockTransport(refuse)) as http:
        assert read_health(http, "http://sm") is None
