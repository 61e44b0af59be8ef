"""The YAML of config files and overrides, read within bounds.

PyYAML's safe loader builds an aliased node (``*name``) once and shares it, but everything after
loading (merging files, directives, interpolation, the JSON each server is handed) copies it once
per use: a few hundred bytes of nested aliases (a "billion laughs") would become billions of
values, minutes of work and gigabytes. ``load_yaml`` refuses with ``YamlRefused``:

- a document that builds more than ``MAX_NODES`` values, an alias counting as every value it
  repeats (a block named by an anchor and reused a few times, as configs do, stays far below: the
  quickstart config is about 100 values);
- a value nested deeper than ``MAX_DEPTH`` (PyYAML builds nested values by recursion: a deeper
  file would end in a ``RecursionError``);
- an alias inside the node its anchor names (a cycle, which no copy could finish);
- an int, float or timestamp scalar longer than ``MAX_NUMBER_CHARS`` characters (YAML 1.1's base-60
  integers, ``1:1:1:...``, take quadratic time to build, and Python's ``int()`` refuses more than
  4,300 digits), and one that PyYAML cannot build (``2001-02-30``, ``!!float abc``): PyYAML raises a
  ``ValueError`` there, which would end the command in a traceback;
- a key written twice in one mapping, keys compared as the strings the config uses (``str()``:
  ``1`` and ``'1'`` are the same key). NeMo Gym's loader (OmegaConf) refuses a duplicate key too;
  PyYAML's safe loader lets the later one win silently. A key that a merge (``<<: *name``) brings is
  not a duplicate: the mapping's own key overrides it, as YAML says.

``read_yaml_file`` refuses a file of more than ``MAX_FILE_BYTES`` before parsing it, and a file
that is not UTF-8. Syntax errors stay PyYAML's ``yaml.YAMLError``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "MAX_DEPTH", "MAX_FILE_BYTES", "MAX_NODES", "MAX_NUMBER_CHARS", "YamlRefused", "load_yaml", "read_yaml_file",
]

MAX_FILE_BYTES = 4 << 20
"""Parsing is pure Python: a 4 MiB string takes seconds, 1 MiB of small values hundreds of MiB."""
MAX_NODES = 100_000
MAX_DEPTH = 64
MAX_NUMBER_CHARS = 128
"""The longest int, float or timestamp scalar (a port, a count or a date is a few characters)."""
_NUMBER_TAGS = frozenset(f"tag:yaml.org,2002:{kind}" for kind in ("int", "float", "timestamp"))
_MERGE_TAG = "tag:yaml.org,2002:merge"
_VALUE_TAG = "tag:yaml.org,2002:value"


class YamlRefused(Exception):
    """YAML that would cost too much to build, or a file that is not UTF-8 text (the message says which)."""


class _BoundedLoader(yaml.SafeLoader):
    """The safe loader, counting the values it composes (an alias as all those it repeats) and the depth."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.built = 0
        self.open_anchors: list[str | None] = []
        self.sizes: dict[int, int] = {}
        self.keys_checked: set[yaml.Node] = set()

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            target = self.anchors.get(event.anchor)
            if target is not None:
                if event.anchor in self.open_anchors:
                    raise YamlRefused(f"alias *{event.anchor} is inside the node &{event.anchor} names (a cycle)")
                self.spend(self.size_of(target))
            return super().compose_node(parent, index)
        if len(self.open_anchors) >= MAX_DEPTH:
            raise YamlRefused(f"nested more than {MAX_DEPTH} levels deep (line {event.start_mark.line + 1})")
        self.spend(1)
        self.open_anchors.append(event.anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self.open_anchors.pop()

    def spend(self, values: int) -> None:
        self.built += values
        if self.built > MAX_NODES:
            raise YamlRefused(f"builds more than {MAX_NODES:,} values (an alias counts as every value it "
                              "repeats): refused before expanding it")

    def size_of(self, node: yaml.Node) -> int:
        """The values ``node`` stands for, its aliases expanded (each node's count is kept)."""
        known = self.sizes.get(id(node))
        if known is None:
            known = 1 + sum(self.size_of(child) for child in _children(node))
            self.sizes[id(node)] = known
        return known

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        if isinstance(node, yaml.ScalarNode) and node.tag in _NUMBER_TAGS and len(node.value) > MAX_NUMBER_CHARS:
            line = node.start_mark.line + 1
            raise YamlRefused(f"{_kind(node)} scalar of {len(node.value):,} characters (line {line}): more than "
                              f"{MAX_NUMBER_CHARS}, the bound on a number or date (quote it if it is text)")
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as error:  # PyYAML's int(), float(), date() of a malformed value
            raise YamlRefused(f"{node.value if isinstance(node.value, str) else '?'!r:.60} is not a valid "
                              f"{_kind(node)} (line {node.start_mark.line + 1}): {error}") from None

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        """Before a mapping's merges (``<<``) are put into it, or it into another: its own keys, once each."""
        if node not in self.keys_checked:
            self.keys_checked.add(node)
            self.refuse_duplicate_keys(node)
        super().flatten_mapping(node)

    def refuse_duplicate_keys(self, node: yaml.MappingNode) -> None:
        first_line: dict[str, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                continue  # a merge, or a list or mapping as a key (PyYAML refuses those: unhashable)
            key = key_node.value if key_node.tag == _VALUE_TAG else self.construct_object(key_node, deep=True)
            name, line = str(key), key_node.start_mark.line + 1
            if name in first_line:
                raise YamlRefused(f"duplicate key {name!r:.80} (line {line}; first on line {first_line[name]}): "
                                  "each key of a mapping is written once (keys compared as strings)")
            first_line[name] = line


def _kind(node: yaml.Node) -> str:
    return str(node.tag).rsplit(":", 1)[-1]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def load_yaml(text: str) -> Any:
    """The value of one YAML document: ``YamlRefused`` past the bounds, ``yaml.YAMLError`` if not YAML."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml_file(path: Path) -> Any:
    """``load_yaml`` of a file of at most ``MAX_FILE_BYTES`` of UTF-8 (``OSError`` if it cannot be read)."""
    with path.open("rb") as file:
        data = file.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise YamlRefused(f"larger than {MAX_FILE_BYTES >> 20} MiB, the bound on a config file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise YamlRefused(f"not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start})") from None
    return load_yaml(text)
