"""The one HTTP client between mesh servers.

Built on the httpx API with a pluggable transport: ``aiohttp`` (``httpx-aiohttp``, the default: on
the mesh's real call path it measured several times faster than httpx's own transport on
loopback, see docs/benchmarks.md) or ``httpx`` (httpcore). Behaviour the rest of the mesh can rely on:

- the request's rollout identity is passed on: calls made while serving ``/ng-rollout/<key>/...``
  go to ``/ng-rollout/<key>/...`` on the peer too (or to an explicit ``identity``);
- idempotent calls (GET, or a POST marked ``idempotent=True``) are retried a bounded number of
  times on connection failures and 502/503/504; any call is sent again when it was provably never
  sent (no connection could be made, or the pooled connection was found closed before the request
  was written: the peer cannot have run it); nothing else is ever retried. A connection dropped once
  the request may have gone out (the peer disconnected or reset it before answering) is not proof:
  such a call fails with ``Unavailable`` unless it is idempotent (httpx-aiohttp reports every aiohttp
  connection error as ``httpx.ConnectTimeout``, so the aiohttp error it wraps is what decides);
- every call has an overall deadline, retries included, and reads at most ``max_reply_bytes`` of a
  reply (``DEFAULT_MAX_REPLY_BYTES``, 256 MiB): a longer one is ``UpstreamError``; a streamed reply
  (``stream``, server-sent events) is read under the same deadline and total bound, uncompressed, and
  each of its lines is at most ``max_stream_line_bytes`` (``DEFAULT_MAX_STREAM_LINE_BYTES``, 64 MiB);
- cookies are never stored: a call sends only the cookies it is given (a session cookie of one
  rollout must never ride along on another rollout's call);
- failures are mapped here, once (``_client_error``), the same wherever the client meets them (sending,
  reading a reply, opening or reading a stream): a connection not made or lost and any other transport
  failure, and a URL that does not parse (``InvalidURL``, refused before anything is sent), become
  ``Unavailable``, a read, write or pool timeout ``UpstreamTimeout``, any other httpx
  error (a body that does not decode as its ``content-encoding`` says) ``UpstreamError``; a peer's
  ``{"error": ...}`` reply becomes the matching ``GymError`` class: no httpx error leaves the client;
- ``reserved(n)`` is a client with a connection pool of its own (``n`` connections) for control
  calls, so they never queue behind the data calls that hold this client's connections (a client
  over a given transport, such as an in-process one, shares that transport: it has no pool).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import httpx
import orjson

from nemo_gym_ckpt.errors import (
    Overloaded,
    PeerError,
    Unavailable,
    UpstreamError,
    UpstreamTimeout,
    error_from_body,
    retry_after_seconds,
)
from nemo_gym_ckpt.identity import ROLLOUT_PREFIX, RolloutIdentity, current_identity

__all__ = [
    "CONTROL_CONNECT_S",
    "DEFAULT_MAX_REPLY_BYTES",
    "DEFAULT_MAX_STREAM_LINE_BYTES",
    "DEFAULT_TRANSPORT",
    "KEEPALIVE_S",
    "MAX_CONNECT_DOUBLINGS",
    "MAX_ERROR_REPLY_BYTES",
    "MAX_KEEPALIVE_S",
    "MAX_SLOW_CONNECTS",
    "UNSENT_EXTRA",
    "EncodedJson",
    "MeshClient",
    "TransportName",
    "decode_json",
    "raise_for_error",
    "verifying_ssl_context",
    "with_rollout_prefix",
]

logger = logging.getLogger(__name__)

TransportName = Literal["aiohttp", "httpx"]
DEFAULT_TRANSPORT: TransportName = "aiohttp"
RETRYABLE_STATUS = frozenset({502, 503, 504})
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
# An idle pooled connection is dropped after this long: well under uvicorn's default keep-alive
# timeout (5 s), so the client never reuses a connection the server is closing. With equal timeouts,
# aiohttp (which reuses its oldest idle connection first) wrote requests into connections the server
# had just closed ("Can not write request body": a non-idempotent call then fails) with 256 rollouts
# in flight.
KEEPALIVE_S = 2.0
MAX_KEEPALIVE_S = 20.0
"""The longest keep-alive a client may ask for: well under the keep-alive of every mesh server."""
CONTROL_CONNECT_S = 0.25
"""How long a control call's new connection may take before it is made again on a fresh socket
(``MeshClient.for_control``). On 127.0.0.1 a connection is made in well under a millisecond; one that
is not made in this long most likely had its SYN dropped by a full listen queue (thousands of
rollouts connecting at once: 4,795 such drops in one run of the scale bench at 10,000 in flight), and
the kernel would send it again only after 1 s, then 3 s and 7 s."""
MAX_CONNECT_DOUBLINGS = 6
"""A control connect's timeout doubles after each try not made in time, at most this many times
(0.25 s up to 16 s)."""
UNSENT_EXTRA = 3
"""Extra sends of a call found never sent: each may meet another closed pooled connection."""
DEFAULT_MAX_REPLY_BYTES = 256 * 1024 * 1024
"""The most bytes of a reply a call reads (``max_reply_bytes``); a longer one is ``UpstreamError``
(502), refused once the bound is passed, never read whole. Eight times a server's default request
bound (``server.DEFAULT_MAX_BODY_BYTES``, 32 MiB), so any reply a mesh server builds from what it
accepted fits, while a runaway or hostile peer costs at most this much memory per call."""
MAX_ERROR_REPLY_BYTES = 1024 * 1024
"""The most bytes read of a streamed call's error reply (``{"error": {"code", "detail"}}``, a few
hundred bytes in practice); a longer one is ``UpstreamError``."""
DEFAULT_MAX_STREAM_LINE_BYTES = 64 * 1024 * 1024
"""The most bytes of one line of a streamed reply (``max_stream_line_bytes``; in this mesh a
server-sent event is one ``data:`` line); a longer one is ``UpstreamError`` (502), refused once the
bound is passed, never read whole. The largest event the mesh sends is the inference worker's first
chunk of a continued generation: the prompt's ids echoed (about 6.3 bytes a token) and the staged
prefix's ids, token texts, logprobs and text offsets (about 40 bytes a token). This bound holds in
one event a prompt at the request bound (``bounds.MAX_TOKENS`` ids, about 25 MiB) or the prefix of a
whole million-token context (about 40 MiB), while a peer that never ends a line costs at most this
much memory per call, a quarter of ``DEFAULT_MAX_REPLY_BYTES``."""
_STREAM_ENCODING = "identity"
"""What a streamed call asks for (``accept-encoding``) and takes: bytes read are bytes kept, so its
bounds hold (a compressed body would be inflated past them by the decoder, a chunk at a time)."""
MAX_SLOW_CONNECTS = 16
"""A control call's connects not made in time (``_SlowConnect``) are made again at most this many
times (at once: each try waited its whole connect timeout), then the call fails with ``Unavailable``:
with ``CONTROL_CONNECT_S`` doubling up to 16 s, that is about three minutes spent connecting, past any
control call's deadline."""
_WRITE_REFUSED = "Cannot write to closing transport"
"""aiohttp's message when it finds the connection closing before it writes the request (headers and
a bytes body go out in one write, so nothing of the request was sent)."""


