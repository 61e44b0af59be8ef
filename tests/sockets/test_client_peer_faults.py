"""The mesh client against misbehaving peers on 127.0.0.1 (raw asyncio servers), over its default
transport (httpx-aiohttp): a call the peer may have received is never sent again unless idempotent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import httpx
import pytest

from nemo_gym_ckpt.bounds import MAX_TOKENS
from nemo_gym_ckpt.client import (
    CONTROL_CONNECT_S,
    DEFAULT_MAX_REPLY_BYTES,
    DEFAULT_MAX_STREAM_LINE_BYTES,
    KEEPALIVE_S,
    MAX_ERROR_REPLY_BYTES,
    MAX_KEEPALIVE_S,
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
    transport = Counting(_make_transport("aiohttp", 4, KEEPALIVE_S))
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
    async with peer(answers(head, trickle)) as url, MeshClient() as client:
        # 2 s bound the head and the error body: the head is in well before it, even on a loaded machine
        with pytest.raises(UpstreamTimeout, match=r"500 reply was not read within 2 s"):
            async with asyncio.timeout(10):  # the trickle never ends: read to its end, this watchdog fires
                async with client.stream("POST", f"{url}/v1/completions", json={}, connect_timeout_s=2.0):
                    pass


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


# ---- streamed success replies (server-sent events) ------------------------------------------------

SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
EVENT = b'data: {"choices": [{"token_ids": [1]}]}\n\n'


class StreamingPeer:
    """Answers ``head`` (200, server-sent events) then the chunks of ``body`` (chunked), counting the
    body bytes it wrote; ``closed`` is set once a write finds the connection closed by the client.
    ``request_head`` keeps the request's headers. ``abort_after`` resets the connection after that
    many chunks instead of ending the reply."""

    def __init__(self, body: Callable[[], AsyncIterator[bytes]], head: bytes = SSE_HEAD,
                 abort_after: int | None = None) -> None:
        self.body, self.head, self.abort_after = body, head, abort_after
        self.sent = 0
        self.request_head = b""
        self.closed = asyncio.Event()

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            self.request_head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in self.request_head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            writer.write(self.head + b"transfer-encoding: chunked\r\n\r\n")
            await self._write_body(writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed.set()
        finally:
            writer.close()

    async def _write_body(self, writer: asyncio.StreamWriter) -> None:
        written = 0
        async for chunk in self.body():
            if written == self.abort_after:
                writer.transport.abort()  # a reset in the middle of the reply
                return
            writer.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            self.sent += len(chunk)
            written += 1
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()


def endless_line(total: int) -> Callable[[], AsyncIterator[bytes]]:
    """One ``data:`` line of ``total`` bytes that never ends (the reply ends after it, so that a client
    without a line bound still returns)."""

    async def chunks() -> AsyncIterator[bytes]:
        yield b"data: "
        for _ in range(total >> 16):
            yield b"x" * (1 << 16)

    return chunks


def events(total: int) -> Callable[[], AsyncIterator[bytes]]:
    """Well-formed events, ``total`` bytes of them, never ``[DONE]``."""

    async def chunks() -> AsyncIterator[bytes]:
        block = EVENT * ((1 << 16) // len(EVENT))
        for _ in range(total // len(block)):
            yield block

    return chunks


async def read_lines(client: MeshClient, url: str, timeout_s: float | None = None) -> list[str]:
    async with asyncio.timeout(10):  # the test's own watchdog
        async with client.stream("POST", f"{url}/v1/completions", json={}, timeout_s=timeout_s) as response:
            return [line async for line in response.aiter_lines()]


async def test_a_streamed_line_past_its_bound_is_refused_and_the_connection_closed() -> None:
    bound = 1 << 20
    handler = StreamingPeer(endless_line(64 * bound))
    async with peer(handler) as url, MeshClient(max_stream_line_bytes=bound) as client:
        with pytest.raises(UpstreamError, match=f"a line of the 200 reply is longer than the client's bound of "
                                                f"{bound} bytes") as raised:
            await read_lines(client, url)
        await asyncio.wait_for(handler.closed.wait(), 5)
    assert raised.value.status == 502
    assert handler.sent < 8 * bound  # no more than the socket buffers past the bound


async def test_a_stream_past_the_reply_bound_is_refused_and_the_connection_closed() -> None:
    bound = 1 << 20
    handler = StreamingPeer(events(64 * bound))
    async with peer(handler) as url, MeshClient(max_reply_bytes=bound) as client:
        with pytest.raises(UpstreamError, match=f"the 200 reply is longer than the client's bound of {bound} bytes"):
            await read_lines(client, url)
        await asyncio.wait_for(handler.closed.wait(), 5)
    assert handler.sent < 8 * bound


@pytest.mark.parametrize("line_break", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
async def test_lines_up_to_the_bound_are_read_whole_however_the_chunks_split_them(line_break: bytes) -> None:
    bound = 4096
    lines = [b"data: " + b"x" * (bound - 6), b"", b"data: short", b"y" * bound]
    body = line_break.join(lines) + line_break

    async def odd_chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 1000):
            yield body[start : start + 1000]

    async with peer(StreamingPeer(odd_chunks)) as url, \
            MeshClient(max_stream_line_bytes=bound, max_reply_bytes=len(body)) as client:
        read = await read_lines(client, url)
    assert read == [line.decode() for line in lines]


@pytest.mark.parametrize("where", ["client", "call"])
async def test_an_endless_slow_stream_ends_at_the_call_s_deadline(where: str) -> None:
    async def slow_events() -> AsyncIterator[bytes]:
        while True:  # an event every 50 ms, forever
            yield EVENT
            await asyncio.sleep(0.05)

    handler = StreamingPeer(slow_events)
    # 2 s: the deadline of the head too, which is in well before it even on a loaded machine
    client_s, call_s = (2.0, None) if where == "client" else (600.0, 2.0)
    async with peer(handler) as url, MeshClient(timeout_s=client_s) as client:
        with pytest.raises(UpstreamTimeout, match=r"its stream was not read within 2 s"):
            await read_lines(client, url, call_s)
        await asyncio.wait_for(handler.closed.wait(), 5)
    assert handler.sent > 0


async def test_a_compressed_stream_is_refused_and_only_identity_is_asked_for() -> None:
    import gzip

    async def compressed() -> AsyncIterator[bytes]:
        yield gzip.compress(EVENT * 1000)

    handler = StreamingPeer(compressed, head=SSE_HEAD + b"content-encoding: gzip\r\n")
    async with peer(handler) as url, MeshClient() as client:
        with pytest.raises(UpstreamError, match="'gzip'-encoded"):
            await read_lines(client, url)
    assert b"accept-encoding: identity\r\n" in handler.request_head.lower()


async def test_a_stream_reset_midway_is_the_client_s_unavailable() -> None:
    handler = StreamingPeer(events(1 << 20), abort_after=2)
    async with peer(handler) as url, MeshClient() as client:
        with pytest.raises(Unavailable, match="ReadError"):
            await read_lines(client, url)


async def test_the_stream_line_bound_defaults_to_64_mib_and_is_kept_by_clients_made_from_one() -> None:
    # the largest event a worker sends echoes a prompt at the request bound (6-digit ids, 7 bytes each)
    assert MAX_TOKENS * len(b"999999,") < DEFAULT_MAX_STREAM_LINE_BYTES == 64 * 1024 * 1024
    assert DEFAULT_MAX_STREAM_LINE_BYTES < DEFAULT_MAX_REPLY_BYTES
    async with MeshClient(max_stream_line_bytes=1234) as small:
        control = small.for_control(2)
        try:
            assert control.max_stream_line_bytes == 1234
        finally:
            await control.aclose()


class AnswersAndKeepsOpen:
    """Answers every request ``200 {}`` on a kept-alive connection; counts the connections made."""

    def __init__(self) -> None:
        self.connections = 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                await read_request(reader)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


@pytest.mark.parametrize(("keepalive_s", "connections"), [(0.1, 2), (10.0, 1)])
async def test_an_idle_connection_is_kept_as_long_as_the_client_says(keepalive_s: float, connections: int) -> None:
    handler = AnswersAndKeepsOpen()
    async with peer(handler) as url, MeshClient(keepalive_s=keepalive_s) as client:
        await client.post_json(f"{url}/run", {}, timeout_s=5)
        await asyncio.sleep(0.6)
        await client.post_json(f"{url}/run", {}, timeout_s=5)
    assert handler.connections == connections


@pytest.mark.parametrize("keepalive_s", [0.0, -1.0, MAX_KEEPALIVE_S + 1, float("nan"), float("inf"), True, "5", None])
def test_a_keepalive_past_the_servers_own_is_refused(keepalive_s: Any) -> None:
    with pytest.raises(ValueError, match="keepalive_s"):
        MeshClient(keepalive_s=keepalive_s)

