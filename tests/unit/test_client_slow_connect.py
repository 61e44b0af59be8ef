"""A client with ``connect_timeout_s`` (control calls: ``MeshClient.for_control``) makes a connection that
was not made in time again at once, on a fresh socket, until the call's deadline; a client without it
keeps its bounded retries."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import httpx
import pytest

from nemo_gym_ckpt.checkpoint.coordinator import Coordinator
from nemo_gym_ckpt.client import (
    CONTROL_CONNECT_S,
    KEEPALIVE_S,
    MAX_CONNECT_DOUBLINGS,
    MAX_SLOW_CONNECTS,
    MeshClient,
    _make_transport,
)
from nemo_gym_ckpt.errors import Unavailable, UpstreamTimeout

pytestmark = pytest.mark.unit


class SlowConnects(httpx.AsyncBaseTransport):
    """Times out the first ``failures`` connects (after ``wait_s``), then answers 200; keeps each
    request's timeout extension."""

    def __init__(self, failures: int, wait_s: float = 0.0) -> None:
        self.failures, self.wait_s, self.seen = failures, wait_s, 0
        self.timeouts: list[dict[str, float | None]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.seen += 1
        self.timeouts.append(request.extensions.get("timeout", {}))
        if self.seen <= self.failures:
            await asyncio.sleep(self.wait_s)
            raise httpx.ConnectTimeout("Connection timeout", request=request)
        return httpx.Response(200, json={"ok": True})


async def test_a_slow_connect_is_made_again_past_the_retry_count() -> None:
    transport = SlowConnects(failures=10)
    async with MeshClient(transport=transport, backoff_s=0.001, connect_timeout_s=0.25) as client:
        assert await client.post_json("http://peer/ng-control/prepare", {}, idempotent=True) == {"ok": True}
    assert transport.seen == 11  # past 1 + retries: a connect never made sent nothing
    connects = [timeout["connect"] for timeout in transport.timeouts]  # twice as long each time, then capped
    assert connects == [0.25 * 2**min(n, MAX_CONNECT_DOUBLINGS) for n in range(11)] and connects[-1] == 16.0


async def test_without_a_connect_timeout_the_retries_stay_bounded() -> None:
    transport = SlowConnects(failures=10)
    async with MeshClient(transport=transport, backoff_s=0.001, retries=2) as client:
        with pytest.raises(Unavailable):
            await client.post_json("http://peer/ng-control/prepare", {}, idempotent=True)
    assert transport.seen == 3
    assert {timeout.get("connect") for timeout in transport.timeouts} == {None}  # the kernel's own


async def test_the_deadline_bounds_the_connects_made_again() -> None:
    # each try fails after 0.1 s, whatever its timeout: about 10 tries by the deadline, under the count
    # that bounds them (MAX_SLOW_CONNECTS), and a second one even after the loop was held 0.8 s
    transport = SlowConnects(failures=10**6, wait_s=0.1)
    async with MeshClient(transport=transport, connect_timeout_s=0.01) as client:
        with pytest.raises(UpstreamTimeout):
            await client.post_json("http://peer/ng-control/prepare", {}, idempotent=True, timeout_s=1.0)
    assert 2 <= transport.seen < 10**6


async def test_control_clients_make_slow_connects_again() -> None:
    data = MeshClient(max_connections=4)
    control = data.for_control(2)
    coordinator = Coordinator("http://127.0.0.1:1", "token")
    try:
        assert data.connect_timeout_s is None  # data calls: no change
        assert control.connect_timeout_s == CONTROL_CONNECT_S
        assert coordinator.client.connect_timeout_s == CONTROL_CONNECT_S
    finally:
        for client in (data, control):
            await client.aclose()
        await coordinator.aclose()


@pytest.fixture
def full_listen_queue() -> Iterator[int]:
    """A port whose listen queue is full and never drained: a new connection's SYN is dropped."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    queued = []
    for _ in range(4):
        client = socket.socket()
        client.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            client.connect(("127.0.0.1", port))
        queued.append(client)
    yield port
    for sock in (*queued, server):
        sock.close()


class Counting(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner, self.sent = inner, 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent += 1
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_dropped_syn_is_sent_again_on_a_fresh_socket(full_listen_queue: int) -> None:
    """Over the real transport: the connect into a full listen queue is abandoned after
    ``connect_timeout_s`` and made again, instead of waiting for the kernel's SYN retry (1 s)."""
    transport = Counting(_make_transport("aiohttp", 4, KEEPALIVE_S))
    async with MeshClient(transport=transport, connect_timeout_s=0.05) as client:
        with pytest.raises(UpstreamTimeout):
            await client.post_json(f"http://127.0.0.1:{full_listen_queue}/ng-control/prepare", {},
                                   idempotent=True, timeout_s=0.8)
    assert transport.sent >= 2


async def test_slow_connects_are_bounded_whatever_the_deadline() -> None:
    """Connects reported as timed out (here at once, no wait at all) are made again at most
    ``MAX_SLOW_CONNECTS`` times, then the call fails, long before its deadline."""
    transport = SlowConnects(failures=10**6)
    async with MeshClient(transport=transport, backoff_s=0.01, connect_timeout_s=0.25) as client:
        with pytest.raises(Unavailable, match="tries") as raised:
            await client.post_json("http://peer/ng-control/prepare", {}, idempotent=True, timeout_s=60)
    assert type(raised.value) is Unavailable
    assert transport.seen == MAX_SLOW_CONNECTS + 1