@dataclass(frozen=True, slots=True)
class EncodedJson:
    """A JSON body encoded once and sent as these bytes (``json=`` of ``request``): a coordinator
    sends one commit body, whose scope may name thousands of episodes, to every participant."""

    content: bytes


class _NotSent(Unavailable):
    """The request never reached the peer (a new connection failed, or a pooled one was closed)."""


class _SlowConnect(_NotSent):
    """A new connection was not made within this try's connect timeout: its SYN most likely met a
    full listen queue and was dropped (the kernel would send it again only 1, then 3 and 7 seconds
    later). Tried again at once on a fresh socket (the try waited its whole timeout: no spin), with
    twice the timeout (a slow link still gets through), until the call's deadline, at most
    ``MAX_SLOW_CONNECTS`` times."""


def with_rollout_prefix(url: str, identity: RolloutIdentity | None) -> str:
    """Insert ``/ng-rollout/<capture_key>`` before the path of ``url`` (idempotent)."""
    if identity is None:
        return url
    return _prefixed(url, httpx.URL(url), identity)[0]


def _prefixed(url: str, parsed: httpx.URL, identity: RolloutIdentity | None) -> tuple[str, httpx.URL]:
    """``url`` (parsed: ``parsed``) with ``identity``'s rollout prefix, as text and parsed."""
    if identity is None or parsed.path.startswith(ROLLOUT_PREFIX):
        return url, parsed
    parsed = parsed.copy_with(path=f"{ROLLOUT_PREFIX}{identity.capture_key}{parsed.path}")
    return str(parsed), parsed


