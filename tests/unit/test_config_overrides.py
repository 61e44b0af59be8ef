"""Override values mean what they mean to NeMo Gym's Hydra, not to YAML.

The expected values (``tests/support/override_values.py``) were read from hydra-core 1.3.8, NeMo Gym
0.7.0's; the interop tier (``tests/interop/test_config_overrides.py``) compares with Hydra itself.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_ckpt.config_overrides import OverrideRefused, parse_override_value, quote_override_value
from nemo_gym_ckpt.config_sources import COMMAND_LINE, parse_overrides, read_sources
from nemo_gym_ckpt.errors import ConfigError
from tests.support.override_values import REFUSED, VALUES
from tests.support.yaml_scalars import encode

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("text", "expected"), VALUES, ids=[repr(text) for text, _ in VALUES])
def test_a_value_reads_as_hydra_reads_it(text: str, expected: object) -> None:
    assert encode(parse_override_value(text)) == encode(expected)  # types included, NaN is NaN
    assert encode(parse_overrides([f"++k={text}"])[0][1]) == encode(expected)


@pytest.mark.parametrize(("text", "message"), REFUSED, ids=[repr(text) for text, _ in REFUSED])
def test_a_value_hydra_refuses_is_refused_saying_where(text: str, message: str) -> None:
    with pytest.raises(OverrideRefused, match=re.escape(message)):
        parse_override_value(text)
    with pytest.raises(ConfigError, match=re.escape(f"override k: {message}")) as caught:
        parse_overrides([f"+k={text}"])
    assert caught.value.file == COMMAND_LINE and "\n" not in str(caught.value)


def test_the_scalars_yaml_and_hydra_read_differently() -> None:
    """What the YAML loader made of these before (YAML 1.1 as OmegaConf keeps it) is not what NeMo Gym gets."""
    assert parse_overrides(["a=0x1F", "b=017", "c=1:30", "d=.inf", "e=yes", "f=off", "g=inf", "h=nan", "i="]) == [
        (("a",), "0x1F"), (("b",), "017"), (("c",), "1:30"), (("d",), ".inf"), (("e",), "yes"), (("f",), "off"),
        (("g",), float("inf")), (("h",), pytest.approx(float("nan"), nan_ok=True)), (("i",), "")]
    with pytest.raises(ConfigError, match="null is written null"):
        parse_overrides(["a=~"])


def test_hydras_own_settings_are_read_and_left_out() -> None:
    """In NeMo Gym (Hydra 1.3.8) these configure Hydra's run and never reach the config."""
    assert parse_overrides(["hydra/job_logging=disabled", "++hydra.output_subdir=null", "hydra.run.dir=out",
                            "a=1", "hydras=2"]) == [(("a",), 1), (("hydras",), 2)]
    with pytest.raises(ConfigError, match=r"override hydra\.run\.dir: a comma outside brackets"):
        parse_overrides(["hydra.run.dir=a,b"])


@pytest.mark.parametrize("text", ["", "a", "it's", 'say "hi"', "a\\", "a\\\n", "\\\\", "x\\'y", "/tmp/a b,[c]=d#é ~u",
                                  "a\nb", "'", "1", "true", "null", "${x}"])
def test_a_quoted_text_reads_back_as_itself(text: str) -> None:
    assert parse_override_value(quote_override_value(text)) == text


def test_quoting_round_trips_any_text_of_quotes_and_backslashes() -> None:
    rng = random.Random(5)
    for _ in range(2_000):
        text = "".join(rng.choice("ab\\'\" ,\n") for _ in range(rng.randint(0, 10)))
        assert parse_override_value(quote_override_value(text)) == text, text


# ---- the overrides together, and over the files --------------------------------------------------


def merged(tmp_path: Path, text: str, overrides: list[str]) -> dict[str, Any]:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    tree, _ = read_sources([path], overrides)
    tree.pop("config_paths")
    return tree


def test_a_mapping_override_merges_into_the_files_mapping(tmp_path: Path) -> None:
    """NeMo Gym merges its command-line tree over the files: a mapping keeps the keys it does not name
    (hydra-core 1.3.8, omegaconf 2.3.1: ``OmegaConf.merge``)."""
    assert merged(tmp_path, "a: {x: 1, y: {p: 1, q: 2}}\n", ["++a={y: {q: 3}, z: 4}"]) == {
        "a": {"x": 1, "y": {"p": 1, "q": 3}, "z": 4}}
    assert merged(tmp_path, "a: {x: 1}\nl: [1, 2]\n", ["++l=[3]", "++a=null"]) == {"a": None, "l": [3]}


def test_overrides_gather_in_order_as_hydra_gathers_them(tmp_path: Path) -> None:
    """As ``OmegaConf.update(merge=True)`` in Hydra 1.3.8: a mapping merges into one set before it, a key
    through a scalar (or null) replaces it, the last scalar wins."""
    assert merged(tmp_path, "", ["++a={x: 1}", "++a={y: 2}", "++a.z=3", "++b=1", "++b=2"]) == {
        "a": {"x": 1, "y": 2, "z": 3}, "b": 2}
    assert merged(tmp_path, "", ["++a=5", "++a.b=1", "++n=null", "++n.c=2"]) == {"a": {"b": 1}, "n": {"c": 2}}


def test_a_key_through_a_files_scalar_replaces_it(tmp_path: Path) -> None:
    # was "cannot set a.b: a is not a mapping"; NeMo Gym's merge puts the mapping in the scalar's place
    assert merged(tmp_path, "a: 5\n", ["++a.b=1"]) == {"a": {"b": 1}}


