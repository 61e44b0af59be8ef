"""The YAML of config files (and ``${oc.select:...}`` defaults), read within bounds.

Command-line override values are not YAML: ``config_overrides`` reads them by Hydra's grammar, as
NeMo Gym does, within the same bounds.

Plain scalars resolve as NeMo Gym's loader (OmegaConf 2.3) resolves them, not as PyYAML's YAML 1.1
defaults, so a NeMo Gym config means the same here:

- a date or time (``2001-01-01``, ``2001-12-14 21:59:43.10 -5``) stays the string written, exactly
  (YAML 1.1 would build a ``datetime.date``; OmegaConf drops that rule), and one that is no real
  date (``2001-02-30``) is a string too;
- an exponent without a dot or without a sign is a float too (``1e3``, ``1.0e3``, ``-1E-3``,
  ``1_0e3``: YAML 1.1 reads those as strings);
- everything else as YAML 1.1 (and OmegaConf): ``yes``/``no``/``on``/``off`` are bools (``y`` and
  ``n`` are strings), ``0x1F``, ``017`` (octal), ``0b101``, ``1_000`` and base-60 ``1:30`` are ints
  (``0o17`` is a string), ``.5``, ``.inf``, ``.nan`` are floats (``inf``, ``nan`` are strings),
  ``~``, ``null`` and an empty value are ``None``;
- values OmegaConf cannot hold are refused: an explicit ``!!timestamp`` or ``!!set``, and a key
  that is null (``~: x``).

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
- an int or float scalar longer than ``MAX_NUMBER_CHARS`` characters (YAML 1.1's base-60
  integers, ``1:1:1:...``, take quadratic time to build, and Python's ``int()`` refuses more than
  4,300 digits), and one that PyYAML cannot build (``!!float abc``, ``!!int 1e3``): PyYAML raises a
  ``ValueError`` there, which would end the command in a traceback;
- a key written twice in one mapping, keys compared as the strings the config uses (``str()``:
  ``1`` and ``'1'`` are the same key). NeMo Gym's loader (OmegaConf) refuses a duplicate key too;
  PyYAML's safe loader lets the later one win silently. A key that a merge (``<<: *name``) brings is
  not a duplicate: the mapping's own key overrides it, as YAML says.

``read_yaml_file`` refuses a file of more than ``MAX_FILE_BYTES`` before parsing it, and a file
that is not UTF-8. Syntax errors stay PyYAML's ``yaml.YAMLError``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "MAX_DEPTH", "MAX_FILE_BYTES", "MAX_NODES", "MAX_NUMBER_CHARS", "YamlRefused", "dump_yaml", "load_yaml",
    "read_yaml_file",
]

MAX_FILE_BYTES = 4 << 20
"""Parsing is pure Python: a 4 MiB string takes seconds, 1 MiB of small values hundreds of MiB."""
MAX_NODES = 100_000
MAX_DEPTH = 64
MAX_NUMBER_CHARS = 128
"""The longest int or float scalar (a port or a count is a few characters)."""
_FLOAT_TAG = "tag:yaml.org,2002:float"
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
_NUMBER_TAGS = frozenset({"tag:yaml.org,2002:int", _FLOAT_TAG})
_NOT_CONFIG_VALUES = frozenset({_TIMESTAMP_TAG, "tag:yaml.org,2002:set"})
"""Explicit tags whose values (``datetime``, ``set``) OmegaConf refuses to hold: refused here too, unbuilt."""
_MERGE_TAG = "tag:yaml.org,2002:merge"
_VALUE_TAG = "tag:yaml.org,2002:value"
_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9]+(?:_[0-9]+)*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
"""The floats OmegaConf reads that YAML 1.1 does not: an exponent after digits with no dot, or with no
sign (``1e3``, ``1.0e3``); an underscore only between two digits before it (``1_0e3``, not ``1_e3``).
Every other float form is YAML 1.1's, which OmegaConf keeps."""


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
        if node.tag in _NOT_CONFIG_VALUES:
            instead = "a date written without the tag is a string" if node.tag == _TIMESTAMP_TAG else "use a list"
            raise YamlRefused(f"a !!{_kind(node)} (line {node.start_mark.line + 1}) is not a config value: NeMo Gym's "
                              f"loader (OmegaConf) refuses it too ({instead})")
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
            if key is None:
                raise YamlRefused(f"a null key {key_node.value!r:.80} (line {line}): NeMo Gym's loader (OmegaConf) "
                                  "refuses it too (quote it if it is the name)")
            if name in first_line:
                raise YamlRefused(f"duplicate key {name!r:.80} (line {line}; first on line {first_line[name]}): "
                                  "each key of a mapping is written once (keys compared as strings)")
            first_line[name] = line


_BoundedLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != _TIMESTAMP_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}  # no date or time is resolved implicitly: it stays the text written, as in OmegaConf
_BoundedLoader.add_implicit_resolver(_FLOAT_TAG, _EXPONENT_FLOAT, list("+-0123456789"))  # after YAML 1.1's int


def _kind(node: yaml.Node) -> str:
    return str(node.tag).rsplit(":", 1)[-1]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


class _ConfigDumper(yaml.SafeDumper):
    """PyYAML's safe dumper, quoting also the strings that read back as floats here and in OmegaConf only
    (``'7e1'``: YAML 1.1 has no such float, so the safe dumper writes it bare)."""


_ConfigDumper.add_implicit_resolver(_FLOAT_TAG, _EXPONENT_FLOAT, list("+-0123456789"))


def dump_yaml(value: Any, **options: Any) -> str:
    """``value`` as YAML text that ``load_yaml`` and NeMo Gym's OmegaConf read back as ``value`` (the
    config the head serves, the one NeMo Gym's servers read); ``options`` as ``yaml.dump``'s."""
    return yaml.dump(value, Dumper=_ConfigDumper, sort_keys=False, **options)


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