def _target(method: str, url: str, identity: RolloutIdentity | None) -> tuple[str, httpx.URL]:
    """Where a call goes, parsed once: the URL as text (for messages) and parsed (for httpx), with
    ``identity``'s rollout prefix. A URL httpx cannot parse (a config's host such as ``[::1``, a
    ``--head`` typed wrong) is the client's error (``_client_error``), never httpx's ``InvalidURL``."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as error:
        raise _client_error(f"{method} {url}", error) from error
    return _prefixed(url, parsed, identity)


@functools.cache
def verifying_ssl_context() -> ssl.SSLContext:
    """The TLS context of every client made here: certificates verified against httpx's default CA
    bundle, as each transport would make for itself. Made once per process and shared (a context is
    safe to share across threads): loading the bundle costs tens of milliseconds of CPU, and each
    server builds several clients at its start."""
    return httpx.create_ssl_context(trust_env=False)


def _make_transport(name: TransportName, max_connections: int, keepalive_s: float) -> httpx.AsyncBaseTransport:
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                          keepalive_expiry=keepalive_s)
    verify = verifying_ssl_context()
    if name == "aiohttp":
        import aiohttp
        from httpx_aiohttp import AiohttpTransport

        def session() -> aiohttp.ClientSession:  # built lazily, inside the running loop
            connector = aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=limits.keepalive_expiry)
            return aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())

        return AiohttpTransport(verify=verify, limits=limits, trust_env=False, client=session)
    return httpx.AsyncHTTPTransport(verify=verify, limits=limits, trust_env=False)


class _ReplyCookiesIgnored(httpx.Cookies):
    """An empty cookie store that a reply never adds to: its ``Set-Cookie`` headers are not parsed
    at all (the caller still reads them on the response). httpx parses them into its store after
    every reply, through ``http.cookiejar`` and a urllib request built for it: 3-7% of the CPU of a
    busy environment, agent or policy model server (docs/benchmarks.md, stop 50)."""

    def extract_cookies(self, response: httpx.Response) -> None:
        return None


class _CookielessClient(httpx.AsyncClient):
    """httpx's client with no cookie store: a call sends only the cookies it is given."""

    def __init__(self, **kwargs: Any) -> None:
        self._no_cookies = _ReplyCookiesIgnored()
        super().__init__(**kwargs)

    @property
    def cookies(self) -> httpx.Cookies:
        return self._no_cookies

    @cookies.setter
    def cookies(self, cookies: Any) -> None:
        raise TypeError("the mesh client keeps no cookies: give them per call")


