"""Command-line override values, read as NeMo Gym reads them: by Hydra's override grammar.

NeMo Gym 0.7.0 hands its command line to Hydra (hydra-core 1.3.8), whose override grammar is not
YAML. ``parse_override_value`` reads the text after ``key=`` by that grammar's rules, written out
here (Hydra is not a dependency):

- A value is one element: a primitive, a list ``[a, b]``, a mapping ``{a: 1, b: [x]}`` or a cast
  ``int(...)``, ``float(...)``, ``str(...)``, ``bool(...)``. Spaces around ``[ ] { } , :`` and
  after ``=`` are dropped, and at the end of a value.
- A primitive that is one token is typed: an int is ``[+-]`` then ``0`` or digits not starting
  with 0, ``_`` only between digits (``1``, ``-1``, ``+1``, ``1_000``); a float has a dot or an
  exponent (``1.5``, ``.5``, ``5.``, ``1e3``, ``-1.5e-3``), or is ``inf`` / ``nan`` in any case,
  signed or not; ``true`` / ``false`` in any case are bools; ``null`` in any case is ``None``.
  Everything else is a string, and so is a primitive of several tokens, as written: ``0x1F``,
  ``017``, ``00``, ``1:30``, ``.inf``, ``.nan``, ``yes``, ``no``, ``on``, ``off``, ``None``,
  ``1_``, ``a b``, ``http://h:8000``. An empty value (``key=``) is the empty string.
- Quoted text (``'a b'``, ``"1"``) is a string; inside, a backslash escapes only the quote and
  backslashes before a quote or at the end. A quoted text is a whole primitive (``'a'b`` is refused).
- Unquoted, a backslash escapes ``\\ ( ) [ ] { } : = ,``, a space and a tab (``a\\,b`` is ``a,b``);
  any other backslash stays. ``${...}`` is kept as written (interpolated later); a string holding
  ``${`` must read by OmegaConf 2.3's interpolation grammar (``config_interpolations``), as NeMo
  Gym's OmegaConf refuses it otherwise (``${a``, ``${}``, ``${a.}``, ``${a b}``).
- Mapping keys are primitives without quotes or ``${}`` (``{1: a}`` has the int key 1); a null
  key is refused, as OmegaConf refuses it; of a key written twice the later wins.
- Refused, as Hydra refuses them: a comma outside brackets (``a,b``: a sweep, which needs
  ``--multirun``; write ``[a,b]`` or quote it), a sweep function (``choice``, ``range``,
  ``interval``, ``glob``, ``tag``), characters the grammar has no token for unquoted (``~ # & ! ' "
  = < > ; ^``, a newline, anything not ASCII), brackets left open or closed twice.
- ``sort(list, reverse=false)`` orders a list as Hydra does (``list=`` wins over a list given
  first; any other value is kept); items Python cannot order together are refused, and so is
  quoted text inside the list (Hydra keeps it apart until the value is built, and cannot order
  it). ``shuffle()`` is refused: Hydra gives a new random order on every run.

Bounds, as for YAML (``config_yaml``): at most ``MAX_NODES`` values (keys included), nested at most
``MAX_DEPTH`` deep, an int or float of at most ``MAX_NUMBER_CHARS`` characters (a cast's text
too). Reading is one pass over the text. Every refusal is an ``OverrideRefused`` naming the
column.

``quote_override_value`` writes a string as a quoted override value that reads back as itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NoReturn

from nemo_gym_ckpt.config_interpolations import interpolation_problem
from nemo_gym_ckpt.config_tokens import TOKENS
from nemo_gym_ckpt.config_yaml import MAX_DEPTH, MAX_NODES, MAX_NUMBER_CHARS

__all__ = ["OverrideRefused", "parse_override_value", "quote_override_value"]


class OverrideRefused(ValueError):
    """An override value Hydra's grammar does not read (or one past the bounds): the message says why."""


