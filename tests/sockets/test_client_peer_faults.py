"""The mesh client against misbehaving peers on 127.0.0.1 (raw asyncio servers), over its default
transport (httpx-aiohttp): a call the peer may have received is never sent again unless idempotent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
import httpx
import pytest

from nemo_gym_ckpt.client import (
    CONTROL_CONNECT_S,
    DEFAULT_MAX_REPLY_BYTES,
    MAX_ERROR_REPLY_BYTES,
    UNSENT_EXTRA,
    MeshClient,
    _make_transport,
    _never_sent,
)
from nemo_gym_ckpt.errors import Unavailable, UpstreamError, UpstreamTimeout

pytestmark = pytest.mark.sockets

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One whole request (headers and a ``Content-Length`` body); the body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return await reader.readexactly(length)


@asynccontextmanager
async def peer(handler: Handler) -> AsyncIterator[str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


class ClosesAfterReading:
    """Reads each whole request (it may have run it), then drops the connection without answering."""

    def __init__(self) -> None:
        self.received = 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await read_request(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        self.received += 1
        writer.close()


@pytest.mark.parametrize("connect_timeout_s", [None, CONTROL_CONNECT_S], ids=["data", "control"])
async def test_a_post_the_peer_read_is_not_sent_again_when_it_drops_the_connection(
    connect_timeout_s: float | None,
) -> None:
    handler = ClosesAfterReading()
    async with peer(handler) as url, MeshClient(connect_timeout_s=connect_timeout_s, backoff_s=0.001) as client:
        with pytest.raises(Unavailable, match="ServerDisconnectedError") as raised:
            await client.request("POST", f"{url}/run", json={"x": 1}, timeout_s=5)
    assert type(raised.value) is Unavailable
    assert handler.received == 1


async def test_an_idempotent_post_the_peer_dropped_is_retried_within_its_bound() -> None:
    handler = ClosesAfterReading()
    async with peer(handler) as url, MeshClient(connect_timeout_s=CONTROL_CONNECT_S, backoff_s=0.001,
                                                retries=2) as client:
        with pytest.raises(Unavailable):
            await client.request("POST", f"{url}/ng-control/prepare", json={}, idempotent=True, timeout_s=5)
    assert handler.received == 3  # 1 + retries, never until the deadline


class Counting(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner, self.sent = inner, 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent += 1
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.parametrize("connect_timeout_s", [None, CONTROL_CONNECT_S], ids=["data", "control"])
async def test_a_refused_connect_is_still_sent_again_with_a_bound(connect_timeout_s: float | None) -> None:
    async with peer(ClosesAfterReading()) as url:
        pass  # closed: its port now refuses connections
    transport = Counting(_make_transport("aiohttp", 4))
    async with MeshClient(transport=transport, connect_timeout_s=connect_timeout_s, backoff_s=0.001,
                          retries=2) as client:
        with pytest.raises(Unavailable, match="ClientConnectorError"):
            await client.request("POST", f"{url}/run", json={}, timeout_s=5)
    assert transport.sent == 3 + UNSENT_EXTRA  # never sent: sent again, bounded, whatever the client


def test_only_errors_that_prove_the_request_never_went_out_count_as_never_sent() -> None:
    refused_write = aiohttp.ClientOSError(None, "Can not write request body for http://peer/run")
    refused_write.__cause__ = aiohttp.ClientConnectionResetError("Cannot write to closing transport")
    assert _never_sent(None)  # httpx's own transport: ConnectError/ConnectTimeout only when connecting
    assert _never_sent(aiohttp.ConnectionTimeoutError("Connection timeout to host"))
    assert _never_sent(refused_write)
    assert not _never_sent(aiohttp.ServerDisconnectedError())
    assert not _never_sent(aiohttp.ClientOSError(104, "Connection reset by peer"))
    assert not _never_sent(aiohttp.ClientConnectionResetError("Connection lost"))


async def test_aiohttp_refuses_a_write_into_a_closing_connection_with_the_message_the_client_reads() -> None:
    """The never-sent test above relies on aiohttp's writer message; this pins it to the version installed."""
    from aiohttp.http_writer import StreamWriter

    class Closing:
        def is_closing(self) -> bool:
            return True

    class Protocol:
        transport = Closing()

    writer = StreamWriter(Protocol(), asyncio.get_running_loop())  # type: ignore[arg-type]
    with pytest.raises(aiohttp.ClientConnectionResetError) as raised:
        await writer.write_headers("POST /run HTTP/1.1", {"Content-Length": "2"})  # type: ignore[arg-type]
        await writer.write(b"{}")
    assert _never_sent(raised.value)