class MeshClient:
    """An async client for calls between servers; one per process, closed with ``aclose``."""

    def __init__(
        self,
        *,
        transport: TransportName | httpx.AsyncBaseTransport = DEFAULT_TRANSPORT,
        max_connections: int = 1024,
        timeout_s: float = 600.0,
        retries: int = 2,
        backoff_s: float = 0.05,
        connect_timeout_s: float | None = None,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
        max_stream_line_bytes: int = DEFAULT_MAX_STREAM_LINE_BYTES,
        keepalive_s: float = KEEPALIVE_S,
    ) -> None:
        """``connect_timeout_s``: a new connection not made by then is abandoned and made again
        with twice the timeout, as often as the call's deadline allows (``None``: the kernel's
        own SYN retries). ``max_reply_bytes``: the most bytes of a reply a call reads, streamed or
        not. ``max_stream_line_bytes``: the most bytes of one line of a streamed reply.
        ``keepalive_s``: how long an idle pooled connection is kept (more than 0, at most
        ``MAX_KEEPALIVE_S``; it must stay under the servers' own keep-alive)."""
        if max_reply_bytes < 1 or max_stream_line_bytes < 1:
            raise ValueError("max_reply_bytes and max_stream_line_bytes must be >= 1")
        if type(keepalive_s) not in (int, float) or not 0 < keepalive_s <= MAX_KEEPALIVE_S:
            raise ValueError(f"keepalive_s must be more than 0 and at most {MAX_KEEPALIVE_S:g}, not {keepalive_s!r}")
        self._transport_name = transport if isinstance(transport, str) else None
        if isinstance(transport, str):
            transport = _make_transport(transport, max_connections, keepalive_s)
        self._http = _CookielessClient(transport=transport, timeout=None, trust_env=False)
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.connect_timeout_s = connect_timeout_s
        self.max_reply_bytes = max_reply_bytes
        self.max_stream_line_bytes = max_stream_line_bytes
        self.keepalive_s = keepalive_s

    async def aclose(self) -> None:
        await self._http.aclose()

    def with_own_pool(self, max_connections: int, connect_timeout_s: float | None = None) -> MeshClient:
        """A client like this one with a pool of its own (``max_connections``) over the same kind of
        transport, so its calls never wait for a connection behind this client's; the caller closes
        it. A client built over a transport object (an in-process one: no pool) answers itself."""
        if self._transport_name is None:
            return self
        return MeshClient(transport=self._transport_name, max_connections=max_connections,
                          timeout_s=self.timeout_s, retries=self.retries, backoff_s=self.backoff_s,
                          connect_timeout_s=connect_timeout_s or self.connect_timeout_s,
                          max_reply_bytes=self.max_reply_bytes, max_stream_line_bytes=self.max_stream_line_bytes,
                          keepalive_s=self.keepalive_s)

    def for_control(self, max_connections: int) -> MeshClient:
        """A client for control calls: ``with_own_pool``, so they never wait behind data calls, and
        connects made again after ``CONTROL_CONNECT_S`` (``connect_timeout_s``), so they never wait
        seconds behind a burst of data connections that filled a server's listen queue."""
        return self.with_own_pool(max_connections, CONTROL_CONNECT_S)

    async def __aenter__(self) -> MeshClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def request(
        self,
        method: str,
        url: str,
        *,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        cookies: Mapping[str, str] | None = None,
        idempotent: bool | None = None,
        timeout_s: float | None = None,
        identity: RolloutIdentity | None = None,
        rollout_prefix: bool = True,
        check: bool = True,
    ) -> httpx.Response:
        """Send one request (with bounded retries if idempotent) under an overall deadline.

        With ``check`` (the default) a non-2xx reply raises the matching ``GymError``; without it
        the response is returned as is (the agent hands tool errors to the model as text).
        """
        method = method.upper()
        retry = idempotent if idempotent is not None else method in IDEMPOTENT_METHODS
        url, target = _target(method, url, (identity or current_identity()) if rollout_prefix else None)
        content = None if json is None else json.content if isinstance(json, EncodedJson) else orjson.dumps(json)
        all_headers = {"content-type": "application/json"} if content is not None else {}
        all_headers.update(headers or {})
        deadline_s = self.timeout_s if timeout_s is None else timeout_s
        _unless_spent(deadline_s, f"{method} {url}")
        try:
            async with asyncio.timeout(deadline_s):
                response = await self._send_with_retries(method, url, target, content, all_headers, cookies, retry)
        except TimeoutError:
            raise UpstreamTimeout(f"{method} {url} took longer than {deadline_s:g} s") from None
        if check:
            raise_for_error(response)
        return response

    async def _send_with_retries(
        self, method: str, url: str, target: httpx.URL, content: bytes | None, headers: dict[str, str],
        cookies: Mapping[str, str] | None, retry: bool,
    ) -> httpx.Response:
        attempts = 1 + (self.retries if retry else 0)
        unsent_retries = 0 if retry else self.retries + UNSENT_EXTRA  # never sent: sent again, whatever it is
        attempt = slow = 0
        while True:
            last = attempt == attempts - 1
            try:
                response = await self._send_once(method, url, target, content, headers, cookies,
                                                 self._connect_timeout(slow))
            except _SlowConnect as not_made:
                slow += 1  # a fresh socket at once (each try waited its whole connect timeout), twice the
                if slow > MAX_SLOW_CONNECTS:  # time: bounded by the count and the call's deadline
                    raise Unavailable(f"{not_made.detail} ({slow} tries)") from not_made
                continue
            except _NotSent as not_sent:
                if unsent_retries > 0:
                    unsent_retries -= 1
                    await asyncio.sleep(self.backoff_s)
                    continue
                if last:  # callers see the public class (a failure row names it)
                    raise Unavailable(not_sent.detail) from not_sent
            except Unavailable:
                if last:
                    raise
            else:
                if last or response.status_code not in RETRYABLE_STATUS:
                    return response
            await asyncio.sleep(self.backoff_s * 2**attempt)
            attempt += 1

    def _connect_timeout(self, slow: int) -> httpx.Timeout | None:
        """The timeouts of a try after ``slow`` connects that were not made in time."""
        if self.connect_timeout_s is None:
            return None
        return httpx.Timeout(None, connect=self.connect_timeout_s * 2 ** min(slow, MAX_CONNECT_DOUBLINGS))

    async def _send_once(
        self, method: str, url: str, target: httpx.URL, content: bytes | None, headers: dict[str, str],
        cookies: Mapping[str, str] | None, timeout: httpx.Timeout | None = None,
    ) -> httpx.Response:
        """One try of a call to ``target`` (``url`` is its text, for messages)."""
        if self._http.is_closed:  # a resend after ``aclose``: the caller sees a peer error, not httpx's RuntimeError
            raise Unavailable(f"{method} {url}: the client is closed")
        request = self._http.build_request(method, target, content=content, headers=headers, timeout=timeout)
        if cookies:
            request.headers["cookie"] = "; ".join(f"{k}={v}" for k, v in cookies.items())
        call = f"{method} {url}"
        async with _AsClientErrors(call):
            response = await self._send_unless_unsent(request, call, timeout)  # read below, within its bound
            try:  # the reply's headers arrived: whatever fails now, the request was sent
                await _read_bounded(response, self.max_reply_bytes, call)
            finally:
                await response.aclose()
        return response

    async def _send_unless_unsent(
        self, request: httpx.Request, call: str, timeout: httpx.Timeout | None,
    ) -> httpx.Response:
        """Send ``request`` and wait for its reply's headers. A connect failure that proves the request
        never went out is ``_NotSent`` (``_SlowConnect`` when not made within ``timeout``), so it may be
        sent again; every other failure is left to ``_AsClientErrors``."""
        try:
            return await self._http.send(request, stream=True)
        except (httpx.ConnectTimeout, httpx.ConnectError) as error:
            cause = _aiohttp_error(error)
            if not _never_sent(cause):  # the peer may have the whole request: never "not sent"
                raise
            if timeout is not None and _connect_timed_out(error, cause):
                raise _SlowConnect(f"{call}: no connection within {timeout.connect:g} s") from error
            raise _NotSent(_failure_text(call, error)) from error

    async def post_json(self, url: str, json: Any = None, **kwargs: Any) -> Any:
        """POST and decode the JSON reply (errors raised as ``GymError``)."""
        return decode_json(await self.request("POST", url, json=json, **kwargs))

    async def get_json(self, url: str, **kwargs: Any) -> Any:
        return decode_json(await self.request("GET", url, **kwargs))

    @contextlib.asynccontextmanager
    async def stream(
        self,
        method: str,
        url: str,
        *,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        identity: RolloutIdentity | None = None,
        connect_timeout_s: float | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[httpx.Response]:
        """A streaming request: the response is yielded once its headers arrive; never retried.

        ``timeout_s`` (default the client's) is the deadline of the whole call, headers and body.
        ``connect_timeout_s`` (default ``timeout_s``, never more) bounds the wait for the headers and,
        for an error status, for its whole body too (at most ``MAX_ERROR_REPLY_BYTES``), which is then
        raised as the matching ``GymError``. A success body, however the caller reads it (bytes or
        lines), comes uncompressed and is bounded: a read past the deadline is ``UpstreamTimeout``, past
        ``max_reply_bytes`` in all or ``max_stream_line_bytes`` in one line ``UpstreamError``, a
        transport failure ``Unavailable``; leaving the block closes the connection."""
        url, target = _target(method, url, identity or current_identity())
        call = f"{method} {url}"
        content = None if json is None else orjson.dumps(json)
        all_headers = {"content-type": "application/json", "accept-encoding": _STREAM_ENCODING, **(headers or {})}
        request = self._http.build_request(method.upper(), target, content=content, headers=all_headers)
        whole_s = self.timeout_s if timeout_s is None else timeout_s
        _unless_spent(whole_s, call)
        head_s = whole_s if connect_timeout_s is None else min(connect_timeout_s, whole_s)
        started = asyncio.get_running_loop().time()
        response = await self._send_stream(request, started + head_s, head_s, call)
        try:
            if response.status_code >= 400:
                await _read_error_reply(response, started + head_s, head_s, call)
                raise_for_error(response)
            bounds = _StreamBounds(self.max_reply_bytes, self.max_stream_line_bytes, started + whole_s, whole_s)
            response.stream = _BoundedBody(response, bounds, call)
            yield response
        finally:
            await response.aclose()

    async def _send_stream(self, request: httpx.Request, deadline: float, limit: float, call: str) -> httpx.Response:
        """Send a streamed call and wait for its reply's headers until ``deadline`` (loop time)."""
        async with _AsClientErrors(call, deadline, f"no reply within {limit:g} s"):
            response = await self._http.send(request, stream=True)
        return response


async def _read_error_reply(response: httpx.Response, deadline: float, limit: float, call: str) -> None:
    """Read a streamed call's error reply whole, within ``deadline`` and ``MAX_ERROR_REPLY_BYTES``."""
    async with _AsClientErrors(call, deadline, f"its {response.status_code} reply was not read within {limit:g} s"):
        await _read_bounded(response, MAX_ERROR_REPLY_BYTES, call)


class _AsClientErrors:
    """A block whose httpx failures are raised as the client's errors (``_client_error``); with a
    ``deadline`` (loop time) it runs within it, and past it is ``UpstreamTimeout`` (``late`` says what
    was late). A class, not a generator: it wraps each chunk a stream reads."""

    __slots__ = ("_call", "_late", "_timeout")

    def __init__(self, call: str, deadline: float | None = None, late: str = "") -> None:
        self._call, self._late = call, late
        self._timeout = None if deadline is None else asyncio.timeout_at(deadline)

    async def __aenter__(self) -> None:
        if self._timeout is not None:
            await self._timeout.__aenter__()

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        traceback: TracebackType | None) -> None:
        if self._timeout is not None:
            try:
                await self._timeout.__aexit__(kind, error, traceback)
            except TimeoutError as late:  # the deadline passed: the block was cancelled
                error = late
            if isinstance(error, TimeoutError):
                raise UpstreamTimeout(f"{self._call}: {self._late}") from None
        if isinstance(error, httpx.HTTPError):
            raise _client_error(self._call, error) from error


