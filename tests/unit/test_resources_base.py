"""The resources-server base: declarations, typed methods, sessions, routes, the final-text helper."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from pydantic import Field

import nemo_gym_ckpt.resources.base as resources
from nemo_gym_ckpt.config import ServerConfig, load_config_dict
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.errors import InvalidRequest, StaleCheckpoint
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.resources.base import (
    ResourcesServer,
    ResponseObject,
    Session,
    SessionTable,
    TaskRow,
    ToolArgs,
    Verdict,
    VerifyRequest,
    final_text,
    session_cookie_name,
    tool,
)

pytestmark = pytest.mark.unit


class Note(ToolArgs):
    title: str = Field(description="what the note is called")
    body: str = ""


class Empty(ToolArgs):
    pass


class Kept(ToolArgs):
    value: Any


class CounterTask(TaskRow):
    start: int = 0


class CounterVerify(VerifyRequest):
    target: int


class CounterVerdict(Verdict):
    count: int
    seen_by: str | None


class Counter(ResourcesServer[ServerConfig]):
    """Restart-only by default: keeps a counter per session."""

    async def initial_state(self, task: CounterTask) -> dict[str, Any]:
        return {"count": task.start}

    @tool
    async def bump(self, args: Empty, session: Session) -> int:
        """Add one to the counter."""
        session.state["count"] += 1
        return int(session.state["count"])

    @tool
    async def jot(self, args: Note) -> dict[str, str]:
        """Echo a note.

        This second paragraph is not part of the description.
        """
        if args.title == "stale":
            raise StaleCheckpoint("a domain error from a tool")
        return {"title": args.title, "body": args.body}

    @tool
    async def keep(self, args: Kept) -> Any:
        """Echo a JSON value."""
        return args.value

    async def verify(self, task: CounterVerify, session: Session) -> CounterVerdict:
        count = int(session.state["count"])
        seen_by = session.identity.capture_key if session.identity else None
        return CounterVerdict(reward=float(count == task.target), count=count, seen_by=seen_by)


@pytest.fixture
async def server() -> AsyncIterator[Counter]:
    mesh = load_config_dict({"ctr": {"resources_servers": {"calculator_tools": {}}}})
    ctx: ServerContext[Any] = ServerContext("ctr", mesh.instance("ctr").settings, mesh)
    yield Counter(ctx)
    await ctx.aclose()


@pytest.fixture
async def client(server: Counter) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=server.build_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://ctr") as http:
        yield http


async def test_restart_only_is_the_default_and_says_so(client: httpx.AsyncClient) -> None:
    assert (Counter.checkpoint_mode, Counter.checkpoint_verify) == ("restart_only", "wait")
    reply = await client.post("/seed_session", json={})
    assert reply.headers["x-ng-checkpoint-verify"] == "wait"
    assert reply.headers["x-ng-checkpoint-restart"] == "1"


async def test_sessions_keep_state_and_identity(client: httpx.AsyncClient, server: Counter) -> None:
    seeded = await client.post("/ng-rollout/r7-a2/seed_session", json={"start": 5})
    cookie = {"cookie": f"ng_session_ctr={seeded.json()['resources_session_id']}"}
    client.cookies.clear()
    assert (await client.post("/ng-rollout/r7-a2/bump", json={}, headers=cookie)).text == "6"
    assert (await client.post("/bump", json={}, headers=cookie)).text == "7"
    (session,) = list(server.sessions)
    assert session.identity == RolloutIdentity("r7", 2)
    assert session.state == {"count": 7}
    row = {"target": 7, "response": {"output": []}}
    body = (await client.post("/verify", json=row, headers=cookie)).json()
    assert (body["reward"], body["count"], body["seen_by"]) == (1.0, 7, "r7-a2")


async def test_a_session_of_another_episode_is_refused_on_every_route(
    client: httpx.AsyncClient, server: Counter
) -> None:
    """A request's episode (its prefix, else what its body names) must own the cookie's session, for
    a tool call, ``/verify`` and ``/close_session`` alike: a close dropped the other episode's
    session (and left its own open), a verify graded the other episode's state."""
    ra = (await client.post("/ng-rollout/ra/seed_session", json={"start": 1})).json()["resources_session_id"]
    rb = (await client.post("/ng-rollout/rb/seed_session", json={})).json()["resources_session_id"]
    client.cookies.clear()
    ra_cookie = {"cookie": f"ng_session_ctr={ra}"}
    row = {"target": 1, "response": {"output": []}}
    refused = [
        await client.post("/ng-rollout/rb/bump", json={}, headers=ra_cookie),
        await client.post("/ng-rollout/rb/verify", json=row, headers=ra_cookie),
        await client.post("/verify", json={**row, "_ng_rollout_id": "rb"}, headers=ra_cookie),
        await client.post("/ng-rollout/rb/close_session", json={}, headers=ra_cookie),
        await client.post("/ng-rollout/ra-a1/close_session", json={}, headers=ra_cookie),  # another attempt
        await client.post("/close_session", json={"resources_session_id": rb, "episode_id": {"rollout_id": "rb"}},
                          headers=ra_cookie),
    ]
    codes = [(reply.status_code, reply.json().get("error", {}).get("code")) for reply in refused]
    assert codes == [(409, "stale_attempt")] * 6
    assert {s.session_id: s.state for s in server.sessions} == {ra: {"count": 1}, rb: {"count": 0}}
    closed = await client.post("/ng-rollout/ra/close_session", json={}, headers=ra_cookie)
    assert closed.json() == {"resources_session_id": ra} and [s.session_id for s in server.sessions] == [rb]


