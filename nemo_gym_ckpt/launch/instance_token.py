"""The instance token: how the launcher tells the server process it started from another on its port.

Each time the launcher starts a server process it gives it a fresh random token (``new_token``) in
``INSTANCE_TOKEN_ENV``. The process reads it (``read_instance_token``) and serves its app behind
``with_instance_token``, which puts the token on every reply to ``/health`` in the
``INSTANCE_TOKEN_HEADER`` header and changes nothing else (the body stays ``{"status", "name"}``,
what NeMo Gym's tools and ours read). The launcher counts a server as up only when its ``/health``
reply carries the token it gave that process (``carries_token``): a reply without it comes from
another process that holds the port (another mesh's server of the same name, a server left over
from an earlier start, anything else), and the start fails naming it.

A process started without the variable (a test, a bench server) serves its app unchanged; a value
that is not ``TOKEN_HEX_DIGITS`` lowercase hex digits is a ``ConfigError``.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nemo_gym_ckpt.errors import ConfigError

__all__ = [
    "HEALTH_PATH",
    "INSTANCE_TOKEN_ENV",
    "INSTANCE_TOKEN_HEADER",
    "TOKEN_HEX_DIGITS",
    "InstanceTokenMiddleware",
    "carries_token",
    "new_token",
    "read_instance_token",
    "with_instance_token",
]

INSTANCE_TOKEN_ENV = "NEMO_GYM_CKPT_INSTANCE_TOKEN"
INSTANCE_TOKEN_HEADER = "x-ng-instance-token"
TOKEN_HEX_DIGITS = 32
HEALTH_PATH = "/health"
_LOWER_HEX = "0123456789abcdef"


def new_token() -> str:
    """A fresh token for one server process: ``TOKEN_HEX_DIGITS`` random hex digits."""
    return secrets.token_hex(TOKEN_HEX_DIGITS // 2)


def carries_token(headers: Mapping[str, str], token: str) -> bool:
    """Whether a ``/health`` reply's headers name the process that was given ``token``."""
    return headers.get(INSTANCE_TOKEN_HEADER) == token


class InstanceTokenMiddleware:
    """Adds ``INSTANCE_TOKEN_HEADER: token`` to every reply to ``HEALTH_PATH``, whatever its status."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.header = (INSTANCE_TOKEN_HEADER.encode(), token.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != HEALTH_PATH:
            await self.app(scope, receive, send)
            return

        async def send_with_token(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_token)


def read_instance_token(environ: Mapping[str, str] = os.environ) -> str | None:
    """The token the launcher gave this process, None where it gave none (``ConfigError`` if malformed)."""
    token = environ.get(INSTANCE_TOKEN_ENV)
    if token is not None and (len(token) != TOKEN_HEX_DIGITS or not set(token) <= set(_LOWER_HEX)):
        raise ConfigError(f"{INSTANCE_TOKEN_ENV} must be {TOKEN_HEX_DIGITS} lowercase hex digits "
                          f"(the launcher sets it), got {len(token)} characters")
    return token


def with_instance_token(app: ASGIApp, token: str | None) -> ASGIApp:
    """``app`` behind ``InstanceTokenMiddleware`` with ``token``; ``app`` itself where there is none."""
    return app if token is None else InstanceTokenMiddleware(app, token)
