"""Every httpx failure becomes the same client error wherever the mesh client meets it: sending a
plain call, reading its reply, opening a stream, reading a streamed body mid-way, reading a streamed
call's error reply. No httpx error leaves the client, and no private class (``_NotSent``) either."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from nemo_gym_ckpt.client import MeshClient, TransportName, verifying_ssl_context
from nemo_gym_ckpt.errors import GymError, Unavailable, UpstreamError, UpstreamTimeout
from nemo_gym_ckpt.identity import parse_capture_key

pytestmark = pytest.mark.unit

URL = "http://peer/run"
CALL = f"POST {URL}"

FAMILIES: dict[str, tuple[httpx.HTTPError, type[GymError]]] = {
    "connect_error": (httpx.ConnectError("connection refused"), Unavailable),
    # httpx-aiohttp raises ConnectTimeout for every aiohttp connection error: a connection failure
    "connect_timeout": (httpx.ConnectTimeout("server disconnected"), Unavailable),
    "read_timeout": (httpx.ReadTimeout("no bytes in time"), UpstreamTimeout),
    "pool_timeout": (httpx.PoolTimeout("no free connection"), UpstreamTimeout),
    "remote_protocol_error": (httpx.RemoteProtocolError("peer closed mid-reply"), Unavailable),
    "decoding_error": (httpx.DecodingError("not what its content-encoding says"), UpstreamError),
    "http_error": (httpx.HTTPError("something else"), UpstreamError),
}


class _FailingBody(httpx.AsyncByteStream):
    """A reply body whose transport fails with ``error`` after its first chunk (``None``: never
    sends another)."""

    def __init__(self, error: httpx.HTTPError | None) -> None:
        self.error = error

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'{"error": '
        if self.error is not None:
            raise self.error
        await asyncio.Event().wait()  # never another chunk: the call's deadline ends the wait


def _failing_send(error: httpx.HTTPError | None) -> httpx.MockTransport:
    async def handler(request: httpx.Request) -> httpx.Response:
        if error is not None:
            raise error
        await asyncio.Event().wait()  # never a reply: the call's deadline ends the wait
        raise AssertionError("the wait above has no end of its own")

    return httpx.MockTransport(handler)


def _failing_body(error: httpx.HTTPError | None, status: int) -> httpx.MockTransport:
    return httpx.MockTransport(lambda request: httpx.Response(status, stream=_FailingBody(error)))


async def _plain(client: MeshClient) -> None:
    await client.request("POST", URL, json={})


async def _streamed(client: MeshClient) -> None:
    async with client.stream("POST", URL, json={}) as response:
        async for _ in response.aiter_bytes():
            pass


Place = tuple[Callable[[httpx.HTTPError | None], httpx.MockTransport], Callable[[MeshClient], Awaitable[None]]]
PLACES: dict[str, Place] = {
    "plain_send": (_failing_send, _plain),
    "plain_reply_read": (lambda error: _failing_body(error, 200), _plain),
    "stream_open": (_failing_send, _streamed),
    "stream_read_mid_body": (lambda error: _failing_body(error, 200), _streamed),
    "stream_error_reply_read": (lambda error: _failing_body(error, 500), _streamed),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("place", PLACES)
async def test_an_httpx_failure_is_the_same_client_error_everywhere(place: str, family: str) -> None:
    error, expected = FAMILIES[family]
    transport_for, call = PLACES[place]
    async with MeshClient(transport=transport_for(error), backoff_s=0.0, retries=0) as client:
        with pytest.raises(GymError) as raised:
            await call(client)
    assert type(raised.value) is expected  # the public class: a failure row names it
    assert raised.value.code == expected.code
    assert raised.value.detail.startswith(f"{CALL}: {type(error).__name__}")
    assert error in _causes(raised.value)  # the httpx error is kept for the log, never raised itself


LATE = {
    "plain_send": f"{CALL} took longer than 0.2 s",
    "plain_reply_read": f"{CALL} took longer than 0.2 s",
    "stream_open": f"{CALL}: no reply within 0.2 s",
    "stream_read_mid_body": f"{CALL}: its stream was not read within 0.2 s",
    "stream_error_reply_read": f"{CALL}: its 500 reply was not read within 0.2 s",
}


@pytest.mark.parametrize("place", PLACES)
async def test_a_peer_that_never_answers_is_an_upstream_timeout_everywhere(place: str) -> None:
    transport_for, call = PLACES[place]
    async with MeshClient(transport=transport_for(None), backoff_s=0.0, retries=0, timeout_s=0.2) as client:
        with pytest.raises(UpstreamTimeout) as raised:
            await call(client)
    assert type(raised.value) is UpstreamTimeout
    assert raised.value.detail == LATE[place]


def _causes(error: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    link = error.__cause__
    while link is not None and len(chain) < 8:
        chain.append(link)
        link = link.__cause__
    return chain


async def _plain_spent(client: MeshClient) -> None:
    await client.request("POST", URL, json={}, timeout_s=-1.5)


async def _streamed_spent(client: MeshClient) -> None:
    async with client.stream("POST", URL, json={}, timeout_s=0.0):
        pass


@pytest.mark.parametrize("call", [_plain_spent, _streamed_spent], ids=["plain", "stream"])
async def test_a_call_whose_deadline_has_passed_says_so_and_never_reaches_the_peer(
    call: Callable[[MeshClient], Awaitable[None]],
) -> None:
    reached: list[httpx.Request] = []
    transport = httpx.MockTransport(lambda request: reached.append(request) or httpx.Response(200, json={}))
    async with MeshClient(transport=transport, backoff_s=0.0, retries=0) as client:
        with pytest.raises(UpstreamTimeout) as raised:
            await call(client)
    assert raised.value.detail == f"{CALL} was not sent: its call's deadline had passed"
    assert reached == []


@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
async def test_every_client_shares_one_tls_context_that_verifies(transport: TransportName) -> None:
    """Loading the CA bundle costs tens of milliseconds of CPU: made once, not once per client."""
    one, other = MeshClient(transport=transport), MeshClient(transport=transport)
    async with one, other, one.with_own_pool(4) as pooled:
        contexts = [_tls_context(client) for client in (one, other, pooled)]
    shared = verifying_ssl_context()
    assert all(context is shared for context in contexts)
    assert shared.verify_mode == ssl.CERT_REQUIRED and shared.check_hostname


def _tls_context(client: MeshClient) -> ssl.SSLContext:
    transport = client._http._transport
    context = getattr(transport, "ssl_context", None) or transport._pool._ssl_context  # type: ignore[attr-defined]
    assert isinstance(context, ssl.SSLContext)
    return context


BAD_URL = "http://[::1:12000/run"
"""A URL httpx cannot parse, as a config's host ``[::1`` (or ``::1``) makes: httpx raised ``InvalidURL``."""


