"""YAML scalar forms and the value NeMo Gym's loader (OmegaConf) gives each, for the unit and interop tiers.

``SCALARS`` is ``(text, value)``: the Python value (type included) of ``k: <text>``. Every value was
read from omegaconf 2.3.1 (NeMo Gym 0.7.0's, on PyYAML 6.0.4) as
``OmegaConf.to_container(OmegaConf.create(f"k: {text}"))["k"]``; the interop tier
(``tests/interop/test_config_yaml_scalars.py``) checks the table against OmegaConf itself.
``REFUSED`` is documents OmegaConf refuses (``UnsupportedValueType``, ``KeyValidationError``) with
the start of our refusal's message.
"""

from __future__ import annotations

import math

from tests.interop.nemo_gym_side.typed_json import encode

__all__ = ["REFUSED", "SCALARS", "encode", "same"]

NAN = float("nan")
INF = float("inf")

SCALARS: list[tuple[str, object]] = [
    # dates and times: OmegaConf keeps the text, exactly as written (YAML 1.1 builds a date)
    ("2001-01-01", "2001-01-01"),
    ("2001-12-14t21:59:43.10-05:00", "2001-12-14t21:59:43.10-05:00"),
    ("2001-12-14 21:59:43.10 -5", "2001-12-14 21:59:43.10 -5"),
    ("2001-12-14T21:59:43Z", "2001-12-14T21:59:43Z"),
    ("2001-12-15 2:59:43.10", "2001-12-15 2:59:43.10"),
    ("2002-02-30", "2002-02-30"),  # no such day: still the text (YAML 1.1 raised a ValueError)
    ("2001-1-1", "2001-1-1"),
    # floats: an exponent with no dot or no sign is a float (YAML 1.1: a string)
    ("1e3", 1000.0), ("1E3", 1000.0), ("+1e3", 1000.0), ("-1E-3", -0.001), ("1.0e3", 1000.0),
    ("1.e3", 1000.0), ("1_0e3", 10000.0), ("0e0", 0.0), ("12e03", 12000.0), ("1E-0", 1.0),
    ("1e33333", INF), ("1e-400", 0.0),
    ("1.0e+3", 1000.0), ("1.5e-3", 0.0015), (".5e+3", 500.0), (".5", 0.5), ("5.", 5.0), ("0.", 0.0),
    ("1_000.5", 1000.5), (".5_5", 0.55), ("1:30.5", 90.5),
    # ... and these stay strings in both
    ("1_e3", "1_e3"), ("_1e3", "_1e3"), ("1e3_0", "1e3_0"), (".5e3", ".5e3"), ("-.5", "-.5"), ("+.5", "+.5"),
    ("1e", "1e"), ("1e+", "1e+"), ("1ee3", "1ee3"), ("1e+3.0", "1e+3.0"), ("1.0.0", "1.0.0"), ("v1.0", "v1.0"),
    # infinities and NaN: only the dotted forms
    (".inf", INF), ("-.inf", -INF), ("+.inf", INF), (".Inf", INF), (".INF", INF), ("inf", "inf"),
    (".nan", NAN), (".NaN", NAN), (".NAN", NAN), ("nan", "nan"),
    # ints: YAML 1.1's forms, kept by OmegaConf
    ("+1", 1), ("-1", -1), ("-0", 0), ("0x1F", 31), ("-0x1F", -31), ("0x_1F", 31), ("0X1F", "0X1F"),
    ("017", 15), ("08", "08"), ("0o17", "0o17"), ("0b101", 5), ("1_000", 1000), ("1__0", 10), ("_1", "_1"),
    ("1:30", 90), ("-1:30", -90), ("12:30:00", 45000), ("1:60", "1:60"), ("1,000", "1,000"),
    # bools: YAML 1.1's words, not y/n
    ("yes", True), ("Yes", True), ("YES", True), ("no", False), ("NO", False), ("on", True), ("On", True),
    ("off", False), ("OFF", False), ("true", True), ("True", True), ("FALSE", False),
    ("y", "y"), ("Y", "Y"), ("n", "n"), ("N", "N"), ("tRue", "tRue"),
    # null
    ("~", None), ("null", None), ("Null", None), ("NULL", None), ("", None), ("nULL", "nULL"),
    # explicit tags and quotes
    ("'2001-01-01'", "2001-01-01"), ("!!str 1e3", "1e3"), ("!!float 1", 1.0), ("!!int '12'", 12),
    ("!!float 1:30", 90.0), ("!!binary aGk=", b"hi"),
]

REFUSED: list[tuple[str, str]] = [
    ("k: !!timestamp 2001-01-01\n", "a !!timestamp (line 1) is not a config value"),
    ("k: [1, !!timestamp 2001-12-14 21:59:43.10 -5]\n", "a !!timestamp (line 1) is not a config value"),
    ("!!timestamp 2001-01-01: v\n", "a !!timestamp (line 1) is not a config value"),
    ("k: !!set {a, b}\n", "a !!set (line 1) is not a config value"),
    ("a: 1\n~: v\n", "a null key '~' (line 2)"),
    ("k: {null: v}\n", "a null key 'null' (line 1)"),
]


def same(got: object, expected: object) -> bool:
    """``got == expected`` and of the same type (NaN is NaN)."""
    if isinstance(expected, float) and math.isnan(expected):
        return isinstance(got, float) and math.isnan(got)
    return type(got) is type(expected) and got == expected
