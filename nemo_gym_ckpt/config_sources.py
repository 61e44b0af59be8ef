"""Where a mesh config's values come from: files and their ``config_paths``, overrides, directives, ``${...}``.

``read_sources(paths, overrides)`` gives the merged, still unvalidated tree and the file that set
each key (``Origins``), in NeMo Gym's order (docs/architecture.md section 3):

1. Files. The command line's files, and the ``config_paths`` of every file (and of a
   ``+config_paths=[...]`` override), are looked up against the working directory, then the project
   root; a missing one is an error. A file that includes others overrides them; of two files named
   side by side the later wins; a file named twice is read once.
2. Overrides: ``key=value``, ``+key=value`` and ``++key=value`` set a dotted key, values read as
   NeMo Gym's Hydra reads them (``config_overrides``). As in NeMo Gym, the overrides are gathered
   into one tree first, in order (a mapping merges into a mapping set before it, anything else
   replaces what was there; a number through a list set before names its item), and that tree is
   merged over the files: ``++a={x: 1}`` keeps the other keys a file gave ``a``, a list or a scalar
   replaces the file's value. Every merge is OmegaConf's: ``???`` over a key already set keeps its
   value, a mapping over a list or a list over a mapping is refused. Keys follow Hydra's key grammar.
3. Directives: ``X: {_inherit_from: a.b, ...}`` is the block at ``a.b`` with X's own keys merged
   over it (OmegaConf's merge again: ``???`` keeps the block's value, a mapping and a list do not
   merge), and ``a.b`` is moved (it no longer exists); ``_copy`` does the same and keeps ``a.b``;
   ``${inherit_from:a.b}`` and ``${copy:a.b}`` are the same without own keys. A block that is
   ``???`` (or under one) makes X ``???``. NeMo Gym copies the named block as the files wrote it, so
   a directive inside it (a chain) is refused, and so is a directive that is a list's item (NeMo Gym
   leaves both unexpanded). An environment server's agent reference that names a moved agent
   instance follows it to its new name.

A file's string holding a malformed ``${...}`` is refused on reading, as NeMo Gym's loader
(OmegaConf) refuses it (``config_interpolations``).

``resolve_interpolations`` then replaces ``${a.b}`` by that value, ``${oc.select:a.b,default}`` by
that value or the default when there is none, and ``${oc.env:VAR}`` / ``${oc.env:VAR,default}`` by
the environment. Every error is a ``ConfigError`` naming the file and
the key.

Bounds: each file is read by ``config_yaml`` (size, nesting, aliases), each override's value by
``config_overrides`` (values, nesting, numbers); an override's key has at most ``MAX_DEPTH`` parts;
directives and interpolation build at most ``MAX_EXPANDED_VALUES`` values by copying blocks
(``${a.b}`` of a mapping, ``_copy``, ``_inherit_from``) and ``MAX_EXPANDED_CHARS`` characters of
strings made by interpolation inside text (a whole string copied is the same object: no cost), so a
few lines that name each other ten times over are refused instead of growing without end. Text is
counted piece by piece before it is added, so it is refused before it is built: a mapping or list
named inside text (``a${block}``) is written as Python writes it (``a{'k': 'v'}``, as NeMo Gym's
OmegaConf does), one item at a time.

A config path that cannot be looked up (a name longer than the file system takes, ``~user`` of no
such user) is a ``ConfigError`` as a missing file is.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import yaml

from nemo_gym_ckpt.config_interpolations import interpolation_problem
from nemo_gym_ckpt.config_overrides import OverrideRefused, parse_override_value
from nemo_gym_ckpt.config_yaml import MAX_DEPTH, YamlRefused, load_yaml, read_yaml_file
from nemo_gym_ckpt.errors import ConfigError

__all__ = [
    "COMMAND_LINE",
    "CONFIG_PATHS",
    "MAX_EXPANDED_CHARS",
    "MAX_EXPANDED_VALUES",
    "MISSING_VALUE",
    "PROJECT_ROOT",
    "Origins",
    "deep_copy",
    "interpolation_roots",
    "origin_of",
    "parse_overrides",
    "read_sources",
    "resolve_config_path",
    "resolve_interpolations",
]

PROJECT_ROOT = Path(__file__).resolve().parent.parent
"""The folder holding ``configs/`` and the server folders: the checkout, or site-packages when installed."""
COMMAND_LINE = "<command line>"
MISSING_VALUE = "???"
"""OmegaConf's missing value: merged over a key already set, it keeps that key's value (as NeMo Gym's merge does)."""
CONFIG_PATHS = "config_paths"
HYDRA = "hydra"
"""The key of Hydra's own settings on NeMo Gym's command line (``hydra.run.dir``, ``hydra/job_logging``)."""
INHERIT_FROM = "_inherit_from"
COPY = "_copy"
DELETE_KEY = "_delete_key"
AGENTS_TYPE = "responses_api_agents"
ENVIRONMENTS_TYPE = "environment_servers"
_NAME = "[A-Za-z_$][A-Za-z0-9_$-]*"
_INDEX = "0|[1-9](?:_?[0-9])*"
_GROUP_NAME = "[A-Za-z_][A-Za-z0-9_-]*"
_OVERRIDE_KEY = re.compile(
    f"{_NAME}|(?:{_NAME}|{_INDEX})(?:\\.(?:{_NAME}|{_INDEX}))+|{_GROUP_NAME}(?:/{_GROUP_NAME})+")
"""Hydra's key grammar: a name (letters, digits, ``_``, ``-``, ``$``; not first a digit or ``-``), names
and numbers (``0``, or digits not starting with 0) joined by dots, or names joined by ``/`` (a config
group's path, set as one key)."""
_DIRECTIVE_STRING = re.compile(r"\$\{(inherit_from|copy):([^${}]+)\}")
_INTERPOLATION = re.compile(r"\$\{([^${}]+)\}")
_RESOLVER = re.compile(r"([A-Za-z_][\w.]*):")
MAX_EXPANDED_VALUES = 100_000
"""Values that directives, and apart from them interpolation, may build by copying blocks."""
MAX_EXPANDED_CHARS = 16 << 20
"""Characters of the strings that interpolation inside text (``a${x}b``) may build, in all."""

Path_ = tuple[str, ...]
Origins = dict[Path_, str]
"""The file (or ``<command line>``) that set each key path."""


def read_sources(paths: Sequence[str | Path], overrides: Sequence[str]) -> tuple[dict[str, Any], Origins]:
    """The merged tree of the files (with their ``config_paths``), the overrides applied, directives done."""
    command_line = _command_line_tree(parse_overrides(overrides))
    roots = [(str(path), COMMAND_LINE) for path in paths]
    roots += [(entry, COMMAND_LINE) for entry in _config_path_list(command_line.pop(CONFIG_PATHS, None), COMMAND_LINE)]
    if not roots:
        raise ConfigError("no config file given")
    merged: dict[str, Any] = {}
    origins: Origins = {}
    files = _files_in_merge_order(roots)
    for path, data in files:
        _merge_into(merged, data, str(path), origins, ())
    _merge_into(merged, command_line, COMMAND_LINE, origins, ())
    merged[CONFIG_PATHS] = [str(path) for path, _ in files]
    origins[(CONFIG_PATHS,)] = COMMAND_LINE
    return _Directives(merged, origins).apply(), origins


# ---- files ---------------------------------------------------------------------------------------


def resolve_config_path(entry: str, named_in: str) -> Path:
    """``entry`` as given if absolute; else against the working directory, then the project root."""
    def refuse(problem: str) -> NoReturn:
        if named_in == COMMAND_LINE:
            raise ConfigError(f"file {problem}", file=entry)
        raise ConfigError(f"config_paths entry {entry!r} {problem}", file=named_in, key=CONFIG_PATHS)

    try:
        path = Path(entry).expanduser()
    except RuntimeError:  # ~name of no such user, or no home directory for ~
        refuse(f"cannot be found: no home directory for {entry.partition('/')[0]!r:.80} (no such user?)")
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, PROJECT_ROOT / path]
    for candidate in candidates:
        try:
            if candidate.is_file():
                return candidate.resolve()
        except OSError as error:  # a name longer than the file system takes, a folder we may not search, ...
            refuse(f"cannot be looked for: {error.strerror or error}")
    refuse(f"not found (looked in {', '.join(str(c) for c in candidates)})")


