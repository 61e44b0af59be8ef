"""The tokens of the grammars NeMo Gym reads its command line and its config strings with.

Hydra 1.3's override grammar and OmegaConf 2.3's interpolation grammar share their primitive tokens
(numbers, booleans, null, names, escapes, blanks). ``TOKENS`` is Hydra's lexer's table, in its order:
of the patterns that match at a position, the longest wins, a tie going to the earlier token. The
patterns of a token are split so that each one's greedy match is its longest. ``config_overrides``
lexes override values with the whole table, ``config_interpolations`` the arguments of a resolver
with its primitive tokens.
"""

from __future__ import annotations

import re

__all__ = ["TOKENS", "WS"]

WS = "[ \\t]*"
"""Blanks (spaces and tabs) that tokens may carry around them."""
_INT_UNSIGNED = "(?:0|[1-9](?:_?[0-9])*)"
_DIGITS = "[0-9](?:_?[0-9])*"
_EXPONENT = f"[eE][+-]?{_DIGITS}"
_POINT_FLOATS = (f"{_INT_UNSIGNED}\\.", f"{_INT_UNSIGNED}?\\.{_DIGITS}")
TOKENS: list[tuple[str, list[re.Pattern[str]]]] = [
    (name, [re.compile(pattern) for pattern in patterns]) for name, patterns in [
        ("POPEN", [f"{WS}\\({WS}"]),
        ("COMMA", [f"{WS},{WS}"]),
        ("PCLOSE", [f"{WS}\\)"]),
        ("BRACKET_OPEN", [f"\\[{WS}"]),
        ("BRACKET_CLOSE", [f"{WS}\\]"]),
        ("BRACE_OPEN", [f"\\{{{WS}"]),
        ("BRACE_CLOSE", [f"{WS}\\}}"]),
        ("COLON", [f"{WS}:{WS}"]),
        ("EQUAL", [f"{WS}={WS}"]),
        ("FLOAT", [f"[+-]?{body}" for body in (*_POINT_FLOATS, f"{_INT_UNSIGNED}{_EXPONENT}",
                                               *(f"{point}{_EXPONENT}" for point in _POINT_FLOATS),
                                               "[Ii][Nn][Ff]", "[Nn][Aa][Nn]")]),
        ("INT", [f"[+-]?{_INT_UNSIGNED}"]),
        ("BOOL", ["[Tt][Rr][Uu][Ee]", "[Ff][Aa][Ll][Ss][Ee]"]),
        ("NULL", ["[Nn][Uu][Ll][Ll]"]),
        ("UNQUOTED_CHAR", ["[/\\-\\\\+.$%*@?|]"]),
        ("ID", ["[a-zA-Z_][a-zA-Z0-9_\\-]*"]),
        ("ESC", ["(?:\\\\\\\\|\\\\[()\\[\\]{}:=, \\t])+"]),
        ("WS", ["[ \\t]+"]),
    ]
]