_QUOTES = "'\""
_WS_FIRST = " \t"
_FIRST_CHARS = {
    "POPEN": _WS_FIRST + "(", "COMMA": _WS_FIRST + ",", "PCLOSE": _WS_FIRST + ")", "BRACKET_OPEN": "[",
    "BRACKET_CLOSE": _WS_FIRST + "]", "BRACE_OPEN": "{", "BRACE_CLOSE": _WS_FIRST + "}", "COLON": _WS_FIRST + ":",
    "EQUAL": _WS_FIRST + "=", "FLOAT": "+-.0123456789IiNn", "INT": "+-0123456789", "BOOL": "TtFf", "NULL": "Nn",
    "UNQUOTED_CHAR": "/-\\+.$%*@?|", "ID": "_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "ESC": "\\",
    "WS": _WS_FIRST,
}
_BY_FIRST_CHAR: dict[str, list[tuple[str, list[re.Pattern[str]]]]] = {
    char: [(name, patterns) for name, patterns in TOKENS if char in _FIRST_CHARS[name]]
    for char in "".join(_FIRST_CHARS.values())
}
"""The tokens that can start with each character, in the lexer's order (the others cannot match there)."""
_PRIMITIVE_TOKENS = frozenset({"ID", "NULL", "INT", "FLOAT", "BOOL", "INTERPOLATION", "UNQUOTED_CHAR", "COLON",
                               "ESC", "WS"})
_KEY_TOKENS = frozenset({"ID", "NULL", "INT", "FLOAT", "BOOL", "UNQUOTED_CHAR", "ESC", "WS"})
_CASTS = ("int", "float", "str", "bool")
_SWEEPS = ("choice", "range", "interval", "glob", "tag")
_SORT_ARGUMENTS = ("list", "reverse", "sweep")


class _Quoted(str):
    """Quoted text inside a list or mapping. Hydra keeps it apart from plain text until the value is
    built, and cannot order it, so ``sort()`` refuses a list that must compare it with anything."""

    __slots__ = ()

    def _unordered(self, other: object) -> bool:
        raise TypeError("quoted text")

    __lt__ = __gt__ = __le__ = __ge__ = _unordered


def _plain(value: Any) -> Any:
    """``value`` with quoted text as plain strings."""
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return str(value) if isinstance(value, _Quoted) else value


@dataclass(frozen=True)
class _Token:
    kind: str
    text: str
    column: int


def _quoted_end(text: str, start: int) -> int:
    """The index after the quote that closes the one at ``start`` (the first not after an odd run of
    backslashes), or -1 if none does."""
    quote = text[start]
    index = text.find(quote, start + 1)
    while index != -1:
        slashes = 0
        while index - 1 - slashes > start and text[index - 1 - slashes] == "\\":
            slashes += 1
        if slashes % 2 == 0:
            return index + 1
        index = text.find(quote, index + 1)
    return -1


def _tokens(text: str, position: int) -> list[_Token]:
    """Hydra's value-mode tokens of ``text`` from ``position``, in one pass (``${`` finds its ``}`` at once)."""
    tokens: list[_Token] = []
    closes = [-1] * (len(text) + 1)  # closes[i]: the first "}" at or after i
    for index in range(len(text) - 1, -1, -1):
        closes[index] = index if text[index] == "}" else closes[index + 1]
    while position < len(text):
        char = text[position]
        if char in _QUOTES:
            end = _quoted_end(text, position)
            if end == -1:
                raise OverrideRefused(f"the quote at column {position + 1} is not closed (a quote inside a value "
                                      "is written inside the other quotes, or escaped with a backslash)")
            tokens.append(_Token("QUOTED_VALUE", text[position:end], position))
            position = end
            continue
        kind, length = "", 0
        if text.startswith("${", position) and closes[position + 2] > position + 2:
            kind, length = "INTERPOLATION", closes[position + 2] + 1 - position
        for name, patterns in _BY_FIRST_CHAR.get(char, ()):
            for pattern in patterns:
                match = pattern.match(text, position)
                if match is not None and match.end() - position > length:
                    kind, length = name, match.end() - position
        if not kind:
            if char == "~":
                raise OverrideRefused(f"'~' (column {position + 1}) cannot be written unquoted: NeMo Gym's Hydra "
                                      "refuses it too (null is written null)")
            raise OverrideRefused(f"{char!r} (column {position + 1}) cannot be written unquoted: quote the value "
                                  "('...' or \"...\")")
        tokens.append(_Token(kind, text[position:position + length], position))
        position += length
    return tokens


