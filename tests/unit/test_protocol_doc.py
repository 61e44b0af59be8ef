"""``docs/protocol.md`` says what the apps serve: its route tables and its error table are read from
the doc and compared with the code.

Routes: every table of the doc headed ``| method | path | served by | does |`` together, against
the ``/ng-control/`` operations of the OpenAPI of every implementation of the project built with
checkpointing on, each named by what it is (its participant ``kind`` from ``/status``, or
``inference worker`` for a server with control routes but no participant). Errors: the table
headed ``| code | status | class | raised when |`` against every subclass of ``GymError`` in
``nemo_gym_ckpt/errors.py`` (each leaf by name, with its wire code and status; the families
share a leaf's code and status). Either side changing alone fails the test.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import httpx
import pytest

from nemo_gym_ckpt import errors
from nemo_gym_ckpt.config import PROJECT_ROOT
from tests.unit.test_every_route_refuses_garbage import MESH as GARBAGE_MESH
from tests.unit.test_openapi_declared import MESH as DECLARED_MESH
from tests.unit.test_openapi_declared import app_of

pytestmark = pytest.mark.unit

DOC = PROJECT_ROOT / "docs" / "protocol.md"
ROUTE_HEADER = ["method", "path", "served by", "does"]
ERROR_HEADER = ["code", "status", "class", "raised when"]
WORKER = "inference worker"
MESH: dict[str, Any] = {**DECLARED_MESH, "legacy_agent": {"environment_servers": {"legacy_agent": {
    "agent_server": {"type": "responses_api_agents", "name": "simple_agent"}}}}}
TOKEN = GARBAGE_MESH["checkpoint"]["control_auth_token"]


def tables(header: list[str]) -> list[list[str]]:
    """The body rows of every markdown table of the doc with exactly this header."""
    rows: list[list[str]] = []
    inside = False
    for line in DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            inside = False
        elif cells == header:
            inside = True
        elif inside and not set(line) <= set("|- "):
            rows.append(cells)
    return rows


def unquoted(cell: str) -> str:
    return cell.replace("`", "").strip()


def documented_routes() -> dict[tuple[str, str], set[str]]:
    routes: dict[tuple[str, str], set[str]] = {}
    for method, path, served_by, _ in tables(ROUTE_HEADER):
        for one in method.split(","):
            key = (one.strip(), unquoted(path))
            assert key not in routes, f"{key} is in the doc twice"
            routes[key] = {kind.strip() for kind in served_by.split(",")}
    return routes


async def kind_of(app: Any) -> str:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        reply = await http.get("/ng-control/v1/checkpoint/status", headers={"authorization": f"Bearer {TOKEN}"})
    return str(reply.json()["kind"]) if reply.status_code == 200 else WORKER


async def served_routes() -> dict[tuple[str, str], set[str]]:
    routes: dict[tuple[str, str], set[str]] = defaultdict(set)
    for name in (name for name in MESH if name != "checkpoint"):
        app = app_of(name, MESH)
        kind = await kind_of(app)
        for path, operations in app.openapi()["paths"].items():
            if path.startswith("/ng-control/"):
                for method in operations:
                    routes[(method.upper(), path)].add(kind)
    return dict(routes)


async def test_the_route_tables_of_the_doc_are_the_control_routes_every_kind_serves() -> None:
    served = await served_routes()
    assert {kind for kinds in served.values() for kind in kinds} == {
        "environment", "model", "agent", "resources", WORKER}
    assert documented_routes() == served


def public_subclasses(cls: type[errors.GymError]) -> list[type[errors.GymError]]:
    """Subclasses defined in ``errors.py`` (a module's private refinement keeps its parent's code)."""
    return [sub for sub in cls.__subclasses__() if sub.__module__ == errors.__name__]


def gym_errors() -> set[tuple[str, int, str]]:
    found, todo = set(), [errors.GymError]
    while todo:
        cls = todo.pop()
        todo += public_subclasses(cls)
        if not public_subclasses(cls):
            found.add((cls.code, cls.status, cls.__name__))
    return found


def test_the_error_table_of_the_doc_is_every_gym_error_with_its_code_and_status() -> None:
    documented = set()
    for code, status, names, _ in tables(ERROR_HEADER):
        for name in re.split(r"[,\s]+", unquoted(names)):
            documented.add((unquoted(code), int(status), name))
    assert documented == gym_errors()
    families = {(cls.code, cls.status) for cls in public_subclasses(errors.GymError)} | {
        (errors.GymError.code, errors.GymError.status)}
    assert families <= {(code, status) for code, status, _ in documented}