def _files_in_merge_order(roots: Sequence[tuple[str, str]]) -> list[tuple[Path, dict[str, Any]]]:
    """Every file once, each after the files it includes, siblings in the order named."""
    order: list[tuple[Path, dict[str, Any]]] = []
    seen: set[Path] = set()

    def visit(entry: str, named_in: str) -> None:
        path = resolve_config_path(entry, named_in)
        if path in seen:
            return
        seen.add(path)
        data = _read_yaml(path)
        for included in _config_path_list(data.pop(CONFIG_PATHS, None), str(path)):
            visit(included, str(path))
        order.append((path, data))

    for entry, named_in in roots:
        visit(entry, named_in)
    return order


def _config_path_list(value: Any, file: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise ConfigError(f"expected a list of config file paths, got {value!r}", file=file, key=CONFIG_PATHS)
    return value


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = read_yaml_file(path)
    except OSError as error:
        raise ConfigError(f"cannot read: {error.strerror}", file=str(path)) from None
    except YamlRefused as error:
        raise ConfigError(str(error), file=str(path)) from None
    except yaml.YAMLError as error:
        raise ConfigError(f"not valid YAML: {error}".replace("\n", " "), file=str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("expected a mapping at the top level", file=str(path))
    _refuse_malformed_interpolations(data, str(path), ())
    return data


def _refuse_malformed_interpolations(value: Any, file: str, path: Path_) -> None:
    """A string value that NeMo Gym's loader (OmegaConf) refuses, holding a malformed ``${...}``, is refused
    here too, naming its key (keys themselves are not read for ``${`` there, nor here)."""
    if isinstance(value, dict | list):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            _refuse_malformed_interpolations(item, file, (*path, str(key)))
    elif isinstance(value, str):
        problem = interpolation_problem(value)
        if problem is not None:
            raise ConfigError(f"{value!r:.80} is not a value NeMo Gym's loader (OmegaConf) reads: a malformed "
                              f"${{...}}: {problem}", file=file, key=".".join(path))


def _merge_into(dst: dict[str, Any], src: Mapping[str, Any], origin: str, origins: Origins, prefix: Path_) -> None:
    """``src`` over ``dst`` as NeMo Gym's merge (OmegaConf's) does it: a mapping into a mapping, ``???``
    over a key already there keeps its value, a mapping over a list or a list over a mapping is refused,
    anything else replaces."""
    for key, value in src.items():
        key = str(key)
        path = (*prefix, key)
        here = dst.get(key)
        if isinstance(value, str) and value == MISSING_VALUE and key in dst:
            continue
        if isinstance(value, Mapping) and isinstance(here, dict):
            origins.setdefault(path, origin)
            _merge_into(here, value, origin, origins, path)
            continue
        _refuse_clash(value, here, origin, origin_of(origins, path), path)
        dst[key] = deep_copy(value)
        for sub in _leaf_paths(value, path):
            origins[sub] = origin


def _refuse_clash(value: Any, here: Any, origin: str, here_from: str | None, path: Path_) -> None:
    """A mapping over a list, or a list over a mapping: NeMo Gym's merge (OmegaConf's) refuses both."""
    if isinstance(value, Mapping) and isinstance(here, list):
        new, old = "a mapping", "list"
    elif isinstance(value, list) and isinstance(here, dict):
        new, old = "a list", "mapping"
    else:
        return
    dotted = ".".join(path)
    was = f"the {old} that {here_from} gives it" if here_from and here_from != COMMAND_LINE \
        else f"the {old} set earlier on the command line"
    raise ConfigError(f"{new} cannot be merged over {was} (NeMo Gym's merge refuses it too): give "
                      f"{'a list' if old == 'list' else 'a mapping'} instead",
                      file=origin, key=dotted)


def _leaf_paths(value: Any, path: Path_) -> Iterator[Path_]:
    yield path
    if isinstance(value, Mapping):
        for key, sub in value.items():
            yield from _leaf_paths(sub, (*path, str(key)))


# ---- overrides -----------------------------------------------------------------------------------


def parse_overrides(overrides: Sequence[str]) -> list[tuple[Path_, Any]]:
    """``a.b=1``, ``+a.b=1``, ``++a.b=1`` -> ((a, b), 1): each sets the key, adding it if absent.

    The value is read as NeMo Gym's Hydra reads it (``config_overrides.parse_override_value``). An
    override of Hydra's own settings (``hydra.run.dir=...``, ``hydra/job_logging=disabled``) is read and
    left out: in NeMo Gym it configures Hydra's run (its output folder, its logging) and never reaches
    the config; here there is no such run."""
    parsed = []
    for item in overrides:
        if item.startswith("~"):
            raise ConfigError(f"override {item!r}: deleting a key (~key) is not supported", file=COMMAND_LINE)
        key, eq, text = item[2 if item.startswith("++") else 1 if item.startswith("+") else 0 :].partition("=")
        if not eq or not key:
            raise ConfigError(f"override {item!r:.120} is not key=value", file=COMMAND_LINE)
        _check_key(key, item)
        if key.count(".") >= MAX_DEPTH:
            raise ConfigError(f"override key {key[:80]!r}...: more than {MAX_DEPTH} parts", file=COMMAND_LINE)
        try:
            value = parse_override_value(text)
        except OverrideRefused as error:
            raise ConfigError(f"override {key}: {error}", file=COMMAND_LINE) from None
        if key.split(".")[0] != HYDRA and not key.startswith(f"{HYDRA}/"):
            parsed.append((tuple(key.split(".")), value))
    return parsed


def _check_key(key: str, item: str) -> None:
    """Refuse a key NeMo Gym's Hydra refuses, as it does."""
    if _OVERRIDE_KEY.fullmatch(key):
        return
    name, at, _ = key.partition("@")
    if at and (not name or _OVERRIDE_KEY.fullmatch(name)):
        raise ConfigError(f"override {item!r:.120}: key@package names a config group's package, and NeMo "
                          "Gym has no config groups (its Hydra refuses it too)", file=COMMAND_LINE)
    raise ConfigError(f"override {item!r:.120}: {key!r:.80} is not a key NeMo Gym's Hydra reads: names joined "
                      "by dots, each a letter, _ or $ then letters, digits, _, - or $ (a part after or before a "
                      "dot may be a number: 0, or digits not starting with 0)", file=COMMAND_LINE)


def _command_line_tree(parsed: Sequence[tuple[Path_, Any]]) -> dict[str, Any]:
    """The overrides in one tree, in order, as Hydra builds NeMo Gym's: a mapping merges into the mapping
    already at its key (``???`` in it keeps what is there), a mapping over a list or a list over a
    mapping is refused, anything else replaces what is there; a key through a scalar (or null) puts a
    mapping in its place; a number through a list set earlier names its item."""
    tree: dict[str, Any] = {}
    for path, value in parsed:
        node: dict[Any, Any] | list[Any] = tree
        for depth, part in enumerate(path[:-1]):
            slot = _slot(node, part, path[: depth + 1])
            child = node[slot] if isinstance(node, list) else node.get(slot)
            if not isinstance(child, dict | list):
                child = {}
                node[slot] = child
            node = child
        slot = _slot(node, path[-1], path)
        here = node[slot] if isinstance(node, list) else node.get(slot)
        if isinstance(value, dict) and isinstance(here, dict):
            _merge_into(here, value, COMMAND_LINE, {}, path)
            continue
        _refuse_clash(value, here, COMMAND_LINE, None, path)
        node[slot] = value
    return tree


def _slot(node: dict[Any, Any] | list[Any], part: str, path: Path_) -> Any:
    """``part`` as a key of ``node``, or, ``node`` a list set earlier on the command line, as the index of
    one of its items (Hydra sets the item; a key that is no index into the list it refuses)."""
    if isinstance(node, dict):
        return part
    index = int(part) if re.fullmatch(_INDEX, part) else None
    if index is None or index >= len(node):
        which = f"has no item {part}" if index is not None else f"takes a number, not {part!r}"
        raise ConfigError(f"override {'.'.join(path)}: {'.'.join(path[:-1])} is a list of {len(node)} "
                          f"(set earlier on the command line), which {which} (NeMo Gym's Hydra refuses it too)",
                          file=COMMAND_LINE, key=".".join(path))
    return index


def _yaml_scalar(text: str) -> Any:
    """The YAML value of ``text``, or ``text`` itself if it is not YAML (``YamlRefused`` past the bounds)."""
    try:
        return load_yaml(text) if text else ""
    except yaml.YAMLError:
        return text


# ---- directives: _inherit_from, _copy ------------------------------------------------------------


class _Directives:
    """Expands ``_inherit_from`` and ``_copy`` (block or ``${...}`` string) against the merged tree."""

    def __init__(self, tree: dict[str, Any], origins: Origins) -> None:
        self.frozen = deep_copy(tree)
        self.origins = origins
        self.active: list[Path_] = []
        self.moves: dict[Path_, list[Path_]] = {}
        self.copies = _Copies()

    def apply(self) -> dict[str, Any]:
        result: dict[str, Any] = self.expand(self.frozen, ())
        for source in self.moves:
            _delete_path(result, source)
        self._follow_moved_agents(result)
        return result

    def expand(self, value: Any, path: Path_) -> Any:
        if self.active:  # a copy of the value, inside a block that a directive copies
            self.spend(value, path)
        directive = self.directive_of(value, path)
        if directive is None:
            if isinstance(value, dict):
                return {key: self.expand(item, (*path, key)) for key, item in value.items()}
            if isinstance(value, list):
                return [self.expand_item(item, (*path, str(index))) for index, item in enumerate(value)]
            return value
        kind, source, own = directive
        if source in self.active or path in self.active or source == path[: len(source)]:
            self.fail(f"{kind} {'.'.join(source)} refers back to itself", path)
        found = self.lookup(source, kind, path)
        if kind == INHERIT_FROM:
            self.moves.setdefault(source, []).append(path)
        if found == MISSING_VALUE:  # a required value: so is the block made of it, own keys or not (NeMo Gym's)
            return MISSING_VALUE
        self.refuse_chain(found, kind, source, path)
        self.active.append(path)
        try:
            base = self.expand(found, source)
            local = {key: self.expand(item, (*path, key)) for key, item in own.items()}
        finally:
            self.active.pop()
        self._carry_origins(source, path)
        if not local:
            return base
        if not isinstance(base, dict):
            self.fail(f"{kind} {'.'.join(source)} is not a mapping, so keys cannot be merged over it", path)
        merged = deep_copy(base)  # X's own keys over the block, by the files' merge; a clash names the directive
        _merge_into(merged, local, origin_of(self.origins, path) or COMMAND_LINE,
                    {path: f"{kind} {'.'.join(source)}"}, path)
        return merged

    def expand_item(self, item: Any, path: Path_) -> Any:
        """A list's item: NeMo Gym expands no directive that is one (it keeps the item as written)."""
        kind = _directive_kind(item)
        if kind is not None:
            self.fail(f"{kind} as a list's item: NeMo Gym does not expand it there (it keeps the item as written); "
                      "put the block under a key", path)
        return self.expand(item, path)

    def refuse_chain(self, found: Any, kind: str, source: Path_, path: Path_) -> None:
        """NeMo Gym copies the block a directive names as the files wrote it: a directive inside it stays a
        key (or a string) of the copy, unexpanded, and the keys it names are not there. Refused here."""
        inner = _first_directive(found, source)
        if inner is None:
            return
        inner_kind, inner_path = inner
        where = "it" if inner_path == source else f"{'.'.join(inner_path)} in it"
        self.fail(f"{kind} {'.'.join(source)}: {where} is itself a {inner_kind}, which NeMo "
                  f"Gym does not follow (it copies the block as written, {inner_kind} unexpanded, without the keys "
                  f"that one names): name the block it names directly, or write its keys out", path)

    def directive_of(self, value: Any, path: Path_) -> tuple[str, Path_, dict[str, Any]] | None:
        if isinstance(value, str):
            match = _DIRECTIVE_STRING.fullmatch(value.strip())
            if match is None:
                return None
            kind = INHERIT_FROM if match[1] == "inherit_from" else COPY
            return kind, self.dotted(match[2], path), {}
        if not isinstance(value, dict):
            return None
        if DELETE_KEY in value:
            self.fail(f"{DELETE_KEY} is not supported: leave the keys out, or set them with an override",
                      (*path, DELETE_KEY))
        kinds = [kind for kind in (INHERIT_FROM, COPY) if kind in value]
        if not kinds:
            return None
        if len(kinds) == 2:
            self.fail(f"a block takes {INHERIT_FROM} or {COPY}, not both", path)
        kind = kinds[0]
        source = value[kind]
        if not isinstance(source, str):
            self.fail(f"expected a dotted key path, got {source!r}", (*path, kind))
        own = {key: item for key, item in value.items() if key != kind}
        return kind, self.dotted(source, (*path, kind)), own

    def dotted(self, text: str, path: Path_) -> Path_:
        parts = tuple(text.strip().split("."))
        if any(not part for part in parts):
            self.fail(f"expected a dotted key path, got {text!r}", path)
        return parts

    def lookup(self, source: Path_, kind: str, path: Path_) -> Any:
        """The block at ``source``; ``???`` where it, or a block holding it, is ``???`` (NeMo Gym's)."""
        node: Any = self.frozen
        for part in source:
            if node == MISSING_VALUE:
                return MISSING_VALUE
            if not isinstance(node, dict) or part not in node:
                self.fail(f"{kind} names {'.'.join(source)}, which does not exist", path)
            node = node[part]
        return node

    def _carry_origins(self, source: Path_, target: Path_) -> None:
        """The inherited keys keep the file that set them; the target's own keys keep theirs."""
        for path, origin in list(self.origins.items()):
            if path[: len(source)] == source and path != source:
                self.origins.setdefault((*target, *path[len(source) :]), origin)

    def _follow_moved_agents(self, tree: dict[str, Any]) -> None:
        """An environment server's agent reference to a moved top-level agent names its new place."""
        renames: dict[str, list[str]] = {}
        for source in self.moves:
            block = self.frozen.get(source[0]) if len(source) == 1 else None
            if isinstance(block, dict) and AGENTS_TYPE in block:
                renames[source[0]] = [target[0] for target in self.moves[source] if len(target) == 1]
        for ref_path, ref in _environment_agent_refs(tree):
            targets = renames.get(str(ref.get("name")))
            if targets is None:
                continue
            if len(targets) != 1:
                where = ", ".join(targets) or "a nested key"
                self.fail(f"agent {ref['name']!r} was moved ({INHERIT_FROM}) to {where}: name the one this "
                          "environment server uses", (*ref_path, "name"))
            ref["name"] = targets[0]

    def spend(self, copied: Any, path: Path_) -> None:
        too_much = self.copies.add(copied)
        if too_much:
            self.fail(f"{INHERIT_FROM} and {COPY} copy {too_much} (blocks that copy others, "
                      "over and over): refused", path)

    def fail(self, message: str, path: Path_) -> NoReturn:
        raise ConfigError(message, file=origin_of(self.origins, path), key=".".join(path))


def _environment_agent_refs(tree: Mapping[str, Any]) -> Iterator[tuple[Path_, dict[str, Any]]]:
    for name, block in tree.items():
        implementations = block.get(ENVIRONMENTS_TYPE) if isinstance(block, dict) else None
        if not isinstance(implementations, dict):
            continue
        for implementation, settings in implementations.items():
            for field, ref in (settings or {}).items() if isinstance(settings, dict) else ():
                if isinstance(ref, dict) and (ref.get("type") == AGENTS_TYPE or field == "agent_server"):
                    yield (name, ENVIRONMENTS_TYPE, implementation, field), ref


def _directive_kind(value: Any) -> str | None:
    """``_inherit_from`` or ``_copy`` where ``value`` is one (a block with the key, or its ``${...}`` string)."""
    if isinstance(value, str):
        match = _DIRECTIVE_STRING.fullmatch(value.strip())
        return None if match is None else INHERIT_FROM if match[1] == "inherit_from" else COPY
    if isinstance(value, dict):
        return next((kind for kind in (INHERIT_FROM, COPY) if kind in value), None)
    return None


def _first_directive(value: Any, path: Path_) -> tuple[str, Path_] | None:
    """The kind and the path of the first directive in ``value`` (``value`` itself included), if any."""
    kind = _directive_kind(value)
    if kind is not None:
        return kind, path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _first_directive(item, (*path, str(key)))
        if found is not None:
            return found
    return None


def _delete_path(tree: dict[str, Any], path: Path_) -> None:
    """Remove the key at ``path``, and the mappings that only held it (a moved value leaves nothing)."""
    parents: list[dict[str, Any]] = [tree]
    for part in path[:-1]:
        child = parents[-1].get(part)
        if not isinstance(child, dict):
            return
        parents.append(child)
    parents[-1].pop(path[-1], None)
    for depth in range(len(parents) - 1, 0, -1):
        if parents[depth]:
            break
        parents[depth - 1].pop(path[depth - 1], None)


# ---- interpolation -------------------------------------------------------------------------------


def resolve_interpolations(raw: dict[str, Any], origins: Origins) -> dict[str, Any]:
    resolver = _Resolver(raw, origins)
    return {key: resolver.value(value, (key,)) for key, value in raw.items()}


def interpolation_roots(raw: Mapping[str, Any]) -> set[str]:
    """The top-level keys that some ``${a.b}`` names (its first part)."""
    found: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, Mapping):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)
        elif isinstance(value, str):
            for expr in (match.strip() for match in _INTERPOLATION.findall(value)):
                if expr.startswith("oc.select:"):
                    found.add(expr[len("oc.select:") :].split(",")[0].strip().split(".")[0])
                elif not _RESOLVER.match(expr):
                    found.add(expr.split(".")[0])

    walk(raw)
    return found