async def _bad_post(client: MeshClient) -> None:
    await client.request("POST", BAD_URL, json={})


async def _bad_get(client: MeshClient) -> None:  # idempotent: retried on Unavailable, but never sent
    await client.request("GET", BAD_URL)


async def _bad_rollout_call(client: MeshClient) -> None:  # the rollout prefix parses the URL first
    await client.request("POST", BAD_URL, json={}, identity=parse_capture_key("r1-a2"))


async def _bad_stream(client: MeshClient) -> None:
    async with client.stream("POST", BAD_URL, json={}):
        pass


@pytest.mark.parametrize(("call", "method"), [(_bad_post, "POST"), (_bad_get, "GET"), (_bad_rollout_call, "POST"),
                                              (_bad_stream, "POST")], ids=["post", "get", "rollout", "stream"])
async def test_a_url_httpx_cannot_parse_is_unavailable_and_never_sent(
    call: Callable[[MeshClient], Awaitable[None]], method: str,
) -> None:
    reached: list[httpx.Request] = []
    transport = httpx.MockTransport(lambda request: reached.append(request) or httpx.Response(200, json={}))
    async with MeshClient(transport=transport, backoff_s=0.0) as client:
        with pytest.raises(Unavailable) as raised:
            await call(client)
    assert type(raised.value) is Unavailable
    assert raised.value.detail == f"{method} {BAD_URL}: not a URL a call can go to: Invalid port: ':1:12000'"
    assert isinstance(raised.value.__cause__, httpx.InvalidURL)  # kept for the log, never raised itself
    assert reached == []
