"""A resources server's tools over MCP: ``McpExposure`` at ``POST /mcp`` (streamable HTTP, the ``mcp`` package).

A server whose settings say ``expose_tools_over_mcp: true`` (NeMo Gym's key) answers MCP's
``initialize``, ``tools/list`` and ``tools/call`` at ``/mcp`` (also under ``/ng-rollout/<key>/``),
with JSON replies and no MCP session of its own (stateless mode: the resources session is the one
the seed opened, found by its cookie as for an HTTP tool call). A call is covered exactly like an
HTTP tool call: the whole MCP request is admitted as a tool call, under the same rollout (its
``/ng-rollout/`` prefix, else its session cookie's: NeMo Gym's callers send no prefix), so it waits
while a checkpoint is open, a retired attempt is refused ``stale_attempt``, it blocks a prepare
while it runs; and ``tools/call`` runs the same method, with the same session, as ``POST /<tool>``,
so the session state a checkpoint exports is the same either way. A tool's result is the text of one ``text``
content item, the same JSON text ``POST /<tool>`` answers; a refused call (bad arguments, a session
of another attempt) is an MCP error result ``<code>: <detail>``. The body of a ``POST`` is read
before admission, as a tool call's is, and a body that is not JSON the mesh can read and write again
(nested past 254 levels, for one) is 400 ``invalid_request`` before MCP sees it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import mcp.types as mcp_types
from fastapi import FastAPI
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from nemo_gym_ckpt.errors import GymError, InvalidRequest
from nemo_gym_ckpt.identity import CURRENT_IDENTITY, RolloutIdentity
from nemo_gym_ckpt.server import refuse_unreadable_json, replayed_body

__all__ = ["MCP_PATH", "McpExposure", "McpTool", "ToolCall"]

MCP_PATH = "/mcp"


@dataclass(frozen=True)
class McpTool:
    """One tool as MCP lists it."""

    name: str
    description: str
    input_schema: dict[str, Any]


ToolCall = Callable[[str, dict[str, Any], Request], Awaitable[Any]]
"""Runs one tool for one request (its cookies find the session): the tool's JSON result."""
Admission = Callable[[Request], AbstractAsyncContextManager[Any]]
"""Admits one MCP request as a tool call, under the rollout its prefix names, else its session cookie's."""


class McpExposure:
    """The MCP endpoint of one server: ``mount(app)`` adds the route and runs the MCP manager in the
    app's lifespan."""

    def __init__(self, name: str, tools: Sequence[McpTool], call: ToolCall, admitted: Admission) -> None:
        self.tools = {tool.name: tool for tool in tools}
        self.call, self.admitted = call, admitted
        self.server: Server[Any, Request] = Server(name)
        self.server.list_tools()(self._list_tools)
        self.server.call_tool(validate_input=False)(self._call_tool)
        self.manager = StreamableHTTPSessionManager(
            self.server, json_response=True, stateless=True,
            security_settings=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        )

    def mount(self, app: FastAPI) -> None:
        app.router.routes.append(Route(MCP_PATH, endpoint=_Endpoint(self)))
        inner = app.router.lifespan_context

        @asynccontextmanager
        async def lifespan(instance: FastAPI) -> AsyncIterator[Any]:
            async with self.manager.run(), inner(instance) as state:
                yield state

        app.router.lifespan_context = lifespan

    async def _list_tools(self) -> list[mcp_types.Tool]:
        return [mcp_types.Tool(name=tool.name, description=tool.description, inputSchema=tool.input_schema)
                for tool in self.tools.values()]

    async def _call_tool(self, name: str, arguments: dict[str, Any]) -> mcp_types.CallToolResult:
        request = self.server.request_context.request
        if name not in self.tools or request is None:
            return _failed(InvalidRequest(f"no tool {name!r}"))
        identity: RolloutIdentity | None = request.scope.get("ng_identity")
        token = CURRENT_IDENTITY.set(identity)
        try:
            result = await self.call(name, arguments or {}, request)
        except GymError as error:
            return _failed(error)
        finally:
            CURRENT_IDENTITY.reset(token)
        text = json.dumps(result, separators=(",", ":"), ensure_ascii=False)
        return mcp_types.CallToolResult(content=[mcp_types.TextContent(type="text", text=text)])


class _Endpoint:
    """The ASGI app of ``/mcp``: the whole MCP request is admitted as one tool call."""

    def __init__(self, exposure: McpExposure) -> None:
        self.exposure = exposure

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        if scope["method"] == "POST":  # read before admission, as a tool call's body is
            body = await request.body()
            refuse_unreadable_json(body)  # the mcp package reads it with the standard library
            receive = replayed_body(body, receive)
        async with self.exposure.admitted(request):
            await self.exposure.manager.handle_request(scope, receive, send)


def _failed(error: GymError) -> mcp_types.CallToolResult:
    text = f"{error.code}: {error.detail}"
    return mcp_types.CallToolResult(content=[mcp_types.TextContent(type="text", text=text)], isError=True)