async def test_a_stateless_tool_needs_no_session(client: httpx.AsyncClient) -> None:
    reply = await client.post("/jot", json={"title": "t"})
    assert reply.json() == {"title": "t", "body": ""}


async def test_tool_domain_errors_are_structured(client: httpx.AsyncClient) -> None:
    reply = await client.post("/jot", json={"title": "stale"})
    assert (reply.status_code, reply.json()["error"]["code"]) == (409, "stale_checkpoint")


async def test_bad_seed_body_is_400_and_opens_nothing(client: httpx.AsyncClient, server: Counter) -> None:
    reply = await client.post("/seed_session", json={"start": "five"})
    assert (reply.status_code, reply.json()["error"]["code"]) == (400, "invalid_request")
    assert "start" in reply.json()["error"]["detail"] and len(server.sessions) == 0


async def test_verify_echoes_only_what_was_sent(client: httpx.AsyncClient) -> None:
    seeded = await client.post("/seed_session", json={})
    row = {"target": 1, "response": {"id": "resp_1", "output": [], "usage": {"total_tokens": 3}}, "k": [1]}
    cookie = {"cookie": f"ng_session_ctr={seeded.json()['resources_session_id']}"}
    client.cookies.clear()
    body = (await client.post("/verify", json=row, headers=cookie)).json()
    assert body == {**row, "reward": 0.0, "count": 0, "seen_by": None}


def nested(value: Any, levels: int) -> Any:
    for _ in range(levels):
        value = [value]
    return value


DEEP = nested(1, 300)  # orjson reads it (1,024 levels), no part of the mesh writes it (254)


@pytest.mark.parametrize(("path", "body"), [
    ("/seed_session", {"start": 1, "deep": DEEP}),
    ("/verify", {"target": 0, "response": {"output": []}, "deep": DEEP}),
    ("/verify", {"target": 0, "response": {"output": [{"type": "message", "content": DEEP}]}}),
    ("/keep", {"value": DEEP}),
    ("/close_session", {"resources_session_id": "s1", "episode_id": {"rollout_id": DEEP}}),
])
async def test_a_body_nested_deeper_than_the_mesh_writes_is_a_400_on_every_route(
    client: httpx.AsyncClient, server: Counter, path: str, body: dict[str, Any]
) -> None:
    """Refused when read, as every JSON route of the mesh refuses it: ``/verify`` echoed it into a
    reply no encoder could write (a 500), a seed kept it, a tool passed it on."""
    seeded = await client.post("/seed_session", json={})
    client.cookies.clear()
    cookie = {"cookie": f"ng_session_ctr={seeded.json()['resources_session_id']}"}
    reply = await client.post(path, json=body, headers=cookie)
    assert (reply.status_code, reply.json()["error"]["code"]) == (400, "invalid_request"), reply.text
    assert "cannot be written again as JSON" in reply.json()["error"]["detail"]
    assert len(server.sessions) == 1  # nothing opened, nothing closed


def test_tool_definitions_are_openai_function_tools(server: Counter) -> None:
    jot = {t["name"]: t for t in server.tool_definitions()}["jot"]
    assert jot == {
        "type": "function",
        "name": "jot",
        "description": "Echo a note.",
        "parameters": {
            "additionalProperties": False,
            "properties": {
                "title": {"description": "what the note is called", "type": "string"},
                "body": {"default": "", "type": "string"},
            },
            "required": ["title"],
            "type": "object",
        },
        "strict": False,
    }
    chat = {t["function"]["name"]: t for t in server.tool_definitions("chat")}["bump"]
    assert chat["type"] == "function" and chat["function"]["parameters"]["properties"] == {}