def test_config_paths_from_an_override_are_a_list_of_paths(tmp_path: Path) -> None:
    (tmp_path / "inc.yaml").write_text("i: 1\n")
    included = quote_override_value(str(tmp_path / "inc.yaml"))
    assert merged(tmp_path, "a: 1\n", [f"+config_paths=[{included}]"]) == {"a": 1, "i": 1}


def test_a_missing_value_override_keeps_what_is_set(tmp_path: Path) -> None:
    """``???`` over a key set before keeps its value, as NeMo Gym's merge (``OmegaConf.merge``) does, in a
    mapping too; over nothing, or as a list's item, or replacing what an earlier override set, it stays
    (hydra-core 1.3.8, omegaconf 2.3.1)."""
    assert merged(tmp_path, "a: 1\nb: {x: 1}\nc: [1]\nd: null\n", ["++a=???", "++b=???", "++c='???'", "++d=???"]) == {
        "a": 1, "b": {"x": 1}, "c": [1], "d": None}
    assert merged(tmp_path, "a: {x: 1, y: 2}\n", ["++a={x: ???, z: ???}", "++a.y=???"]) == {
        "a": {"x": 1, "y": 2, "z": "???"}}
    assert merged(tmp_path, "", ["++a=???", "++l=[???]", "++b=1", "++b=???", "++m={x: 1}", "++m={x: ???}"]) == {
        "a": "???", "l": ["???"], "b": "???", "m": {"x": 1}}
    (tmp_path / "c.yaml").write_text("a: 1\n")
    tree, origins = read_sources([tmp_path / "c.yaml"], ["++a=???"])
    assert tree["a"] == 1 and origins[("a",)] == str((tmp_path / "c.yaml").resolve())


@pytest.mark.parametrize(("text", "overrides", "key", "message"), [
    ("a: [1, 2]\n", ["++a={x: 1}"], "a", "a mapping cannot be merged over the list "),
    ("a: [1, 2]\n", ["++a.x=1"], "a", "a mapping cannot be merged over the list "),
    ("a: [1, 2]\n", ["++a.0=5"], "a", "a mapping cannot be merged over the list "),
    ("a: {x: 1}\n", ["++a=[1]"], "a", "a list cannot be merged over the mapping "),
    ("a: {x: {y: 1}}\n", ["++a={x: [1]}"], "a.x", "a list cannot be merged over the mapping "),
    ("", ["++a=[1]", "++a={x: 1}"], "a", "a mapping cannot be merged over the list set earlier on the command line"),
    ("", ["++a={x: 1}", "++a=[1]"], "a", "a list cannot be merged over the mapping set earlier"),
    ("", ["++a={x: [1]}", "++a={x: {y: 1}}"], "a.x", "a mapping cannot be merged over the list set earlier"),
    ("", ["++a=[1, {x: 1}]", "++a.1=[1]"], "a.1", "a list cannot be merged over the mapping set earlier"),
    ("", ["++a=[1, 2]", "++a.5=1"], "a.5",
     "override a.5: a is a list of 2 (set earlier on the command line), which has no item 5"),
    ("", ["++a={x: [1]}", "++a.x.y=1"], "a.x.y",
     "override a.x.y: a.x is a list of 1 (set earlier on the command line), which takes a number, not 'y'"),
])
def test_a_mapping_and_a_list_do_not_merge(tmp_path: Path, text: str, overrides: list[str], key: str,
                                         message: str) -> None:
    """NeMo Gym refuses both ways (omegaconf 2.3.1: ``ConfigTypeError: Cannot merge DictConfig with
    ListConfig``, hydra-core 1.3.8: ``ConfigCompositionException``); here one line naming the override."""
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        merged(tmp_path, text, overrides)
    assert (caught.value.file, caught.value.key) == (COMMAND_LINE, key) and "\n" not in str(caught.value)
    if text:
        assert "c.yaml gives it" in str(caught.value)


def test_a_number_through_a_list_set_on_the_command_line_sets_its_item(tmp_path: Path) -> None:
    """As Hydra 1.3.8 (``OmegaConf.update``): the item is set; a key through a scalar item makes a mapping."""
    assert merged(tmp_path, "", ["++a=[1, {b: 2}, [3], 4]", "++a.0=x", "++a.1.c=3", "++a.2.0=5", "++a.3.d=6",
                                 "++a.1={e: 7}"]) == {"a": ["x", {"b": 2, "c": 3, "e": 7}, [5], {"d": 6}]}


@pytest.mark.parametrize("key", ["a", "a.b.c", "$a", "a.$b", "a$", "a-b.c_d", "a.0", "a.1_0.b", "0.1", "1.5", "a/b"])
def test_a_key_hydra_reads(key: str) -> None:
    assert parse_overrides([f"++{key}=1"]) == [(tuple(key.split(".")), 1)]


@pytest.mark.parametrize(("item", "message"), [
    *((f"++{key}=1", "is not a key NeMo Gym's Hydra reads") for key in (
        "a..b", "a.", ".a", "a b", "a\tb", "0", "01", "1_0", "a.01", "-a", "a.-b", "a:b", "ü", "a.b/c", "a/1",
        "a.1a", "+a")),
    ("+++a=1", "'+a' is not a key NeMo Gym's Hydra reads"),
    ("++a@b=1", "key@package names a config group's package"),
    ("a.b@c=1", "key@package names a config group's package"),
    ("@a=1", "key@package names a config group's package"),
])
def test_a_key_hydra_refuses_is_refused(item: str, message: str) -> None:
    """Hydra 1.3.8's key grammar: a name, names and numbers joined by dots, or names joined by ``/``."""
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        parse_overrides([item])
    assert caught.value.file == COMMAND_LINE and "\n" not in str(caught.value)
