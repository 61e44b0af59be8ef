"""Config files and what NeMo Gym 0.7.0 makes of them, for the unit and interop tiers.

``MERGES`` is ``(id, yaml, tree)``: a file using ``_inherit_from`` / ``_copy`` and the tree NeMo Gym's
directive pass (``GlobalConfigDictParser._recursively_swap_keys``, which ``parse`` runs on the merged
files) leaves of it, read from NeMo Gym 0.7.0 (omegaconf 2.3.1). ``REFUSED_MERGES`` is ``(id, yaml,
key, start of our message)``: files this project refuses, where NeMo Gym either refuses them too (a
mapping merged over a list) or leaves a directive unexpanded in the tree (a chain, a directive that is
a list's item), so that the block is not what the file says; the interop tier checks which.

``MALFORMED`` is ``(yaml, key)``: files holding a string that NeMo Gym's loader (``OmegaConf.load``)
refuses, a malformed ``${...}``; ``WELL_FORMED`` files it loads, each string as written.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MALFORMED", "MERGES", "REFUSED_MERGES", "WELL_FORMED"]

MERGES: list[tuple[str, str, dict[str, Any]]] = [
    ("nested mappings merge deep",
     "base: {r: {f: {a: 1, b: 2}, g: 3}}\nchild: {_inherit_from: base, r: {f: {a: 9}}}\n",
     {"child": {"r": {"f": {"a": 9, "b": 2}, "g": 3}}}),
    ("a list replaces a list",
     "base: {l: [1, 2, 3], m: [{a: 1}]}\nchild: {_inherit_from: base, l: [4], m: [{b: 2}]}\n",
     {"child": {"l": [4], "m": [{"b": 2}]}}),
    ("??? in the child keeps the source's value",
     "base: {x: 1, y: {a: 1}, z: [1]}\nchild:\n  _inherit_from: base\n  x: ???\n  y: ???\n  z: ???\n  w: ???\n",
     {"child": {"x": 1, "y": {"a": 1}, "z": [1], "w": "???"}}),
    ("??? in the child keeps the source's value, nested; a list's ??? replaces",
     "base: {y: {a: 1, b: 2}, l: [{a: 1}]}\nchild:\n  _inherit_from: base\n  y:\n    a: ???\n    c: ???\n"
     "  l: ['???']\n",
     {"child": {"y": {"a": 1, "b": 2, "c": "???"}, "l": ["???"]}}),
    ("??? in a _copy keeps the source's value", "base: {x: 1}\nchild:\n  _copy: base\n  x: ???\n",
     {"base": {"x": 1}, "child": {"x": 1}}),
    ("??? in the source stays unless the child sets it",
     "base:\n  x: ???\n  y: ???\n  k: 1\nchild: {_inherit_from: base, x: 2}\n",
     {"child": {"x": 2, "y": "???", "k": 1}}),
    ("a source that is ??? makes the block ???",
     "base: ???\nchild: {_inherit_from: base, x: 2}\nchild2: {_copy: base}\n",
     {"child": "???", "child2": "???"}),
    ("a source under a ??? makes the block ???",
     "lib: ???\nchild: {_inherit_from: lib.base, x: 2}\nchild2: ${copy:lib.base}\n",
     {"lib": "???", "child": "???", "child2": "???"}),
    ("null in the child replaces", "base: {x: {a: 1}, y: 1, z: [1]}\nchild: {_inherit_from: base, x: null, y: null, "
     "z: null}\n", {"child": {"x": None, "y": None, "z": None}}),
    ("the child replaces the source's null", "base: {x: null, y: null}\nchild: {_inherit_from: base, x: {a: 1}, "
     "y: [1]}\n", {"child": {"x": {"a": 1}, "y": [1]}}),
    ("a scalar and a mapping replace each other", "base: {x: {a: 1}, y: 5}\nchild: {_inherit_from: base, x: 5, "
     "y: {a: 1}}\n", {"child": {"x": 5, "y": {"a": 1}}}),
    ("the source's keys first, then the child's, the block where it was",
     "first: 0\nbase: {a: 1, b: 2, c: 3}\nmid: 0\nchild: {d: 4, _inherit_from: base, b: 5, e: 6}\nlast: 0\n",
     {"first": 0, "mid": 0, "child": {"a": 1, "b": 5, "c": 3, "d": 4, "e": 6}, "last": 0}),
    ("a nested block inherits a nested source", "lib: {base: {a: 1}, other: 2}\nouter: {inner: {_inherit_from: "
     "lib.base, b: 2}}\n", {"lib": {"other": 2}, "outer": {"inner": {"a": 1, "b": 2}}}),
    ("the child's own keys may copy", "o: {q: 1}\nbase: {a: 1, r: {s: 1}}\nchild: {_inherit_from: base, "
     "r: {_copy: o}}\n", {"o": {"q": 1}, "child": {"a": 1, "r": {"s": 1, "q": 1}}}),
    ("two blocks inherit one source", "a: {x: 1}\nb: {_inherit_from: a, y: 2}\nc: {_inherit_from: a, z: 3}\n",
     {"b": {"x": 1, "y": 2}, "c": {"x": 1, "z": 3}}),
]

CHAIN = "is itself a"
REFUSED_MERGES: list[tuple[str, str, str, str]] = [
    ("a mapping over a list", "base: {x: [1]}\nchild: {_inherit_from: base, x: {a: 1}}\n", "child.x",
     "a mapping cannot be merged over the list that _inherit_from base gives it"),
    ("a list over a mapping", "base: {x: {a: 1}}\nchild: {_copy: base, x: [1]}\n", "child.x",
     "a list cannot be merged over the mapping that _copy base gives it"),
    ("a mapping over a list, nested", "base: {x: {a: [1]}}\nchild: {_inherit_from: base, x: {a: {b: 1}}}\n",
     "child.x.a", "a mapping cannot be merged over the list"),
    ("a chain", "a: {x: 1}\nb: {_inherit_from: a, y: 2}\nc: {_inherit_from: b, z: 3}\n", "c", CHAIN),
    ("a chain, written backwards", "c: {_inherit_from: b, z: 3}\nb: {_inherit_from: a, y: 2}\na: {x: 1}\n", "c",
     CHAIN),
    ("a chain of copies", "a: {x: 1}\nb: {_copy: a, y: 2}\nc: {_copy: b, z: 3}\n", "c", CHAIN),
    ("a chain of strings", "a: {x: 1}\nb: ${inherit_from:a}\nc: ${inherit_from:b}\n", "c", CHAIN),
    ("a directive inside the source", "o: {q: 1}\nbase: {r: {_copy: o, s: 2}, t: 3}\nchild: {_inherit_from: base, "
     "t: 4}\n", "child", CHAIN),
    ("a directive as a list's item", "a: {x: 1}\nl: [{_copy: a, y: 2}, 3]\n", "l.0", "_copy as a list's item"),
]

MALFORMED: list[tuple[str, str]] = [
    ('x: "a ${b"\n', "x"), ("x: ${}\n", "x"), ("x: ${a.}\n", "x"), ('x: ["ok", "${"]\n', "x.1"),
    ('a: {b: {c: "${a b}"}}\n', "a.b.c"), ('x: "${oc.env:"\n', "x"), ('x: "${foo:bar"\n', "x"),
    ('x: "${a}${"\n', "x"), ('x: "${ }"\n', "x"), ('x: "${\\\\}"\n', "x"),
]
WELL_FORMED: list[str] = [
    'x: "$"\n', "x: $x\n", 'x: "{}"\n', 'x: "a $ b"\n', 'x: "${a.b} and ${c}"\n', 'x: "\\\\${x"\n', '"${": 1\n',
    'x: "${foo:bar}"\n', 'x: "${..a}"\n', 'x: "$${a}"\n', 'x: "${a}}"\n', 'x: "${ a }"\n', 'x: "${a[0]}"\n',
    'x: "${f:{a: 1}}"\n', 'x: "${a:}"\n', 'x: "${${a}}"\n', 'x: "$ {a"\n', "x: ???\n",
]