def test_final_text() -> None:
    def response(*items: dict[str, Any]) -> ResponseObject:
        return ResponseObject(output=list(items))

    parts = [{"type": "output_text", "text": "a"}, {"type": "refusal", "refusal": "no"},
             {"type": "output_text", "text": "b"}, "junk", {"type": "output_text", "text": None}]
    assert final_text(response({"type": "message", "content": parts})) == "ab"
    assert final_text(response({"type": "message", "content": "plain"})) == "plain"
    assert final_text(response({"type": "message"})) == ""
    assert final_text(response({"type": "message", "content": "x"}, {"type": "reasoning"})) == "x"
    assert final_text(response({"type": "function_call", "name": "f"})) is None
    assert final_text(response()) is None


def test_session_table_and_json_round_trip() -> None:
    table = SessionTable()
    opened = table.open(RolloutIdentity("r1", 1), {"items": {"k": "v"}})
    assert table.get(opened.session_id) is opened
    data = opened.to_json()
    assert data == {"session_id": opened.session_id, "identity": {"rollout_id": "r1", "attempt": 1},
                    "state": {"items": {"k": "v"}}}
    assert Session.from_json(data) == opened
    assert Session.from_json({"session_id": "s", "identity": None}) == Session("s", None, {})
    assert table.close(opened.session_id) and not table.close(opened.session_id)
    for missing in (None, "", opened.session_id):
        with pytest.raises(InvalidRequest):
            table.get(missing)
    table.add(opened)
    assert [s.session_id for s in table] == [opened.session_id]


def test_cookie_names_are_cookie_safe() -> None:
    assert session_cookie_name("kv_store-1") == "ng_session_kv_store-1"
    assert session_cookie_name("a b;c=d") == "ng_session_a_b_c_d"


def _define(body: dict[str, Any], base: type = ResourcesServer) -> type:
    return type("Bad", (base,), body)


async def _verify(self: Any, task: VerifyRequest) -> Verdict:
    return Verdict(reward=0.0)


async def _verify_session(self: Any, task: VerifyRequest, session: Session) -> Verdict:
    return Verdict(reward=0.0)


async def _described(self: Any, args: Empty) -> int:
    """Described."""
    return 0


async def _needs_session(self: Any, args: Empty, session: Session) -> int:
    """Needs a session."""
    return 0


async def _undocumented(self: Any, args: Empty) -> int:
    return 0


async def _untyped(self: Any, args: dict) -> int:  # type: ignore[type-arg]
    """Untyped."""
    return 0


async def _too_many(self: Any, args: Empty, session: Session, extra: int) -> int:
    """Too many."""
    return 0


async def _seed_with_session(self: Any, task: TaskRow, session: Session) -> dict[str, Any]:
    return {}


async def _seed(self: Any, task: TaskRow) -> dict[str, Any]:
    return {}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"checkpoint_mode": "sometimes", "verify": _verify}, "checkpoint_mode must be one of"),
        ({"checkpoint_verify": "maybe", "verify": _verify}, "checkpoint_verify must be one of"),
        ({}, "must define `async def verify"),
        ({"verify": lambda self, task: None}, "must define `async def verify"),
        ({"verify": _described}, "VerifyRequest subclass"),
        ({"verify": _verify, "t": tool(_undocumented)}, "needs a docstring"),
        ({"verify": _verify, "t": tool(_untyped)}, "ToolArgs subclass"),
        ({"verify": _verify, "t": tool(_too_many)}, "must take (self, <model>)"),
        ({"verify": _verify, "tools": tool(_described)}, "cannot be a tool name"),
        ({"verify": _verify, "bad name": tool(_described)}, "cannot be a tool name"),
        ({"verify": _verify, "checkpoint_mode": "stateless", "t": tool(_needs_session)}, "is stateless, but"),
        ({"verify": _verify_session, "checkpoint_mode": "stateless"}, "is stateless, but ['verify']"),
        ({"verify": _verify, "initial_state": _seed_with_session}, "takes no session"),
        ({"verify": _verify, "checkpoint_mode": "stateless", "initial_state": _seed}, "no session state"),
    ],
)
def test_class_definitions_are_checked(body: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError) as raised:
        _define(body)
    assert message in str(raised.value)


def test_tools_must_be_async() -> None:
    def sync_tool(self: Any, args: Empty) -> int:
        return 0

    with pytest.raises(TypeError, match="must be an async method"):
        tool(sync_tool)  # type: ignore[arg-type]