class _Resolver:
    def __init__(self, root: dict[str, Any], origins: Origins) -> None:
        self.root = root
        self.origins = origins
        self.active: list[Path_] = []
        self.copies = _Copies()

    def value(self, value: Any, path: Path_) -> Any:
        if self.active:  # a copy of the value, for an interpolation
            self.spend(value, path)
        if isinstance(value, dict):
            return {k: self.value(v, (*path, str(k))) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v, (*path, str(i))) for i, v in enumerate(value)]
        if isinstance(value, str):
            return self.string(value, path)
        return value

    def string(self, text: str, path: Path_) -> Any:
        whole = _INTERPOLATION.fullmatch(text)
        if whole:
            return self.expression(whole[1], path)
        if _INTERPOLATION.search(text) is None:
            return text
        pieces: list[str] = []
        end = 0
        for match in _INTERPOLATION.finditer(text):
            self.add_text(text[end : match.start()], pieces, path)
            value = self.expression(match[1], path)
            if isinstance(value, dict | list):
                self.add_written(value, pieces, path)
            else:
                self.add_text(str(value), pieces, path)
            end = match.end()
        self.add_text(text[end:], pieces, path)
        return "".join(pieces)

    def add_written(self, value: Any, pieces: list[str], path: Path_) -> None:
        """``str(value)`` of a mapping or list inside text, as Python writes it (NeMo Gym's OmegaConf
        writes the same), piece by piece: each piece is counted before it is added, so text past the
        bound is refused before it is built."""
        if isinstance(value, dict):
            self.add_text("{", pieces, path)
            for index, (key, item) in enumerate(value.items()):
                if index:
                    self.add_text(", ", pieces, path)
                self.add_written(key, pieces, path)
                self.add_text(": ", pieces, path)
                self.add_written(item, pieces, path)
            self.add_text("}", pieces, path)
        elif isinstance(value, list):
            self.add_text("[", pieces, path)
            for index, item in enumerate(value):
                if index:
                    self.add_text(", ", pieces, path)
                self.add_written(item, pieces, path)
            self.add_text("]", pieces, path)
        else:
            if isinstance(value, str):  # its repr is at least as long, plus the quotes: counted before it is made
                self.count_text(len(value) + 2, path)
                written = repr(value)
                self.count_text(len(written) - len(value) - 2, path)
            else:
                written = repr(value)
                self.count_text(len(written), path)
            pieces.append(written)

    def add_text(self, piece: str, pieces: list[str], path: Path_) -> None:
        self.count_text(len(piece), path)
        pieces.append(piece)

    def count_text(self, chars: int, path: Path_) -> None:
        too_much = self.copies.built(chars)
        if too_much:
            self.fail(f"interpolation builds {too_much} (text that names others, over and over): refused", path)

    def expression(self, expr: str, path: Path_) -> Any:
        expr = expr.strip()
        if expr.startswith("oc.env:"):
            name, comma, default = expr[len("oc.env:") :].partition(",")
            value = os.environ.get(name.strip())
            if value is None and not comma:
                self.fail(f"environment variable {name.strip()} is not set", path)
            return value if value is not None else self.default(default, path)
        if expr.startswith("oc.select:"):
            key, comma, default = expr[len("oc.select:") :].partition(",")
            found = self.lookup(tuple(key.strip().split(".")), path, missing_ok=True)
            if found is not None:
                return found
            return self.default(default, path) if comma else None
        resolver = _RESOLVER.match(expr)
        if resolver:
            self.fail(f"unknown resolver {resolver[1]!r} in ${{{expr}}} (known: oc.env, oc.select; inherit_from "
                      "and copy take a whole value)", path)
        return self.lookup(tuple(expr.split(".")), path)

    def lookup(self, target: Path_, path: Path_, *, missing_ok: bool = False) -> Any:
        """The resolved value at ``target`` (None for a missing key when ``missing_ok``)."""
        expr = ".".join(target)
        if target in self.active:
            self.fail(f"interpolation cycle through ${{{expr}}}", path)
        node: Any = self.root
        for part in target:
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
                continue
            if not isinstance(node, dict) or part not in node:
                if missing_ok:
                    return None
                self.fail(f"${{{expr}}} refers to a key that does not exist", path)
            node = node[part]
        self.active.append(target)
        try:
            return self.value(node, target)
        finally:
            self.active.pop()

    def default(self, text: str, path: Path_) -> Any:
        try:
            return _yaml_scalar(text.strip())
        except YamlRefused as error:
            self.fail(f"the default value: {error}", path)

    def spend(self, copied: Any, path: Path_) -> None:
        too_much = self.copies.add(copied)
        if too_much:
            self.fail(f"interpolation copies {too_much} (values that name others, over and over): "
                      "refused", path)

    def fail(self, message: str, path: Path_) -> NoReturn:
        raise ConfigError(message, file=origin_of(self.origins, path), key=".".join(path))


class _Copies:
    """The values copied so far (by directives, or by interpolation), one at a time, and the characters
    of the strings that interpolation inside text built. A whole string copied is not counted as text:
    the copy is the same string object, it costs no memory."""

    def __init__(self) -> None:
        self.values = 0
        self.chars = 0

    def add(self, copied: Any) -> str | None:
        """Count one value copied (a container counts one: its items are counted as they are copied);
        what is too much, once the total is past a bound."""
        self.values += 1
        if self.values > MAX_EXPANDED_VALUES:
            return f"more than {MAX_EXPANDED_VALUES:,} values in all"
        return None

    def built(self, chars: int) -> str | None:
        """Count characters of a string that interpolation inside text builds; what is too much, past the
        bound (counted before they are added to the string)."""
        self.chars += chars
        if self.chars > MAX_EXPANDED_CHARS:
            return f"more than {MAX_EXPANDED_CHARS >> 20} MiB of text in all"
        return None


def origin_of(origins: Mapping[Path_, str], path: Sequence[str]) -> str | None:
    """The file that set ``path`` (or its nearest ancestor)."""
    key = tuple(path)
    while key:
        if key in origins:
            return origins[key]
        key = key[:-1]
    return None


def deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [deep_copy(v) for v in value]
    return value
