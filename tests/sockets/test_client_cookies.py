"""The mesh client never keeps cookies: one rollout's session cookie must not ride on another's call."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi import Request
from starlette.responses import JSONResponse

from nemo_gym_ckpt.client import MeshClient, TransportName
from nemo_gym_ckpt.launch.head import ThreadedServer
from nemo_gym_ckpt.server import create_app

pytestmark = pytest.mark.sockets


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    app = create_app("cookie-probe")

    @app.post("/seed")
    async def seed(request: Request) -> JSONResponse:
        reply = JSONResponse({"sent": request.cookies.get("session")})
        reply.set_cookie("session", "s1", httponly=True, samesite="lax")
        return reply

    with ThreadedServer(app, name="cookie-probe") as server:
        yield server.url


@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
async def test_reply_cookies_are_never_sent_again(url: str, transport: TransportName, host: str) -> None:
    async with MeshClient(transport=transport) as client:
        target = url.replace("127.0.0.1", host) + "/seed"
        first = await client.request("POST", target)
        assert first.cookies.get("session") == "s1"  # the caller sees what the reply set
        assert (await client.post_json(target)) == {"sent": None}  # but the client did not keep it
        explicit = await client.post_json(target, cookies={"session": "mine"})
        assert explicit == {"sent": "mine"}
        assert (await client.post_json(target)) == {"sent": None}
