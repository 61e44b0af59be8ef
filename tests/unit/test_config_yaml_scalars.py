"""Plain scalars in a config mean what they mean to NeMo Gym's loader (OmegaConf), not PyYAML's YAML 1.1.

The expected values (``tests/support/yaml_scalars.py``) were read from omegaconf 2.3.1, NeMo Gym
0.7.0's; the interop tier (``tests/interop/test_config_yaml_scalars.py``) compares with OmegaConf itself.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nemo_gym_ckpt.config import load_config
from nemo_gym_ckpt.config_sources import parse_overrides
from nemo_gym_ckpt.config_yaml import YamlRefused, dump_yaml, load_yaml
from nemo_gym_ckpt.errors import ConfigError
from tests.support.yaml_scalars import REFUSED, SCALARS, same

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("text", "expected"), SCALARS, ids=[text or "(empty)" for text, _ in SCALARS])
def test_a_plain_scalar_has_omegaconfs_type_and_value(text: str, expected: object) -> None:
    flow = [f"k: [{text}]\n"] if text and "," not in text else []  # "[1,000]" is two items, "[]" none
    for document in (f"k: {text}\n", f"k:\n  - {text}\n", *flow):
        loaded = load_yaml(document)["k"]
        got = loaded[0] if isinstance(loaded, list) else loaded
        assert same(got, expected), f"{document!r}: {got!r} ({type(got).__name__}), OmegaConf: {expected!r}"


@pytest.mark.parametrize("text", ["2001-01-01", "2001-12-14t21:59:43.10-05:00", "1e3", "yes", "0x1F"])
def test_a_key_resolves_as_a_value_does(text: str) -> None:
    expected = dict(SCALARS)[text]
    (key,) = load_yaml(f"{text}: v\n")
    assert same(key, expected)


def test_a_date_in_a_config_file_stays_the_text_written(tmp_path: Path) -> None:
    path = tmp_path / "dated.yaml"
    path.write_text("sm:\n  resources_servers:\n    string_match:\n      domain: knowledge\n"
                    "      description: 2001-12-14 21:59:43.10 -5\n"
                    "      value: 2001-01-01\n")
    settings = load_config([path]).instance("sm").settings
    assert settings.description == "2001-12-14 21:59:43.10 -5"  # was a datetime, refused as not a string
    assert settings.value == "2001-01-01"


def test_a_date_in_an_override_stays_the_text_written() -> None:
    assert parse_overrides(["a.b=2001-01-01", "a.c=1e3", "a.d=2002-02-30"]) == [
        (("a", "b"), "2001-01-01"), (("a", "c"), 1000.0), (("a", "d"), "2002-02-30")]


@pytest.mark.parametrize(("text", "message"), REFUSED,
                         ids=["tagged date", "tagged time in a list", "tagged date as a key", "set", "~ as a key",
                              "null as a key"])
def test_a_value_omegaconf_cannot_hold_is_refused(text: str, message: str) -> None:
    # omegaconf 2.3.1: UnsupportedValueType (a date, a datetime, a set), KeyValidationError (a None key)
    with pytest.raises(YamlRefused, match=re.escape(message)):
        load_yaml(text)
    with pytest.raises(ConfigError, match="override x: "):  # not YAML there: Hydra's grammar (1.3.8) refuses it too
        parse_overrides([f"x={text.rstrip()}"])


def test_a_quoted_null_key_is_a_name() -> None:
    assert load_yaml("'~': a\n'null': b\n") == {"~": "a", "null": "b"}


def test_a_dumped_config_reads_back_the_same() -> None:
    """The head serves the config as YAML and NeMo Gym's servers read it: a string such as a name
    ``7e1`` or a hash ``4172e59`` must come back a string (the safe dumper wrote it bare: a float here)."""
    strings = list(dict.fromkeys([text for text, _ in SCALARS] + ["7e1", "4172e59", "1_0e3", "-1E-3"]))
    values = [expected for _, expected in SCALARS]
    document = {"strings": strings, "values": values, **{text: index for index, text in enumerate(strings)}}
    loaded = load_yaml(dump_yaml(document))
    assert loaded["strings"] == strings
    assert all(same(got, expected) for got, expected in zip(loaded["values"], values, strict=True))
    assert list(loaded)[2:] == strings  # as keys too