def test_a_minimal_server_is_a_few_lines() -> None:
    server = _define({"checkpoint_mode": "stateless", "verify": _verify, "ping": tool(_described)})
    assert list(server.tool_specs) == ["ping"] and not server.keeps_sessions()
    assert server.seed_signature.model is TaskRow and server.verify_signature.model is VerifyRequest


def test_public_surface() -> None:
    defined_here = {
        name for name, value in vars(resources).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == resources.__name__
    }
    assert defined_here <= set(resources.__all__)
    assert all(hasattr(resources, name) for name in resources.__all__)


# ---- NeMo Gym 0.7's seed and close -------------------------------------------------------------


def ng_seed(session_id: str, rollout_id: str = "4-0", **task_data: Any) -> dict[str, Any]:
    """NeMo Gym's ``ResourcesSeedSessionRequest`` (what its environment servers send)."""
    return {"resources_session_id": session_id, "episode_id": {"rollout_id": rollout_id, "attempt": 0},
            "task_id": {"taskset": "t", "task_id": "1"}, "task_data": task_data}


async def test_nemo_gyms_seed_names_the_session_and_repeats_idempotently(
    client: httpx.AsyncClient, server: Counter
) -> None:
    reply = await client.post("/seed_session", json=ng_seed("resources-session-ab12", start=3))
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"resources_session_id": "resources-session-ab12", "resources_tools": None,
                            "sandbox_access": None}
    assert reply.cookies["ng_session_ctr"] == "resources-session-ab12"
    (session,) = list(server.sessions)
    assert (session.identity, session.state) == (RolloutIdentity("4-0"), {"count": 3})
    cookie = {"cookie": "ng_session_ctr=resources-session-ab12"}
    client.cookies.clear()
    assert (await client.post("/bump", json={}, headers=cookie)).text == "4"
    again = await client.post("/seed_session", json=ng_seed("resources-session-ab12", start=3))
    assert again.status_code == 200 and len(server.sessions) == 1 and session.state == {"count": 4}
    other = await client.post("/seed_session", json=ng_seed("resources-session-ab12", "5-0"))
    assert (other.status_code, other.json()["error"]["code"]) == (400, "invalid_request")
    for bad in ({**ng_seed("x"), "extra": 1}, ng_seed("bad id!"), {**ng_seed("x"), "task_data": []}):
        refused = await client.post("/seed_session", json=bad)
        assert (refused.status_code, refused.json()["error"]["code"]) == (400, "invalid_request"), bad


async def test_nemo_gyms_close_names_the_session_and_a_closed_id_stays_closed(
    client: httpx.AsyncClient, server: Counter
) -> None:
    await client.post("/seed_session", json=ng_seed("resources-session-1"))
    client.cookies.clear()
    body = {"resources_session_id": "resources-session-1", "episode_id": {"rollout_id": "4-0", "attempt": 0}}
    closed = await client.post("/close_session", json=body)  # no cookie: the body names the session
    assert (closed.status_code, closed.json()) == (200, {"resources_session_id": "resources-session-1"})
    assert len(server.sessions) == 0
    assert (await client.post("/close_session", json=body)).status_code == 200  # idempotent
    reseeded = await client.post("/seed_session", json=ng_seed("resources-session-1"))
    assert (reseeded.status_code, reseeded.json()["error"]["code"]) == (400, "invalid_request")
    assert "was closed" in reseeded.json()["error"]["detail"] and len(server.sessions) == 0
    refused = await client.post("/close_session", json={**body, "extra": 1})
    assert (refused.status_code, refused.json()["error"]["code"]) == (400, "invalid_request")


async def test_a_legacy_seed_reads_the_rollout_from_nemo_gyms_dispatch_keys(
    client: httpx.AsyncClient, server: Counter
) -> None:
    """An agent's ``/run`` seeds with the whole run row: its ``_ng_`` keys name the rollout and never
    reach the task."""
    reply = await client.post("/seed_session", json={"start": 2, "_ng_task_index": 6, "_ng_rollout_index": 1,
                                                     "_ng_attempt_index": 3})
    assert reply.status_code == 200, reply.text
    (session,) = list(server.sessions)
    assert session.identity == RolloutIdentity("6-1", 3) and session.state == {"count": 2}


def test_a_table_remembers_a_bounded_number_of_closed_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("nemo_gym_ckpt.resources.sessions.CLOSED_REMEMBERED", 2)
    table = SessionTable()
    for name in ("a", "b", "c"):
        table.note_closed(name)
    assert [table.was_closed(name) for name in ("a", "b", "c")] == [False, True, True]
    with pytest.raises(InvalidRequest, match="was closed"):
        table.open(None, {}, "b")
    assert table.open(None, {}, "a").session_id == "a"
