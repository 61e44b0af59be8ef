"""The mesh client sends a call again only when it was provably never sent (any method), or when it is
idempotent; a call that may have reached the peer is never repeated."""

from __future__ import annotations

import httpx
import pytest

from nemo_gym_ckpt.client import UNSENT_EXTRA, MeshClient
from nemo_gym_ckpt.errors import Unavailable

pytestmark = pytest.mark.unit


class Flaky(httpx.AsyncBaseTransport):
    """Fails the first ``failures`` requests with ``error``, then answers 200."""

    def __init__(self, error: type[httpx.TransportError], failures: int) -> None:
        self.error, self.failures, self.seen = error, failures, 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.seen += 1
        if self.seen <= self.failures:
            raise self.error("Can not write request body", request=request)
        return httpx.Response(200, json={"ok": True})


@pytest.mark.parametrize("error", [httpx.ConnectTimeout, httpx.ConnectError])
async def test_a_post_that_was_never_sent_is_sent_again(error: type[httpx.TransportError]) -> None:
    transport = Flaky(error, failures=2)
    async with MeshClient(transport=transport, backoff_s=0.001) as client:
        assert await client.post_json("http://peer/seed_session", {}) == {"ok": True}
    assert transport.seen == 3


async def test_a_post_that_may_have_been_sent_is_not_sent_again() -> None:
    transport = Flaky(httpx.ReadError, failures=1)
    async with MeshClient(transport=transport, backoff_s=0.001) as client:
        with pytest.raises(Unavailable):
            await client.post_json("http://peer/seed_session", {})
    assert transport.seen == 1


async def test_never_sent_retries_are_bounded() -> None:
    transport = Flaky(httpx.ConnectError, failures=10)
    async with MeshClient(transport=transport, backoff_s=0.001, retries=2) as client:
        with pytest.raises(Unavailable):
            await client.post_json("http://peer/seed_session", {})
    assert transport.seen == 3 + UNSENT_EXTRA
