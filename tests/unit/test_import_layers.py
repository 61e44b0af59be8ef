"""The house keeps its floors: every import of the library against the floors of docs/architecture.md.

The ``floors`` block of docs/architecture.md section 8 says which rooms each room may import. This
test reads every module's imports as text (``ast``: module level and inside functions, type-only
ones included), and fails on an import a room may not make, on any import circle between library
modules, on a server folder importing a room it may not, and on a server folder's test importing
``tests`` (the public test kit is ``nemo_gym_ckpt.testing``). The checker is also run on small
made-up trees, so a forbidden import is shown to fail it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
LIBRARY = "nemo_gym_ckpt"
SERVER_FOLDERS = ("model_servers", "agents", "environment_servers", "resources_servers")
FIRST_PARTY = (LIBRARY, *SERVER_FOLDERS, "tests")
GROUND = frozenset(
    {"errors", "identity", "config", "config_sources", "config_yaml", "config_overrides", "config_interpolations",
     "config_tokens", "client", "server",
     "context", "capture", "canonical", "responses", "echoes", "bounds", "slots",
     "aggregate_metrics"}
)


def floors(text: str) -> dict[str, frozenset[str]]:
    """``room -> rooms it may import`` from the fenced ``floors`` block of the architecture page."""
    block = re.search(r"```floors\n(.*?)```", text, re.S)
    assert block is not None, "docs/architecture.md has no floors block"
    table = {}
    for line in block.group(1).strip().splitlines():
        room, allowed = line.split(":", 1)
        table[room.strip()] = frozenset(allowed.split())
    return table


def module_name(path: Path, base: Path) -> str:
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_of(module: str) -> str:
    """The room of a library module; a server folder's modules are the room of their folder."""
    parts = module.split(".")
    if parts[0] != LIBRARY:
        return parts[0]
    if len(parts) == 1 or parts[1] == "__main__":
        return "door"
    return "ground" if parts[1] in GROUND else parts[1]


def imports_of(source: str, module: str, is_package: bool) -> set[str]:
    """First-party modules named by the imports of one module (``from a import b`` names ``a.b``
    too, since ``b`` may be a module; the caller keeps the names that are modules)."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in FIRST_PARTY}


def read_tree(base: Path, packages: Iterable[str]) -> dict[str, tuple[str, bool]]:
    """``module -> (source, is_package)`` of every module under the given top-level packages."""
    tree = {}
    for package in packages:
        for path in sorted((base / package).rglob("*.py")):
            tree[module_name(path, base)] = (path.read_text(), path.name == "__init__.py")
    return tree


def graph(tree: Mapping[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the modules of ``tree`` it imports."""
    return {module: {name for name in imports_of(source, module, is_package) if name in tree and name != module}
            for module, (source, is_package) in tree.items()}


def rule_of(module: str) -> str:
    """The line of the floors block an importing module keeps (``servers`` for a server folder)."""
    return "servers" if module.split(".")[0] in SERVER_FOLDERS else room_of(module)


