"""Config strings as NeMo Gym's OmegaConf (2.3.1) reads them: ``interpolation_problem``.

OmegaConf refuses a string holding ``${`` unless it reads by its interpolation grammar (``\\${`` is the
escape for a literal ``${``). It first tries a quick pattern (plain text around simple ``${a.b}`` or
``${name:args}``): a string that matches is taken as it is; then the grammar, whose lexer has modes:
top-level text, inside ``${``, resolver arguments after ``${name:``, and quoted text among them. The
arguments' primitive tokens are Hydra's (``config_tokens``). ``config_overrides`` refuses an override
value holding such a string, as NeMo Gym does.
"""

from __future__ import annotations

import re
from typing import NoReturn

from nemo_gym_ckpt.config_tokens import TOKENS, WS
from nemo_gym_ckpt.config_yaml import MAX_DEPTH

__all__ = ["interpolation_problem"]

_OC_KEY = "[$A-Za-z0-9_]+"
_OC_NAME = "[A-Za-z_][A-Za-z0-9_-]*"
_OC_ARG = "[A-Za-z0-9_/+.$%*@?|-]+"
_OC_TEXT = "(?:[^$]|\\$(?!\\{))*"
_OC_QUICK = re.compile(
    f"{_OC_TEXT}(?:\\$\\{{\\s*(?:\\.*(?:{_OC_KEY}|\\[{_OC_KEY}\\])(?:\\.{_OC_KEY}|\\[{_OC_KEY}\\])*"
    f"|(?:{_OC_NAME}(?:\\.{_OC_NAME})*)?\\s*:\\s*{_OC_ARG}(?:\\s*,\\s*{_OC_ARG})*)\\s*\\}}{_OC_TEXT})+", re.ASCII)
_OC_OPEN = ("INTER_OPEN", f"\\$\\{{{WS}", "push INTER")
_OC_WORDS = [(name, pattern.pattern, "") for name, patterns in TOKENS
             if name in ("FLOAT", "INT", "BOOL", "NULL", "UNQUOTED_CHAR", "ID", "ESC", "WS") for pattern in patterns]
_HYDRA = {name: patterns[0].pattern for name, patterns in TOKENS if len(patterns) == 1}
"""Hydra's single-pattern tokens by name: the punctuation (with its blanks) and ID are OmegaConf's too."""
_OC_MODES: dict[str, list[tuple[str, re.Pattern[str], str]]] = {
    mode: [(name, re.compile(pattern), action) for name, pattern, action in rules] for mode, rules in {
        "TOP": [_OC_OPEN, ("TEXT", "\\\\\\$\\{|(?:\\\\\\\\)+|[\\\\$]|[^\\\\$]+", "")],
        "INTER": [_OC_OPEN, ("COLON", _HYDRA["COLON"], "mode VALUE"), ("INTER_CLOSE", _HYDRA["BRACE_CLOSE"], "pop"),
                  ("DOT", "\\.", ""), ("BRACKET_OPEN", "\\[", ""), ("BRACKET_CLOSE", "\\]", ""),
                  ("ID", _HYDRA["ID"], ""), ("INTER_KEY", "[^\\\\{}()\\[\\]:. \\t'\"]+", "")],
        "VALUE": [_OC_OPEN, ("BRACE_OPEN", _HYDRA["BRACE_OPEN"], "push VALUE"),
                  ("BRACE_CLOSE", _HYDRA["BRACE_CLOSE"], "pop"),
                  ("QUOTE_OPEN", "'", "push SINGLE"), ("QUOTE_OPEN", '"', "push DOUBLE"),
                  *((name, _HYDRA[name], "") for name in ("COMMA", "BRACKET_OPEN", "BRACKET_CLOSE", "COLON")),
                  *_OC_WORDS],
        **{mode: [_OC_OPEN, ("QUOTE_CLOSE", quote, "pop"),
                  ("TEXT", f"\\\\\\$\\{{|(?:\\\\\\\\)+|\\\\{quote}|[\\\\$]|[^{quote}\\\\$]+", "")]
           for mode, quote in (("SINGLE", "'"), ("DOUBLE", '"'))},
    }.items()
}
_OC_PRIMITIVE = frozenset({"FLOAT", "INT", "BOOL", "NULL", "UNQUOTED_CHAR", "ID", "ESC", "WS", "COLON"})
_OC_DICT_KEY = _OC_PRIMITIVE - {"COLON"}
_OC_ELEMENT = _OC_PRIMITIVE | {"INTER_OPEN", "QUOTE_OPEN", "BRACKET_OPEN", "BRACE_OPEN"}


class _BadInterpolation(Exception):
    pass