def _unless_spent(deadline_s: float, call: str) -> None:
    """Refuse to send a call whose caller's one deadline is already spent (an earlier call took it all)."""
    if deadline_s <= 0:
        raise UpstreamTimeout(f"{call} was not sent: its call's deadline had passed")


def _client_error(call: str, error: httpx.HTTPError | httpx.InvalidURL) -> PeerError:
    """The client's error for an httpx failure, wherever the client meets it: the one mapping.

    A URL httpx cannot parse (``InvalidURL``: no peer can be reached at it) is ``Unavailable``, named so;
    a connection not made or lost (``ConnectError``, ``ConnectTimeout``: httpx-aiohttp reports every
    aiohttp connection error as the latter) and any other transport failure is ``Unavailable``; a
    read, write or pool timeout is ``UpstreamTimeout``; any other httpx error is ``UpstreamError``: the
    peer answered, but unusably (``DecodingError``: a body that is not what its ``content-encoding``
    says; ``TooManyRedirects``)."""
    if isinstance(error, httpx.InvalidURL):
        return Unavailable(f"{call}: not a URL a call can go to: {error}")
    if isinstance(error, httpx.TimeoutException) and not isinstance(error, httpx.ConnectTimeout):
        return UpstreamTimeout(f"{call}: {type(error).__name__}")
    if isinstance(error, httpx.TransportError):
        return Unavailable(_failure_text(call, error))
    return UpstreamError(f"{call}: {type(error).__name__}: {error}")


