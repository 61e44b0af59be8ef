"""What a config may cost to read: aliases, nesting, size and copies are bounded, and every refusal is
one ``ConfigError`` line naming the file (or the command line), never a traceback or minutes of work."""

from __future__ import annotations

import json
import re
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from nemo_gym_ckpt.config import load_config
from nemo_gym_ckpt.config_sources import MAX_EXPANDED_CHARS, MAX_EXPANDED_VALUES, parse_overrides
from nemo_gym_ckpt.config_yaml import MAX_DEPTH, MAX_FILE_BYTES, MAX_NODES, MAX_NUMBER_CHARS, YamlRefused, load_yaml
from nemo_gym_ckpt.errors import ConfigError

pytestmark = pytest.mark.unit

SERVER = "sm: {resources_servers: {string_match: {domain: knowledge}}}\n"

Write = Callable[[str, str | bytes], str]


@pytest.fixture
def write(tmp_path: Path) -> Write:
    def write(name: str, content: str | bytes) -> str:
        path = tmp_path / name
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return str(path)

    return write


def laughs(levels: int, *, ref: Callable[[int], str] = lambda i: f"*a{i}", anchor: str = "&a{i} ") -> str:
    """``a0`` holds ten strings, each ``a<i>`` ten of ``a<i-1>``: 10**levels strings once expanded."""
    lines = [f"a0: {anchor.format(i=0)}[" + ", ".join(["lol"] * 10) + "]"]
    lines += [f"a{i}: {anchor.format(i=i)}[" + ", ".join([ref(i - 1)] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nsm: {{resources_servers: {{string_match: {{description: '${{a{levels - 1}}}'}}}}}}\n"


def refusal(paths: list[str], overrides: tuple[str, ...] = ()) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        load_config(paths, overrides)
    assert "\n" not in str(caught.value)
    return caught.value


# ---- YAML aliases ("billion laughs") -------------------------------------------------------------


def test_an_alias_bomb_is_refused_before_it_is_expanded(write: Write) -> None:
    path = write("bomb.yaml", laughs(5))  # 376 bytes, 10**5 strings: seconds and ever more memory before
    error = refusal([path])
    assert error.file == path and f"builds more than {MAX_NODES:,} values" in str(error)


def test_an_override_is_bounded_in_values_and_has_no_aliases() -> None:
    """Hydra's grammar has no anchors or aliases: an override builds at most as many values as it has text,
    and at most MAX_NODES (keys counted)."""
    bomb = laughs(5).split("\nsm:")[0].replace("\n", ", ")
    with pytest.raises(ConfigError, match="cannot be written unquoted") as caught:
        parse_overrides([f"x={{{bomb}}}"])
    assert caught.value.file == "<command line>"
    assert len(parse_overrides(["x=[" + ",".join(["1"] * (MAX_NODES - 1)) + "]"])[0][1]) == MAX_NODES - 1
    with pytest.raises(ConfigError, match=f"builds more than {MAX_NODES:,} values") as caught:
        parse_overrides(["x=[" + ",".join(["1"] * MAX_NODES) + "]"])
    assert caught.value.file == "<command line>"
    with pytest.raises(ConfigError, match=f"builds more than {MAX_NODES:,} values"):
        parse_overrides(["x={" + ",".join(f"k{i}:1" for i in range(MAX_NODES // 2)) + "}"])


def test_anchors_used_as_configs_use_them_still_load(write: Write) -> None:
    first = "sm0: {resources_servers: {string_match: &common {domain: knowledge, description: shared}}}\n"
    others = "".join(f"sm{i}: {{resources_servers: {{string_match: {{<<: *common, port: {15300 + i}}}}}}}\n"
                     for i in range(1, 20))
    mesh = load_config([write("anchors.yaml", first + others)])
    assert len(mesh.instances) == 20 and mesh.instance("sm7").settings.description == "shared"


def test_aliases_are_counted_as_what_they_repeat() -> None:
    shared = "[" + ", ".join(["x"] * 999) + "]"
    assert len(load_yaml(f"a: &a {shared}\nb: [" + ", ".join(["*a"] * 98) + "]\n")["b"]) == 98  # 99,004 values
    with pytest.raises(YamlRefused, match="builds more than"):
        load_yaml(f"a: &a {shared}\nb: [" + ", ".join(["*a"] * 100) + "]\n")


def test_an_alias_inside_its_own_anchor_is_refused() -> None:
    with pytest.raises(YamlRefused, match=r"alias \*a is inside the node &a names"):
        load_yaml("x: &a [1, *a]\n")


# ---- nesting, size, encoding ---------------------------------------------------------------------


@pytest.mark.parametrize("opening", ["[", "{a: ", "- "], ids=["flow list", "flow map", "block list"])
def test_a_deeply_nested_file_is_one_config_error(write: Write, opening: str) -> None:
    if opening == "- ":
        text = "x:\n" + "".join("  " * (i + 1) + "-\n" for i in range(200)) + "  " * 201 + "1\n"
    else:
        text = "x: " + opening * 10_000 + "1" + ("]" if opening == "[" else "}") * 10_000 + "\n"
    path = write("deep.yaml", text)
    error = refusal([path])
    assert error.file == path and f"nested more than {MAX_DEPTH} levels deep" in str(error)


def test_nesting_up_to_the_bound_loads() -> None:
    assert load_yaml("[" * (MAX_DEPTH - 1) + "1" + "]" * (MAX_DEPTH - 1)) is not None
    with pytest.raises(YamlRefused):
        load_yaml("[" * MAX_DEPTH + "1" + "]" * MAX_DEPTH)


def test_a_deeply_nested_override_is_one_config_error() -> None:
    with pytest.raises(ConfigError, match="nested more than") as caught:
        parse_overrides(["x=" + "[" * 10_000 + "]" * 10_000])
    assert caught.value.file == "<command line>"
    with pytest.raises(ConfigError, match=f"more than {MAX_DEPTH} parts"):
        parse_overrides([".".join(["a"] * 10_000) + "=1"])


def test_a_file_that_is_not_utf8_is_one_config_error(write: Write) -> None:
    path = write("latin1.yaml", SERVER.encode() + "description: caf\xe9\n".encode("latin-1"))
    error = refusal([path])
    assert error.file == path and "not UTF-8 text (byte 0xe9 at offset" in str(error)


def test_a_file_over_the_size_bound_is_refused_unread(write: Write) -> None:
    path = write("big.yaml", SERVER + "# " + "x" * MAX_FILE_BYTES + "\n")
    error = refusal([path])
    assert error.file == path and f"larger than {MAX_FILE_BYTES >> 20} MiB" in str(error)


# ---- copies made by interpolation and directives -------------------------------------------------


def test_copies_that_copy_each_other_are_refused(write: Write) -> None:
    path = write("copies.yaml", laughs(5, ref=lambda i: f"'${{a{i}}}'", anchor=""))  # 10**5 strings, 10 a level
    error = refusal([path])
    assert error.file == path and "interpolation copies more than" in str(error)


@pytest.mark.parametrize("ref", ["{_copy: big}", "'${copy:big}'", "{_copy: big, extra: 1}", "{_inherit_from: big}"])
def test_directives_copying_one_block_many_times_are_refused(write: Write, ref: str) -> None:
    big = "big: {" + ", ".join(f"k{i}: v" for i in range(2_000)) + "}\n"
    path = write("copies.yaml", big + "".join(f"c{i}: {ref}\n" for i in range(60)))  # 120,000 values copied
    error = refusal([path])
    assert error.file == path and f"_copy copy more than {MAX_EXPANDED_VALUES:,} values" in str(error)


def test_a_string_that_interpolation_grows_tenfold_a_level_is_refused(write: Write) -> None:
    lines = ["a0: '" + "x" * 100_000 + "'"] + [f"a{i}: '" + f"${{a{i - 1}}}" * 10 + "'" for i in range(1, 4)]
    server = SERVER.replace("domain: knowledge", "description: '${a3}'")
    path = write("strings.yaml", "\n".join(lines) + "\n" + server)
    error = refusal([path])  # 100 MB of text before
    assert error.file == path
    assert f"interpolation builds more than {MAX_EXPANDED_CHARS >> 20} MiB of text" in str(error)


def test_copies_nested_past_the_recursion_limit_are_one_config_error(write: Write) -> None:
    depth = MAX_DEPTH - 4
    lines = ["c0: {x: 1}"]
    for i in range(1, 30):  # each block nests the one before 60 levels down: 1,740 levels in all
        lines.append(f"c{i}: " + "{n: " * depth + f"'${{c{i - 1}}}'" + "}" * depth)
    server = SERVER.replace("domain: knowledge", "value: '${c29}'")
    path = write("nested_copies.yaml", "\n".join(lines) + "\n" + server)
    error = refusal([path])
    assert "nested too deeply" in str(error)


def test_a_long_string_that_many_values_name_whole_is_no_copy_and_loads(write: Write) -> None:
    prompt = "p" * 900_000  # 20 names of it, each naming the last: 18 MB counted as text, one string held
    names = "\n".join(f"n{i}: '${{{f'n{i - 1}' if i else 'shared'}}}'" for i in range(20))
    server = SERVER.replace("domain: knowledge", "description: '${n19}'")
    path = write("shared.yaml", f"shared: '{prompt}'\n{names}\n{server}")
    assert load_config([path]).raw["sm"]["resources_servers"]["string_match"]["description"] == prompt


def test_a_mapping_named_inside_text_is_refused_before_its_text_is_built(write: Write) -> None:
    # 5,000 names of one 20,000-character string, written into text: 100 MB of text, built before
    # the bound was checked (a 229 KB file of this shape peaked at 1.7 GiB); now each piece is counted first
    big = "".join(f"  k{i}: ${{s}}\n" for i in range(5_000))
    path = write("text.yaml", f"s: {'x' * 20_000}\nbig:\n{big}" + SERVER.replace("domain: knowledge",
                                                                                  "description: 'a${big}'"))
    tracemalloc.start()
    try:
        error = refusal([path])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert error.file == path and f"interpolation builds more than {MAX_EXPANDED_CHARS >> 20} MiB" in str(error)
    assert peak < 2 * MAX_EXPANDED_CHARS, f"{peak:,} bytes at the peak"


def test_a_mapping_or_list_inside_text_is_written_as_python_and_nemo_gyms_omegaconf_write_it(write: Write) -> None:
    block = {"n": 1, "f": 1.5, "t": True, "z": None, "q": "it's \"quoted\"", "l": [1, "two", [], {}], "m": {"k": "v"}}
    values = f"block: {json.dumps(block)}\nlist: [1, {{a: b}}, 'c']\n"
    path = write("written.yaml", values + SERVER.replace("domain: knowledge", "description: 'a${block}|${list}z'"))
    description = load_config([path]).raw["sm"]["resources_servers"]["string_match"]["description"]
    assert description == f"a{block}|{[1, {'a': 'b'}, 'c']}z"


# ---- scalars PyYAML builds: numbers --------------------------------------------------------------


def test_a_base60_integer_past_the_bound_is_refused_unbuilt() -> None:
    # YAML 1.1 reads 1:1:...:1 as base 60: 200 KB took 6 s to build (quadratic) into a 1.2-million-bit int
    with pytest.raises(YamlRefused, match=f"int scalar of 200,001 characters .*more than {MAX_NUMBER_CHARS}"):
        load_yaml("1" + ":1" * 100_000)
    assert load_yaml("1:1:1") == 3661


def test_numbers_up_to_the_bound_load_and_quoted_ones_stay_text() -> None:
    assert load_yaml("1" + "0" * (MAX_NUMBER_CHARS - 1)) == 10 ** (MAX_NUMBER_CHARS - 1)
    assert load_yaml("0." + "1" * (MAX_NUMBER_CHARS - 2)) == pytest.approx(1 / 9)
    with pytest.raises(YamlRefused, match="float scalar of 129 characters"):
        load_yaml("0." + "1" * (MAX_NUMBER_CHARS - 1))
    assert load_yaml(f"'{'9' * 5_000}'") == "9" * 5_000


@pytest.mark.parametrize(
    ("text", "message"),
    [("9" * 4_301, "int scalar of 4,301 characters"),  # int() refuses more than 4,300 digits: a ValueError
     ("1" + ":1" * 3_000, "int scalar of 6,001 characters"),
     ("!!int 1e3", "'1e3' is not a valid int (line 1): invalid literal for int() with base 10: '1e3'"),
     ("!!float abc", "'abc' is not a valid float"),
     ("!!int 0b", "'0b' is not a valid int"),
     ("[1, {a: !!int x}]", "'x' is not a valid int (line 1)")],
)
def test_a_scalar_pyyaml_cannot_build_is_one_config_error(write: Write, text: str, message: str) -> None:
    path = write("scalar.yaml", f"{SERVER}x:\n  - 1\n  - {text}\n")
    error = refusal([path])
    assert error.file == path and message.replace("(line 1)", "(line 4)") in str(error)


@pytest.mark.parametrize(
    ("text", "message"),
    [("9" * 4_301, "int of 4,301 characters (column 1): more than 128"),  # int() refuses more than 4,300 digits
     ("0." + "1" * MAX_NUMBER_CHARS, f"float of {MAX_NUMBER_CHARS + 2} characters (column 1)"),
     ("[1, {a: -" + "1" * MAX_NUMBER_CHARS + "}]", f"int of {MAX_NUMBER_CHARS + 1} characters (column 9)"),
     (f"int('{'9' * 5_000}')", "int() at column 1: a text of 5,000 characters: more than 128"),
     ("float(" + "9" * 200 + ")", "int of 200 characters (column 7)")],
)
def test_a_number_past_the_bound_in_an_override_is_one_config_error(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        parse_overrides([f"a={text}"])
    assert caught.value.file == "<command line>" and "\n" not in str(caught.value)
    assert parse_overrides(["a=" + "9" * MAX_NUMBER_CHARS, f"b='{'9' * 5_000}'"]) == [
        (("a",), int("9" * MAX_NUMBER_CHARS)), (("b",), "9" * 5_000)]


# ---- duplicate keys ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [("a: 1\nb: 2\na: 3\n", "duplicate key 'a' (line 3; first on line 1)"),
     ("a: {x: 1, y: 2, x: 3}\n", "duplicate key 'x' (line 1; first on line 1)"),
     ("a: {1: one, '1': also one}\n", "duplicate key '1'"),
     ("a:\n  - {k: 1}\n  - k: 2\n    k: 3\n", "duplicate key 'k' (line 4; first on line 3)"),
     ("b: &b {x: 1}\nc:\n  <<: *b\n  y: 2\n  y: 3\n", "duplicate key 'y' (line 5; first on line 4)")],
    ids=["top level", "flow", "int and string", "in a list", "beside a merge"],
)
def test_a_key_written_twice_in_one_mapping_is_refused(write: Write, text: str, message: str) -> None:
    with pytest.raises(YamlRefused, match=re.escape(message)):
        load_yaml(text)
    path = write("twice.yaml", SERVER + text)
    error = refusal([path])
    assert error.file == path and "duplicate key" in str(error)


def test_a_key_a_merge_brings_is_overridden_not_a_duplicate() -> None:
    assert load_yaml("b: &b {x: 1, y: 1}\nc: {<<: *b, x: 2}\n")["c"] == {"x": 2, "y": 1}
    # n is merged into o (its merge put into it) before n itself is built: its own a is still no duplicate
    assert load_yaml("m: &m {a: 1}\nn: [&n {<<: *m, a: 2}]\no: {<<: *n, c: 3}\n")["n"] == [{"a": 2}]
