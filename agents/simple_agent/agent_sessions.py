"""NeMo Gym 0.7's agent sessions for the simple agent: ``POST /v1/agent_sessions`` and ``/close``.

NeMo Gym's environment servers (its ``single_agent_turn``) drive an agent this way: seed a session
``{agent_session_id, episode_id, task_id, tool_accesses, sandbox_access}`` (answered
``{agent_session_id}`` and a session cookie), call ``/ng-rollout/<capture key>/v1/responses``
with that cookie, then close ``{agent_session_id, episode_id}`` (answered ``{agent_session_id,
agent_observations, resources_cookies}``). ``AgentSessionTable`` keeps what a session says:

- the episode it belongs to (its ``episode_id`` as a rollout identity);
- where its tools are: the first ``direct_http`` tool access's ``base_url`` and ``cookies`` (the
  resources session the environment seeded), which replace the agent's configured resources server
  for that session's activations; an ``mcp`` access is accepted when not ``required`` and not used;
- the resources cookies after its last activation, answered by the close.

A repeated seed of the same id with the same body answers the same session; with another body, or
after a close, it is refused (400). A close of an unknown id answers with no cookies; a repeated
close answers the first reply again. The table keeps the last ``CLOSED_KEPT`` close replies. With
checkpointing on, a retire drops the sessions of the retired attempts (and the earlier ones of
those rollouts) and a forget every session of those rollouts (``drop``).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nemo_gym_ckpt.bounds import Name
from nemo_gym_ckpt.errors import InvalidRequest
from nemo_gym_ckpt.identity import RolloutIdentity

__all__ = [
    "CLOSED_KEPT",
    "AgentSession",
    "AgentSessionTable",
    "CloseAgentSession",
    "DirectHttpAccess",
    "McpAccess",
    "SeedAgentSession",
    "agent_cookie_name",
]

CLOSED_KEPT = 4096
_ACCESS_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
HeaderValue = Annotated[str, Field(max_length=16384)]
"""A cookie or header value (a cookie is at most 4 KB in browsers; a header, 16 KB here)."""


class DirectHttpAccess(BaseModel):
    """Tools reached over plain HTTP at ``base_url`` with these cookies (NeMo Gym's ``DirectHTTPToolAccess``)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["direct_http"] = "direct_http"
    name: str = Field(min_length=1, max_length=256, pattern=_ACCESS_NAME)
    required: bool
    base_url: str = Field(pattern=r"^https?://[^/\s]+(/\S*)?$", max_length=4096)
    cookies: dict[Name, HeaderValue] = Field(default_factory=dict, max_length=64)
    headers: dict[Name, HeaderValue] = Field(default_factory=dict, max_length=64)


class McpAccess(BaseModel):
    """Tools over MCP (NeMo Gym's ``MCPToolAccess``); this agent has no MCP client."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["mcp"]
    name: str = Field(min_length=1, max_length=256, pattern=_ACCESS_NAME)
    required: bool
    connection: dict[str, Any]


class SeedAgentSession(BaseModel):
    """NeMo Gym's ``AgentSeedSessionRequest``."""

    model_config = ConfigDict(extra="forbid")

    agent_session_id: str = Field(min_length=1, max_length=256)
    episode_id: dict[str, Any]
    task_id: dict[Name, Annotated[str, Field(max_length=4096)]] = Field(max_length=16)
    tool_accesses: list[DirectHttpAccess | McpAccess] = Field(default_factory=list, max_length=64)
    sandbox_access: dict[str, Any] | None = None


class CloseAgentSession(BaseModel):
    """NeMo Gym's ``AgentCloseSessionRequest``."""

    model_config = ConfigDict(extra="forbid")

    agent_session_id: str = Field(min_length=1, max_length=256)
    episode_id: dict[str, Any]


@dataclass
class AgentSession:
    """One seeded agent session: its seed, its episode, its tools and the resources cookies now."""

    seed: SeedAgentSession
    identity: RolloutIdentity
    tools_url: str | None
    cookies: dict[str, str] = field(default_factory=dict)


def agent_cookie_name(instance: str) -> str:
    """The cookie naming an agent session of one agent instance."""
    return "ng_agent_session_" + re.sub(r"[^A-Za-z0-9_-]", "_", instance)


def _tools_of(seed: SeedAgentSession) -> tuple[str | None, dict[str, str]]:
    direct = [access for access in seed.tool_accesses if isinstance(access, DirectHttpAccess)]
    required_mcp = [access.name for access in seed.tool_accesses if isinstance(access, McpAccess) and access.required]
    if required_mcp:
        raise InvalidRequest(f"this agent reaches tools over plain HTTP only; required MCP access {required_mcp}")
    if not direct:
        return None, {}
    return direct[0].base_url.rstrip("/"), dict(direct[0].cookies)


class AgentSessionTable:
    """The live agent sessions of one agent, by id, and the replies of the last closes."""

    def __init__(self) -> None:
        self.live: dict[str, AgentSession] = {}
        self.closed: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def seed(self, seed: SeedAgentSession, identity: RolloutIdentity) -> AgentSession:
        """The session ``seed`` names: a new one, or the same one again for an identical seed."""
        session_id = seed.agent_session_id
        if session_id in self.closed:
            raise InvalidRequest(f"agent session {session_id!r} is closed")
        existing = self.live.get(session_id)
        if existing is not None:
            if existing.seed != seed:
                raise InvalidRequest(f"agent session {session_id!r} is bound to another seed request")
            return existing
        tools_url, cookies = _tools_of(seed)
        session = self.live[session_id] = AgentSession(seed, identity, tools_url, cookies)
        return session

    def find(self, session_id: str | None) -> AgentSession | None:
        return self.live.get(session_id or "")

    def drop(self, ended: Callable[[RolloutIdentity], bool]) -> None:
        """Drop the live sessions of the episodes ``ended`` names (a retire or forget of them): their
        seed, tools and cookies. A later close of one, if its fence lets it in, answers as for an unknown id."""
        for session_id in [key for key, session in self.live.items() if ended(session.identity)]:
            del self.live[session_id]

    def close(self, request: CloseAgentSession, identity: RolloutIdentity) -> dict[str, Any]:
        """NeMo Gym's close reply; the session is gone afterwards (a repeat answers the same)."""
        session_id = request.agent_session_id
        if session_id in self.closed:
            return self.closed[session_id]
        session = self.live.get(session_id)
        if session is not None and session.identity != identity:
            raise InvalidRequest(f"agent session {session_id!r} belongs to episode {session.identity.capture_key}")
        self.live.pop(session_id, None)
        reply = {"agent_session_id": session_id, "agent_observations": None,
                 "resources_cookies": dict(session.cookies) if session is not None else None}
        self.closed[session_id] = reply
        while len(self.closed) > CLOSED_KEPT:
            self.closed.popitem(last=False)
        return reply