def _failure_text(call: str, error: httpx.TransportError) -> str:
    """A transport failure's detail; a connection failure is named by the aiohttp error behind it, if
    any (httpx-aiohttp's ``ConnectTimeout`` may stand for a disconnect or a reset)."""
    cause = _aiohttp_error(error) if isinstance(error, httpx.ConnectTimeout | httpx.ConnectError) else None
    return f"{call}: {type(cause or error).__name__}: {error}"


@dataclass(frozen=True, slots=True)
class _StreamBounds:
    """What a streamed success body may take: bytes in all and in one line, and when it must end."""

    reply_bytes: int
    line_bytes: int
    deadline: float
    """Loop time."""
    seconds: float
    """The call's whole deadline, for messages."""


_LINE_BREAK = re.compile(rb"[\r\n]")


class _BoundedBody(httpx.AsyncByteStream):
    """A streamed reply's body as its transport yields it, refused past its ``_StreamBounds``.

    It replaces the response's stream, so ``aiter_bytes`` and ``aiter_lines`` alike read through it:
    each read waits until the deadline at most, the bytes are counted before the caller sees them
    (a line is counted up to CR or LF, the line breaks of server-sent events), and transport errors
    become the client's errors, as for any call."""

    def __init__(self, response: httpx.Response, bounds: _StreamBounds, call: str) -> None:
        _refuse_unbounded(response, bounds, call)
        assert isinstance(response.stream, httpx.AsyncByteStream)  # an async client's reply
        self._inner = response.stream
        self._bounds = bounds
        self._call = call
        self._late = f"its stream was not read within {bounds.seconds:g} s"
        self._status = response.status_code
        self._total = 0
        self._open_line = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        chunks = aiter(self._inner)
        try:
            while (chunk := await self._next(chunks)) is not None:
                self._count(chunk)
                yield chunk
        finally:
            if isinstance(chunks, AsyncGenerator):  # left early: the transport's reader is closed now
                await chunks.aclose()

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def _next(self, chunks: AsyncIterator[bytes]) -> bytes | None:
        async with _AsClientErrors(self._call, self._bounds.deadline, self._late):
            chunk = await anext(chunks, None)
        return chunk

    def _count(self, chunk: bytes) -> None:
        self._total += len(chunk)
        if self._total > self._bounds.reply_bytes:
            raise _longer_than_bound(self._call, f"the {self._status} reply", self._bounds.reply_bytes)
        longest, self._open_line = _longest_line(self._open_line, chunk, self._bounds.line_bytes)
        if longest > self._bounds.line_bytes:
            raise _longer_than_bound(self._call, f"a line of the {self._status} reply", self._bounds.line_bytes)