def _unquote(text: str) -> str:
    """The text inside quotes: a run of backslashes before a quote (or the end) is halved, the quote kept."""
    quote, inner = text[0], text[1:-1]
    return re.sub(r"(\\+)(" + re.escape(quote) + r"|\Z)", lambda m: "\\" * (len(m[1]) // 2) + m[2], inner)


def _number(token: _Token) -> int | float:
    if len(token.text) > MAX_NUMBER_CHARS:
        raise OverrideRefused(f"{token.kind.lower()} of {len(token.text):,} characters (column {token.column + 1}): "
                              f"more than {MAX_NUMBER_CHARS}, the bound on a number (quote it if it is text)")
    return int(token.text) if token.kind == "INT" else float(token.text)


def _typed(token: _Token) -> Any:
    if token.kind in ("INT", "FLOAT"):
        return _number(token)
    if token.kind == "BOOL":
        return token.text.lower() == "true"
    if token.kind == "NULL":
        return None
    if token.kind == "ESC":
        return token.text[1::2]
    if token.kind == "QUOTED_VALUE":
        return _unquote(token.text)
    return token.text


class _Reader:
    """Hydra's override grammar over the tokens, building the value within the bounds."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokens(text, len(text) - len(text.lstrip(" \t")))  # the spaces after "=" belong to it
        self.at = 0
        self.built = 0
        self.quoted = False

    def peek(self, ahead: int = 0) -> _Token | None:
        index = self.at + ahead
        return self.tokens[index] if index < len(self.tokens) else None

    def kind(self, ahead: int = 0) -> str:
        token = self.peek(ahead)
        return token.kind if token is not None else "END"

    def take(self, kind: str, wanted: str) -> _Token:
        token = self.peek()
        if token is None or token.kind != kind:
            self.unexpected(wanted)
        self.at += 1
        return token

    def unexpected(self, wanted: str) -> NoReturn:
        token = self.peek()
        if token is None:
            raise OverrideRefused(f"the value ends where {wanted} was expected (a bracket left open?)")
        raise OverrideRefused(f"{token.text.strip() or token.text!r:.40} at column {token.column + 1} where {wanted} "
                              "was expected (quote the value if it is text)")

    def spend(self, depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise OverrideRefused(f"nested more than {MAX_DEPTH} levels deep")
        self.built += 1
        if self.built > MAX_NODES:
            raise OverrideRefused(f"builds more than {MAX_NODES:,} values")

    def value(self) -> Any:
        if not self.tokens:
            return ""
        value = self.element(0)
        token = self.peek()
        if token is not None and token.kind == "COMMA":
            raise OverrideRefused(f"a comma outside brackets (column {token.column + 1}) makes a sweep "
                                  "in NeMo Gym's Hydra, which needs --multirun: write a list [a,b], or quote the "
                                  "text 'a,b'")
        if self.kind() != "END":
            self.unexpected("the end of the value")
        if "$" in self.text:
            _check_interpolations(value)
        return _plain(value) if self.quoted else value

    def element(self, depth: int) -> Any:
        self.spend(depth)
        kind = self.kind()
        if kind == "ID" and self.kind(1) == "POPEN":
            return self.function(depth)
        if kind == "BRACKET_OPEN":
            self.at += 1
            items = []
            if self.kind() != "BRACKET_CLOSE":
                items.append(self.element(depth + 1))
                while self.kind() == "COMMA":
                    self.at += 1
                    items.append(self.element(depth + 1))
            self.take("BRACKET_CLOSE", "',' or ']'")
            return items
        if kind == "BRACE_OPEN":
            self.at += 1
            mapping: dict[Any, Any] = {}
            if self.kind() != "BRACE_CLOSE":
                self.pair(mapping, depth + 1)
                while self.kind() == "COMMA":
                    self.at += 1
                    self.pair(mapping, depth + 1)
            self.take("BRACE_CLOSE", "',' or '}'")
            return mapping
        if kind == "QUOTED_VALUE":
            self.quoted = True
            return _Quoted(_typed(self.take(kind, "a value")))
        return self.primitive(_PRIMITIVE_TOKENS, "a value")

    def primitive(self, allowed: frozenset[str], wanted: str) -> Any:
        start = self.at
        while self.kind() in allowed:
            self.at += 1
        parts = self.tokens[start:self.at]
        while parts and parts[0].kind == "WS":
            parts = parts[1:]
        while parts and parts[-1].kind == "WS":
            parts = parts[:-1]
        if not parts:
            self.at = start
            self.unexpected(wanted)
        if len(parts) == 1:
            return _typed(parts[0])
        return "".join(part.text[1::2] if part.kind == "ESC" else part.text for part in parts)

    def pair(self, mapping: dict[Any, Any], depth: int) -> None:
        self.spend(depth)
        token = self.peek()
        key = self.primitive(_KEY_TOKENS, "a key")
        if key is None and token is not None:
            raise OverrideRefused(f"a null key (column {token.column + 1}): NeMo Gym (OmegaConf) refuses it too")
        self.take("COLON", "':'")
        mapping[key] = self.element(depth)

    def function(self, depth: int) -> Any:
        name_token = self.take("ID", "a function")
        name = name_token.text
        self.take("POPEN", "'('")
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        if self.kind() != "PCLOSE":
            while True:
                if self.kind() == "ID" and self.kind(1) == "EQUAL":
                    keyword = self.take("ID", "a name").text
                    self.at += 1
                    kwargs[keyword] = _unquoted(self.element(depth + 1))
                elif kwargs:
                    raise OverrideRefused(f"{name}(): a positional argument after a named one")
                else:
                    args.append(_unquoted(self.element(depth + 1)))
                if self.kind() != "COMMA":
                    break
                self.at += 1
        self.take("PCLOSE", "',' or ')'")
        return _call(name, args, kwargs, name_token.column)


def _check_interpolations(value: Any) -> None:
    """Refuse a string of the value that NeMo Gym's OmegaConf refuses (a malformed ``${...}``)."""
    if isinstance(value, list | dict):
        for item in value.values() if isinstance(value, dict) else value:
            _check_interpolations(item)
    elif isinstance(value, str):
        problem = interpolation_problem(value)
        if problem is not None:
            raise OverrideRefused(f"{value!r:.80} is not an interpolation NeMo Gym's OmegaConf reads: {problem} "
                                  "(a literal ${ is written \\${, inside quotes)")


def _unquoted(value: Any) -> Any:
    """A function's argument: Hydra unquotes quoted text given whole (not inside a list or mapping)."""
    return str(value) if isinstance(value, _Quoted) else value


def _call(name: str, args: list[Any], kwargs: dict[str, Any], column: int) -> Any:
    where = f"{name}() at column {column + 1}"
    if name in _SWEEPS:
        raise OverrideRefused(f"{where} is a sweep, which NeMo Gym's Hydra runs only with --multirun: not a "
                              "config value")
    if name == "shuffle":
        raise OverrideRefused(f"{where} is not supported here: NeMo Gym's Hydra gives the list in a new random "
                              "order on every run; write the list in the order wanted")
    if name == "sort":
        return _sort(args, kwargs, where)
    if name not in _CASTS:
        raise OverrideRefused(f"{where}: no such function (the casts are {', '.join(_CASTS)})")
    unknown = set(kwargs) - {"value"}
    if unknown:
        raise OverrideRefused(f"{where}: no argument named {sorted(unknown)[0]!r} (only 'value')")
    if args and kwargs:
        raise OverrideRefused(f"{where}: an argument and value= both")
    given = [kwargs["value"]] if kwargs else args
    if not given:
        raise OverrideRefused(f"{where}: nothing to cast")
    if len(given) > 1:
        raise OverrideRefused(f"{where}: more than one argument makes a sweep in NeMo Gym's Hydra, which needs "
                              "--multirun: cast a list, [a,b], instead")
    try:
        return _cast(name, given[0])
    except (ValueError, OverflowError) as error:
        raise OverrideRefused(f"{where}: {error}") from None


def _sort(args: list[Any], kwargs: dict[str, Any], where: str) -> Any:
    """Hydra's ``sort(list, reverse=false)``: a list in order (``list=`` wins over a list given first), any
    other value as it is; its arguments' types checked as Hydra checks them."""
    unknown = set(kwargs) - set(_SORT_ARGUMENTS)
    if unknown:
        raise OverrideRefused(f"{where}: no argument named {sorted(unknown)[0]!r} (only "
                              f"{', '.join(_SORT_ARGUMENTS)})")
    if kwargs.get("sweep") is not None:
        raise OverrideRefused(f"{where}: sweep= takes a sweep, which NeMo Gym's Hydra runs only with --multirun")
    reverse = kwargs.get("reverse", False)
    if not isinstance(reverse, bool):
        raise OverrideRefused(f"{where}: reverse= takes true or false")
    items = kwargs.get("list")
    if items is not None and not isinstance(items, list):
        raise OverrideRefused(f"{where}: list= takes a list")
    if any(arg is None for arg in args):
        raise OverrideRefused(f"{where}: null cannot be sorted")
    if items is None:
        if not args:
            raise OverrideRefused(f"{where}: nothing to sort")
        if len(args) > 1:
            raise OverrideRefused(f"{where}: more than one argument makes a sweep in NeMo Gym's Hydra, which needs "
                                  "--multirun: sort a list, [a,b], instead")
        if not isinstance(args[0], list):
            return args[0]
        items = args[0]
    try:
        return sorted(items, reverse=reverse)
    except TypeError:
        raise OverrideRefused(f"{where}: the items cannot be put in order, as NeMo Gym's Hydra cannot: numbers "
                              "and bools sort together, unquoted texts together, lists item by item; not null, "
                              "mappings, quoted text ('a') or mixed kinds") from None


def _cast(name: str, value: Any) -> Any:
    """Hydra's casts: a list item by item, a mapping value by value (its keys kept)."""
    if isinstance(value, list):
        return [_cast(name, item) for item in value]
    if isinstance(value, dict):
        return {key: _cast(name, item) for key, item in value.items()}
    if name == "bool":
        if isinstance(value, str):
            if value.lower() not in ("true", "false"):
                raise ValueError(f"{value!r:.40} is not true or false")
            return value.lower() == "true"
        return bool(value)
    if value is None:
        raise ValueError("null cannot be cast")
    if name == "str":
        return str(value).lower() if isinstance(value, bool) else str(value)
    if isinstance(value, str) and len(value) > MAX_NUMBER_CHARS:
        raise ValueError(f"a text of {len(value):,} characters: more than {MAX_NUMBER_CHARS}, the bound on a number")
    if name == "int":
        return int(value)
    return float(value)


def parse_override_value(text: str) -> Any:
    """The value of the text after ``key=``, as NeMo Gym's Hydra reads it (``OverrideRefused`` if it does not)."""
    return _Reader(text).value()


def quote_override_value(text: str) -> str:
    """``text`` single-quoted so that ``parse_override_value`` gives it back unchanged."""
    escaped = re.sub(r"(\\*)('|\Z)", lambda m: "\\" * (2 * len(m[1]) + (1 if m[2] else 0)) + m[2], text)
    return f"'{escaped}'"
