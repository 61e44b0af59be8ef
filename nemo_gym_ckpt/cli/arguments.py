"""Argument types the commands share: a bad value is refused by argparse, as a usage error (the usage
line and one line naming the flag, exit status 2), before anything starts.

- ``seconds``: every duration flag of every command (``--ready-timeout-s``, ``--timeout-s``,
  ``--duration-s``, ...): more than 0 and at most ``MAX_SECONDS``, so never ``inf`` or ``nan``, which
  would be deadlines never reached.
- ``head_url``: a ``--head`` URL: ``http://`` or ``https://``, a host, a port (if any) from 1 to
  65535, as the HTTP client parses it (a URL it cannot parse would fail only once sent).
"""

from __future__ import annotations

import argparse

import httpx

from nemo_gym_ckpt.config import MAX_DEADLINE_SECONDS_BOUND

__all__ = ["MAX_PORT", "MAX_SECONDS", "head_url", "seconds"]

MAX_PORT = 65535

MAX_SECONDS = MAX_DEADLINE_SECONDS_BOUND
"""The longest duration a flag takes (a year, as a participant's ``max_deadline_seconds`` allows)."""


def seconds(text: str) -> float:
    """A duration: more than 0 and at most ``MAX_SECONDS`` (so never ``inf`` or ``nan``)."""
    value = float(text)
    if not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most {MAX_SECONDS:g} seconds, got {text}")
    return value


def head_url(text: str) -> str:
    """A head server's URL: ``http://`` or ``https://`` and a host, as the HTTP client parses it."""
    try:
        url = httpx.URL(text)
    except httpx.InvalidURL as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL: {error}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL with a host")
    if url.port is not None and not 0 < url.port <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"{text!r} has port {url.port}: a port is 1 to {MAX_PORT}")
    return text