def answers(head: bytes, body_chunks: Callable[[], AsyncIterator[bytes]]) -> Handler:
    """A peer answering ``head`` then the chunks of ``body_chunks`` (chunked transfer encoding)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await read_request(reader)
            writer.write(head + b"transfer-encoding: chunked\r\n\r\n")
            async for chunk in body_chunks():
                writer.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    return handle


async def test_a_streamed_call_s_error_reply_is_read_within_its_deadline() -> None:
    async def trickle() -> AsyncIterator[bytes]:
        while True:  # one byte every 50 ms, forever
            yield b" "
            await asyncio.sleep(0.05)

    head = b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n"
    loop = asyncio.get_running_loop()
    async with peer(answers(head, trickle)) as url, MeshClient() as client:
        started = loop.time()
        with pytest.raises(UpstreamTimeout, match=r"500 reply was not read within 0\.5 s"):
            async with asyncio.timeout(5):  # the test's own watchdog
                async with client.stream("POST", f"{url}/v1/completions", json={}, connect_timeout_s=0.5):
                    pass
    assert loop.time() - started < 2


async def test_a_streamed_call_s_error_reply_is_read_up_to_its_bound() -> None:
    sent = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal sent
        while sent < 64 * MAX_ERROR_REPLY_BYTES:  # ends, so that a client without a bound still returns
            sent += 1 << 16
            yield b" " * (1 << 16)

    head = b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n"
    async with peer(answers(head, endless)) as url, MeshClient() as client:
        with pytest.raises(UpstreamError, match=f"longer than the client's bound of {MAX_ERROR_REPLY_BYTES} bytes"):
            async with client.stream("POST", f"{url}/v1/completions", json={}, connect_timeout_s=5):
                pass
    assert sent < 8 * MAX_ERROR_REPLY_BYTES  # no more than the socket buffers past the bound


async def test_a_streamed_call_s_error_reply_is_still_raised_as_its_class() -> None:
    async def one() -> AsyncIterator[bytes]:
        yield b'{"error": {"code": "unavailable", "detail": "engine is restarting"}}'

    head = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    async with peer(answers(head, one)) as url, MeshClient() as client:
        with pytest.raises(Unavailable, match="engine is restarting"):
            async with client.stream("POST", f"{url}/v1/completions", json={}, connect_timeout_s=5):
                pass


def big_reply(total: int, counter: list[int], *, declared: bool = False) -> Handler:
    """A peer answering 200 with ``total`` bytes of body (chunked, or with ``Content-Length``);
    ``counter[0]`` counts the bytes it managed to write."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await read_request(reader)
            framing = b"content-length: %d" % total if declared else b"transfer-encoding: chunked"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n%b\r\n\r\n" % framing)
            chunk = b" " * (1 << 16)
            while counter[0] < total:
                writer.write(chunk if declared else b"%x\r\n%b\r\n" % (len(chunk), chunk))
                counter[0] += len(chunk)
                await writer.drain()
            if not declared:
                writer.write(b"0\r\n\r\n")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    return handle


@pytest.mark.parametrize("declared", [False, True], ids=["chunked", "content-length"])
async def test_a_reply_past_the_client_s_bound_is_refused_without_reading_it_whole(declared: bool) -> None:
    bound, sent = 1 << 20, [0]
    async with peer(big_reply(64 * bound, sent, declared=declared)) as url, \
            MeshClient(max_reply_bytes=bound) as client:
        with pytest.raises(UpstreamError, match=f"the client's bound of {bound} bytes") as raised:
            await client.request("POST", f"{url}/v1/completions", json={}, timeout_s=30)
    assert raised.value.status == 502
    assert sent[0] < 8 * bound  # no more than the socket buffers past the bound


async def test_a_reply_within_the_bound_is_read_whole() -> None:
    bound, sent = 1 << 20, [0]
    async with peer(big_reply(bound, sent)) as url, MeshClient(max_reply_bytes=bound) as client:
        response = await client.request("POST", f"{url}/v1/completions", json={}, timeout_s=30)
    assert len(response.content) == bound and response.content.strip() == b""


async def test_the_reply_bound_defaults_to_256_mib_and_is_kept_by_clients_made_from_one() -> None:
    async with MeshClient() as data, MeshClient(max_reply_bytes=1234) as small:
        assert data.max_reply_bytes == DEFAULT_MAX_REPLY_BYTES == 256 * 1024 * 1024
        control = small.for_control(2)
        try:
            assert control.max_reply_bytes == 1234
        finally:
            await control.aclose()
