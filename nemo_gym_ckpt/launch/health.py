"""Probing a server's ``GET /health``: whether it answers, as which server, and from which process.

``read_health`` fetches one reply, bounded: at most ``HEALTH_BODY_MAX_BYTES`` of body within
``PROBE_DEADLINE_S`` (None when nothing answers in time). A ``HealthReply`` says whether it is a
healthy answer of the server called ``name`` (``healthy_as``: 200 and a JSON object naming it) and
whether it comes from the process given an instance token (``from_process``, the header of
``launch/instance_token.py``). ``probe_health`` and ``wait_for_health`` are the name-only checks for
a URL whose process is not ours to know (a bench server, a test's); the launcher checks the token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import orjson

from nemo_gym_ckpt.launch.instance_token import carries_token

__all__ = [
    "HEALTH_BODY_MAX_BYTES",
    "POLL_S",
    "PROBE_DEADLINE_S",
    "HealthReply",
    "probe_health",
    "read_health",
    "wait_for_health",
]

HEALTH_BODY_MAX_BYTES = 64 * 1024
PROBE_DEADLINE_S = 5.0
POLL_S = 0.1
_NAME_SHOWN_CHARS = 80


@dataclass(frozen=True)
class HealthReply:
    """One reply to ``GET /health``: its status, headers and (at most ``HEALTH_BODY_MAX_BYTES`` of) body."""

    status: int
    headers: httpx.Headers
    body: bytes

    def healthy_as(self, name: str | None) -> bool:
        """A 200 whose body is a JSON object (naming ``name``, when given)."""
        parsed = self._json() if self.status == 200 else None
        return isinstance(parsed, dict) and (name is None or parsed.get("name") == name)

    def from_process(self, token: str) -> bool:
        """Whether the process that was given the instance token ``token`` sent it."""
        return carries_token(self.headers, token)

    def describe(self) -> str:
        """Who answered, as far as the reply says: its status and the name in its body, if any."""
        parsed = self._json()
        name = parsed.get("name") if isinstance(parsed, dict) else None
        named = f" naming itself {name[:_NAME_SHOWN_CHARS]!r}" if isinstance(name, str) else ""
        return f"status {self.status}{named}"

    def _json(self) -> object:
        """The body as JSON; None for a body that is no JSON or was cut (over the bound)."""
        if len(self.body) > HEALTH_BODY_MAX_BYTES:
            return None
        try:
            return orjson.loads(self.body)
        except orjson.JSONDecodeError:
            return None


def read_health(http: httpx.Client, url: str) -> HealthReply | None:
    """The reply to ``url/health``; None while nothing answers (refused, reset, timed out)."""
    deadline = time.monotonic() + PROBE_DEADLINE_S
    try:
        with http.stream("GET", f"{url}/health") as response:
            body = _read_bounded(response, deadline)
    except httpx.HTTPError:
        return None
    return HealthReply(response.status_code, response.headers, body)


def _read_bounded(response: httpx.Response, deadline: float) -> bytes:
    """The body, cut after ``HEALTH_BODY_MAX_BYTES`` + 1 bytes, at ``deadline`` or where it broke off
    (a cut body is no JSON: no healthy answer, while the headers still say who answered)."""
    body = bytearray()
    try:
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > HEALTH_BODY_MAX_BYTES or time.monotonic() > deadline:
                break
    except httpx.HTTPError:
        pass
    return bytes(body[:HEALTH_BODY_MAX_BYTES + 1])


def probe_health(http: httpx.Client, url: str, name: str | None = None) -> bool:
    """Whether ``url/health`` answers 200 (and, with ``name``, that it is that server)."""
    reply = read_health(http, url)
    return reply is not None and reply.healthy_as(name)


def wait_for_health(url: str, *, timeout_s: float, name: str | None = None) -> None:
    """Wait until ``url/health`` answers; ``TimeoutError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=1.0) as http:
        while not probe_health(http, url, name):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}/health did not answer within {timeout_s:g} s")
            time.sleep(POLL_S)