def _refuse_unbounded(response: httpx.Response, bounds: _StreamBounds, call: str) -> None:
    """Refuse at once a streamed reply whose bounds could not hold: compressed (its decoder would
    inflate each chunk past them) or declaring more than ``reply_bytes``."""
    encoding = response.headers.get("content-encoding", _STREAM_ENCODING).strip().lower()
    if encoding != _STREAM_ENCODING:
        raise UpstreamError(f"{call}: the {response.status_code} stream came {encoding!r}-encoded; "
                            f"streams are read only as {_STREAM_ENCODING!r}")
    _refuse_declared(response, bounds.reply_bytes, call)


def _longest_line(open_line: int, chunk: bytes, limit: int) -> tuple[int, int]:
    """The longest line that ``chunk`` ends or holds and the line left open after it, in bytes, when
    ``open_line`` bytes of a line came before it. Lines end at CR or LF; the lines wholly inside
    ``chunk`` are measured only when they could pass ``limit``."""
    head = _LINE_BREAK.search(chunk)
    if head is None:
        return open_line + len(chunk), open_line + len(chunk)
    first = head.start()
    last = max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))
    inner = 0
    if last - first - 1 > limit:
        inner = max(len(line) for line in _LINE_BREAK.split(chunk[first + 1 : last]))
    tail = len(chunk) - last - 1
    return max(open_line + first, inner, tail), tail