def layer_violations(edges: Mapping[str, set[str]], table: Mapping[str, frozenset[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(edges.items()):
        source_room = rule_of(module)
        allowed = table[source_room] | {source_room}
        bad += [f"{module} -> {target} ({source_room} may not import {room_of(target)})"
                for target in sorted(targets) if room_of(target) not in allowed]
    return bad


def circles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


@pytest.fixture(scope="module")
def table() -> dict[str, frozenset[str]]:
    return floors((REPO / "docs" / "architecture.md").read_text())


@pytest.fixture(scope="module")
def library() -> dict[str, set[str]]:
    return graph(read_tree(REPO, [LIBRARY, *SERVER_FOLDERS]))


def test_every_room_of_the_library_is_on_the_floors(table: dict[str, frozenset[str]]) -> None:
    rooms = {room_of(module_name(path, REPO)) for path in (REPO / LIBRARY).rglob("*.py")}
    assert rooms <= table.keys(), f"rooms missing from docs/architecture.md: {sorted(rooms - table.keys())}"


def test_no_library_module_imports_against_the_floors(
    library: dict[str, set[str]], table: dict[str, frozenset[str]]
) -> None:
    ours = {module: targets for module, targets in library.items() if module.startswith(LIBRARY)}
    assert layer_violations(ours, table) == []


def test_only_bench_imports_the_model_servers(library: dict[str, set[str]]) -> None:
    reaching = {module for module, targets in library.items()
                if module.startswith(LIBRARY) and any(t.startswith("model_servers") for t in targets)}
    assert {room_of(module) for module in reaching} <= {"bench"}, sorted(reaching)


def test_no_import_circle_among_modules(library: dict[str, set[str]]) -> None:
    assert circles(library) == []


def test_server_folders_import_only_what_servers_may(
    library: dict[str, set[str]], table: dict[str, frozenset[str]]
) -> None:
    servers = {module: targets for module, targets in library.items()
               if rule_of(module) == "servers" and ".tests" not in module}
    assert layer_violations(servers, table) == []


def test_server_folder_tests_use_the_public_kit_not_tests() -> None:
    offenders = []
    for folder in SERVER_FOLDERS:
        for path in sorted((REPO / folder).rglob("tests/*.py")):
            module = module_name(path, REPO)
            names = imports_of(path.read_text(), module, path.name == "__init__.py")
            offenders += [f"{module} -> {name}" for name in sorted(names) if name.split(".")[0] == "tests"]
    assert offenders == []


def test_no_test_helper_lives_in_the_core_package() -> None:
    helpers = [module_name(path, REPO) for path in (REPO / LIBRARY).rglob("*.py")
               if re.search(r"(testing|fake|mock|stub)", path.stem) and "/testing/" not in path.as_posix()]
    assert helpers == []


# ---- the checker fails when it should -----------------------------------------------------------


FLOORS = "```floors\nground: ground\ncheckpoint: ground\nbench: checkpoint ground model_servers\n```"


def made_up(sources: dict[str, str]) -> dict[str, set[str]]:
    return graph({module: (source, False) for module, source in sources.items()})


@pytest.mark.parametrize(
    ("sources", "expected"),
    [
        ({"nemo_gym_ckpt.errors": "from nemo_gym_ckpt.checkpoint import store\n",
          "nemo_gym_ckpt.checkpoint.store": ""},
         ["nemo_gym_ckpt.errors -> nemo_gym_ckpt.checkpoint.store (ground may not import checkpoint)"]),
        ({"nemo_gym_ckpt.checkpoint.store": "def f():\n    import model_servers.policy_model.app\n",
          "model_servers.policy_model.app": ""},
         ["nemo_gym_ckpt.checkpoint.store -> model_servers.policy_model.app"
          " (checkpoint may not import model_servers)"]),
        ({"nemo_gym_ckpt.bench.suites": "from nemo_gym_ckpt.checkpoint.store import X\n",
          "nemo_gym_ckpt.checkpoint.store": ""}, []),
    ],
    ids=["ground-imports-checkpoint", "function-level-import-of-a-server", "allowed"],
)
def test_the_checker_names_each_forbidden_import(sources: dict[str, str], expected: list[str]) -> None:
    table = floors(FLOORS) | {"servers": frozenset()}
    assert layer_violations(made_up(sources), table) == expected


def test_the_checker_finds_a_circle_kept_apart_by_a_function_level_import() -> None:
    edges = made_up({
        "nemo_gym_ckpt.bench.a": "from nemo_gym_ckpt.bench.b import x\n",
        "nemo_gym_ckpt.bench.b": "def f():\n    from nemo_gym_ckpt.bench.a import y\n",
        "nemo_gym_ckpt.bench.c": "from nemo_gym_ckpt.bench import a\n",
    })
    assert circles(edges) == [["nemo_gym_ckpt.bench.a", "nemo_gym_ckpt.bench.b"]]