def _oc_tokens(text: str) -> list[tuple[str, int]]:
    """OmegaConf's lexer: (token, column) from top-level text, each token the longest of its mode's (the
    earlier on a tie), the modes kept on a stack."""
    tokens: list[tuple[str, int]] = []
    modes = ["TOP"]
    position = 0
    while position < len(text):
        best = ("", position, "")
        for name, pattern, action in _OC_MODES[modes[-1]]:
            match = pattern.match(text, position)
            if match is not None and match.end() > best[1]:
                best = (name, match.end(), action)
        name, end, action = best
        if not name:
            raise _BadInterpolation(f"{text[position]!r} at column {position + 1} cannot stand there")
        tokens.append((name, position))
        verb, _, mode = action.partition(" ")
        if verb == "push":
            if len(modes) > MAX_DEPTH:
                raise _BadInterpolation(f"nested more than {MAX_DEPTH} levels deep")
            modes.append(mode)
        elif verb == "pop":
            modes.pop()
        elif verb == "mode":
            modes[-1] = mode
        position = end
    return tokens


class _OmegaConfText:
    """OmegaConf's parser over the tokens: text, ``${key.path}``, ``${[key]}``, ``${name:arguments}``."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _oc_tokens(text)
        self.at = 0

    def kind(self) -> str:
        return self.tokens[self.at][0] if self.at < len(self.tokens) else "END"

    def take(self, kind: str) -> None:
        if self.kind() != kind:
            self.fail(kind.lower().replace("_", " "))
        self.at += 1

    def fail(self, wanted: str) -> NoReturn:
        if self.at >= len(self.tokens):
            raise _BadInterpolation(f"it ends where {wanted} was expected")
        column = self.tokens[self.at][1]
        raise _BadInterpolation(f"{self.text[column]!r} at column {column + 1} where {wanted} was expected")

    def check(self) -> None:
        while self.at < len(self.tokens):
            if self.kind() == "INTER_OPEN":
                self.interpolation(1)
            else:
                self.at += 1

    def interpolation(self, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise _BadInterpolation(f"nested more than {MAX_DEPTH} levels deep")
        self.take("INTER_OPEN")
        name = self.kind() != "DOT"  # may it be a resolver's name: no leading dot, no [key], IDs only
        while self.kind() == "DOT":
            self.at += 1
        name &= self.key(depth, bracket=True)
        while self.kind() in ("DOT", "BRACKET_OPEN"):
            self.at += 1
            name &= self.key(depth, bracket=False) if self.tokens[self.at - 1][0] == "DOT" else self.bracketed(depth)
        if self.kind() == "COLON" and name:
            self.at += 1
            if self.kind() != "BRACE_CLOSE":
                self.sequence(depth)
            self.take("BRACE_CLOSE")
        elif self.kind() == "INTER_CLOSE":
            self.at += 1
        else:
            self.fail("'}' closing the interpolation")

    def key(self, depth: int, *, bracket: bool) -> bool:
        """One key of the path; whether it may be part of a resolver's name."""
        kind = self.kind()
        if bracket and kind == "BRACKET_OPEN":
            self.at += 1
            return self.bracketed(depth)
        if kind == "INTER_OPEN":
            self.interpolation(depth + 1)
            return True
        if kind not in ("ID", "INTER_KEY"):
            self.fail("a key")
        self.at += 1
        return kind == "ID"

    def bracketed(self, depth: int) -> bool:
        self.key(depth, bracket=False)
        self.take("BRACKET_CLOSE")
        return False

    def sequence(self, depth: int) -> None:
        if self.kind() != "COMMA":
            self.element(depth + 1)
        while self.kind() == "COMMA":
            self.at += 1
            if self.kind() in _OC_ELEMENT:
                self.element(depth + 1)

    def element(self, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise _BadInterpolation(f"nested more than {MAX_DEPTH} levels deep")
        kind = self.kind()
        if kind == "QUOTE_OPEN":
            self.at += 1
            while self.kind() not in ("QUOTE_CLOSE", "END"):
                if self.kind() == "INTER_OPEN":
                    self.interpolation(depth + 1)
                else:
                    self.at += 1
            self.take("QUOTE_CLOSE")
        elif kind == "BRACKET_OPEN":
            self.at += 1
            if self.kind() != "BRACKET_CLOSE":
                self.sequence(depth)
            self.take("BRACKET_CLOSE")
        elif kind == "BRACE_OPEN":
            self.at += 1
            while self.kind() != "BRACE_CLOSE":
                if self.kind() not in _OC_DICT_KEY:
                    self.fail("a key")
                while self.kind() in _OC_DICT_KEY:
                    self.at += 1
                self.take("COLON")
                self.element(depth + 1)
                if self.kind() != "BRACE_CLOSE":
                    self.take("COMMA")
                    if self.kind() == "BRACE_CLOSE":
                        self.fail("a key")
            self.at += 1
        elif kind in _OC_PRIMITIVE or kind == "INTER_OPEN":
            while self.kind() in _OC_PRIMITIVE or self.kind() == "INTER_OPEN":
                if self.kind() == "INTER_OPEN":
                    self.interpolation(depth + 1)
                else:
                    self.at += 1
        else:
            self.fail("a value")


def interpolation_problem(text: str) -> str | None:
    """Why NeMo Gym's OmegaConf (2.3.1) refuses ``text`` as a config string, or None: a string holding
    ``${`` must read by its interpolation grammar (``\\${`` is the escape for a literal ``${``)."""
    if "${" not in text or _OC_QUICK.fullmatch(text):
        return None
    try:
        _OmegaConfText(text).check()
    except _BadInterpolation as error:
        return str(error)
    return None