def _longer_than_bound(call: str, what: str, limit: int) -> UpstreamError:
    return UpstreamError(f"{call}: {what} is longer than the client's bound of {limit} bytes")


def _aiohttp_error(error: BaseException) -> BaseException | None:
    """The aiohttp error behind an httpx one (httpx-aiohttp raises its own ``from`` aiohttp's), found
    through ``__cause__``/``__context__``; ``None`` for httpx's own transport or a test's."""
    import aiohttp

    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        if isinstance(link, aiohttp.ClientError):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


def _never_sent(cause: BaseException | None) -> bool:
    """Whether an ``httpx.ConnectError``/``ConnectTimeout`` proves the request never went out.

    httpx's own transport (``cause`` is ``None``) raises them only when no connection was made. Over
    httpx-aiohttp, which raises ``ConnectTimeout`` for every ``aiohttp.ClientConnectionError``, only a
    failed or timed-out connect (``ClientConnectorError``, ``ConnectionTimeoutError``) or a write refused
    because the connection was already closing proves it; ``ServerDisconnectedError`` or a reset
    (``ClientOSError``) may come after the peer read the whole request.
    """
    if cause is None:
        return True
    import aiohttp

    if isinstance(cause, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        return True
    link: BaseException | None = cause
    for _ in range(8):  # "Can not write request body" (ClientOSError) is raised from the writer's refusal
        if link is None:
            break
        if isinstance(link, aiohttp.ClientConnectionResetError) and str(link) == _WRITE_REFUSED:
            return True
        link = link.__cause__
    return False


def _connect_timed_out(error: httpx.TransportError, cause: BaseException | None) -> bool:
    """A connect not made within its timeout (a refused one is not: it is made again after a backoff)."""
    if cause is None:
        return isinstance(error, httpx.ConnectTimeout)
    import aiohttp

    return isinstance(cause, aiohttp.ConnectionTimeoutError)


async def _read_bounded(response: httpx.Response, limit: int, call: str) -> None:
    """Read ``response``'s body (decoded) into ``response.content``, refusing one longer than ``limit``
    bytes (``UpstreamError``) without reading past it; the caller closes the response."""
    _refuse_declared(response, limit, call)
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > limit:
            raise _longer_than_bound(call, f"the {response.status_code} reply", limit)
        chunks.append(chunk)
    response._content = b"".join(chunks)  # what ``aread`` keeps: ``content``, ``json()`` read it


def _refuse_declared(response: httpx.Response, limit: int, call: str) -> None:
    """Refuse a reply whose ``Content-Length`` is past ``limit`` before reading any of it."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise UpstreamError(f"{call}: the {response.status_code} reply declares {declared} bytes, "
                            f"past the client's bound of {limit} bytes")


def raise_for_error(response: httpx.Response) -> None:
    """Raise the ``GymError`` a non-2xx reply stands for."""
    if response.status_code < 400:
        return
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        body = None
    error = error_from_body(response.status_code, body)
    if isinstance(error, Overloaded):
        error.fields["retry_after_s"] = retry_after_seconds(response.headers.get("retry-after"))
    raise error


def decode_json(response: httpx.Response) -> Any:
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError as error:
        size = len(response.content)
        raise UpstreamError(f"{response.request.url} answered non-JSON ({size} bytes)") from error

