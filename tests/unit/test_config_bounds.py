"""What a config may cost to read: aliases, nesting, size and copies are bounded, and every refusal is
one ``ConfigError`` line naming the file (or the command line), never a traceback or minutes of work."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from nemo_gym_ckpt.config import load_config
from nemo_gym_ckpt.config_sources import MAX_EXPANDED_CHARS, parse_overrides
from nemo_gym_ckpt.config_yaml import MAX_DEPTH, MAX_FILE_BYTES, MAX_NODES, YamlRefused, load_yaml
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


def test_an_alias_bomb_in_an_override_is_refused_naming_the_command_line() -> None:
    bomb = laughs(5).split("\nsm:")[0].replace("\n", ", ")
    with pytest.raises(ConfigError, match="builds more than") as caught:
        parse_overrides([f"x={{{bomb}}}"])
    assert caught.value.file == "<command line>"


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


@pytest.mark.parametrize(
    ("ref", "message"),
    [(lambda i: f"'${{a{i}}}'", "interpolation copies more than"),
     (lambda i: f"{{_copy: a{i}}}", "_copy copy more than"),
     (lambda i: f"'${{copy:a{i}}}'", "_copy copy more than")],
    ids=["${a.b}", "_copy", "${copy:a.b}"],
)
def test_copies_that_copy_each_other_are_refused(write: Write, ref: Callable[[int], str], message: str) -> None:
    path = write("copies.yaml", laughs(5, ref=ref, anchor=""))  # 10**5 strings, 10 times more a level before
    error = refusal([path])
    assert error.file == path and message in str(error)


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
        lines.append(f"c{i}: " + "{n: " * depth + f"{{_copy: c{i - 1}}}" + "}" * depth)
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
