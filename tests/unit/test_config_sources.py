"""Where config values come from, as NeMo Gym has it: ``config_paths``, ``_inherit_from`` / ``_copy``,
values that only ``${...}`` reads, top-level launcher keys, and NeMo Gym's server keys."""

from __future__ import annotations

import json
import sys
import textwrap
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from environment_servers.legacy_agent import app as legacy_app
from nemo_gym_ckpt.config import PROJECT_ROOT, Domain, ServerConfig, ServerRef, load_config, load_config_dict
from nemo_gym_ckpt.config_sources import CONFIG_PATHS, read_sources
from nemo_gym_ckpt.errors import ConfigError
from tests.support.config_file_cases import MALFORMED, MERGES, REFUSED_MERGES, WELL_FORMED

pytestmark = pytest.mark.unit


class ToolConfig(ServerConfig):
    answer: str = "?"


class AgentConfig(ServerConfig):
    resources_server: ServerRef | None = None


@pytest.fixture(autouse=True)
def fake_implementations(monkeypatch: pytest.MonkeyPatch) -> None:
    """``resources_servers/fake_tool`` (entrypoints ``app.py`` and ``other.py``) and ``agents/fake_agent``."""
    for name, config in [("resources_servers.fake_tool.app", ToolConfig), ("agents.fake_agent.app", AgentConfig),
                         ("resources_servers.fake_tool.other", AgentConfig)]:
        module = types.ModuleType(name)
        module.Config = config  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, name, module)


Writer = Callable[[str, str], str]


@pytest.fixture
def write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Writer:
    """Writes files under the working directory (a fresh tmp folder), as NeMo Gym resolves against it."""
    monkeypatch.chdir(tmp_path)

    def write(name: str, text: str) -> str:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        return str(path)

    return write


def tool(answer: str, name: str = "tool") -> str:
    return f"{name}:\n  resources_servers:\n    fake_tool: {{answer: '{answer}'}}\n"


def answer_of(mesh_path: list[str], name: str = "tool", overrides: tuple[str, ...] = ()) -> str:
    settings = load_config(mesh_path, overrides).instance(name).settings
    assert isinstance(settings, ToolConfig)
    return settings.answer


# ---- config_paths --------------------------------------------------------------------------------


def test_config_paths_are_read_and_the_including_file_wins(write: Writer) -> None:
    write("parts/base.yaml", tool("base") + tool("only_base", "other"))
    top = write("top.yaml", "config_paths: [parts/base.yaml]\n" + tool("top"))
    mesh = load_config([top])
    assert answer_of([top]) == "top" and answer_of([top], "other") == "only_base"
    assert mesh.raw["config_paths"] == [str(Path("parts/base.yaml").resolve()), top]


def test_config_paths_siblings_later_wins_and_each_file_is_read_once(write: Writer) -> None:
    write("a.yaml", tool("a"))
    write("b.yaml", "config_paths: [a.yaml]\n" + tool("b"))
    top = write("top.yaml", "config_paths: [b.yaml, a.yaml]\n")
    assert answer_of([top]) == "b"  # a.yaml is read once, where b.yaml includes it; b.yaml wins over it
    write("loop.yaml", "config_paths: [loop.yaml, a.yaml]\n")
    assert answer_of(["loop.yaml"]) == "a"


def test_config_paths_fall_back_to_the_project_root(write: Writer) -> None:
    top = write("mine.yaml", "config_paths: [configs/quickstart.yaml]\nhead_server: {port: 12345}\n")
    mesh = load_config([top])
    assert "policy_model" in mesh.instances and mesh.head_server.port == 12345
    assert mesh.raw["config_paths"][0] == str(PROJECT_ROOT / "configs" / "quickstart.yaml")
    assert "single_agent_turn" in load_config(["configs/quickstart.yaml"]).instances  # the command line's too


def test_config_paths_from_an_override(write: Writer) -> None:
    write("extra.yaml", tool("extra", "extra"))
    mesh = load_config([write("top.yaml", tool("top"))], ["+config_paths=[extra.yaml]"])
    assert set(mesh.instances) == {"tool", "extra"}


@pytest.mark.parametrize(
    ("text", "message"),
    [("config_paths: [nowhere.yaml]\n", "config_paths entry 'nowhere.yaml' not found (looked in "),
     ("config_paths: nowhere.yaml\n", "expected a list of config file paths, got 'nowhere.yaml'")],
)
def test_a_bad_config_paths_entry_is_an_error_naming_the_file(write: Writer, text: str, message: str) -> None:
    top = write("top.yaml", text + tool("x"))
    with pytest.raises(ConfigError) as caught:
        load_config([top])
    assert (caught.value.file, caught.value.key) == (top, "config_paths")
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_missing_command_line_file_names_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"file not found \(looked in .*absent\.yaml") as caught:
        load_config([str(tmp_path / "absent.yaml")])
    assert caught.value.file == str(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="no config file"):
        load_config([])


NO_SUCH_USER = "~ngc-no-such-user-5a1c"


@pytest.mark.parametrize(
    ("entry", "message"),
    [("a" * 300 + ".yaml", "cannot be looked for: File name too long"),
     (f"{NO_SUCH_USER}/mesh.yaml", f"cannot be found: no home directory for '{NO_SUCH_USER}'")],
    ids=["name over NAME_MAX", "~user of no user"],
)
def test_a_path_that_cannot_be_looked_up_is_a_config_error(write: Writer, entry: str, message: str) -> None:
    for paths, overrides in [([entry], ()), ([], (f"config_paths=['{entry}']",))]:  # '~' is quoted, as Hydra wants
        with pytest.raises(ConfigError) as caught:  # were OSError (ENAMETOOLONG) and RuntimeError tracebacks
            load_config(paths, overrides)
        assert caught.value.file == entry and f"file {message}" in str(caught.value)
    top = write("top.yaml", f"config_paths: ['{entry}']\n" + tool("x"))
    with pytest.raises(ConfigError) as caught:
        load_config([top])
    assert (caught.value.file, caught.value.key) == (top, "config_paths")
    assert f"config_paths entry {entry!r} {message}" in str(caught.value) and "\n" not in str(caught.value)


# ---- _inherit_from and _copy ---------------------------------------------------------------------

BASE = """
    base_tool:
      resources_servers:
        fake_tool: {answer: base, retries_note: kept}
"""


def test_inherit_from_moves_the_block_and_merges_the_own_keys(write: Writer) -> None:
    path = write("a.yaml", """
        base_tool:
          resources_servers:
            fake_tool: {answer: base, port: 15301}
        tool:
          _inherit_from: base_tool
          resources_servers:
            fake_tool: {answer: mine}
    """)
    mesh = load_config([path])
    assert set(mesh.instances) == {"tool"}, "the source of _inherit_from is moved, not copied"
    settings = mesh.instance("tool").settings
    assert isinstance(settings, ToolConfig) and (settings.answer, settings.port) == ("mine", 15301)


def test_copy_keeps_the_source_and_string_forms_work(write: Writer) -> None:
    path = write("a.yaml", """
        base_tool:
          resources_servers:
            fake_tool: {answer: base}
        copied:
          _copy: base_tool
          resources_servers:
            fake_tool: {answer: copied}
        plain_copy: ${copy:base_tool}
        nested:
          resources_servers:
            fake_tool:
              answer: ${inherit_from:words.first}
        words: {first: hello}
    """)
    mesh = load_config([path])
    assert set(mesh.instances) == {"base_tool", "copied", "plain_copy", "nested"}
    answers = {name: getattr(inst.settings, "answer", None) for name, inst in mesh.instances.items()}
    assert answers == {"base_tool": "base", "copied": "copied", "plain_copy": "base", "nested": "hello"}
    assert "words" not in mesh.raw


def test_an_inherited_chain_is_refused_as_nemo_gym_does_not_follow_it(write: Writer) -> None:
    """NeMo Gym copies ``second`` as written, its ``_inherit_from: first`` left in ``third`` unexpanded and
    ``first``'s keys lost: ``third`` is no server there (``tests/support/config_file_cases``)."""
    path = write("a.yaml", """
        first:
          resources_servers:
            fake_tool: {answer: one, port: 15311}
        second: {_inherit_from: first, resources_servers: {fake_tool: {answer: two}}}
        third: {_inherit_from: second}
    """)
    with pytest.raises(ConfigError) as caught:
        load_config([path])
    assert (caught.value.file, caught.value.key) == (path, "third")
    assert "_inherit_from second: it is itself a _inherit_from, which NeMo Gym does not follow" in str(caught.value)


@pytest.mark.parametrize(("text", "tree"), [case[1:] for case in MERGES], ids=[case[0] for case in MERGES])
def test_directives_merge_as_nemo_gyms_do(write: Writer, text: str, tree: dict[str, Any]) -> None:
    merged, _ = read_sources([write("a.yaml", text)], [])
    del merged[CONFIG_PATHS]
    assert json.dumps(merged) == json.dumps(tree)  # the order of the keys too


@pytest.mark.parametrize(("text", "key", "message"), [case[1:] for case in REFUSED_MERGES],
                         ids=[case[0] for case in REFUSED_MERGES])
def test_directives_nemo_gym_refuses_or_leaves_unexpanded_are_refused(
        write: Writer, text: str, key: str, message: str) -> None:
    path = write("a.yaml", text)
    with pytest.raises(ConfigError) as caught:
        read_sources([path], [])
    assert (caught.value.file, caught.value.key) == (path, key)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_block_inheriting_a_missing_source_is_a_missing_value(write: Writer) -> None:
    path = write("a.yaml", "base: ???\ntool: {resources_servers: {fake_tool: {_inherit_from: base, answer: x}}}\n")
    with pytest.raises(ConfigError, match=r"key 'tool.resources_servers.fake_tool': required value is missing \("):
        load_config([path])


@pytest.mark.parametrize(("text", "key"), MALFORMED)
def test_a_files_malformed_interpolation_is_refused_naming_the_file_and_key(
        write: Writer, text: str, key: str) -> None:
    path = write("a.yaml", text)
    with pytest.raises(ConfigError) as caught:
        read_sources([path], [])
    assert (caught.value.file, caught.value.key) == (path, key)
    assert "is not a value NeMo Gym's loader (OmegaConf) reads: a malformed ${...}" in str(caught.value)


@pytest.mark.parametrize("text", WELL_FORMED)
def test_a_files_strings_that_nemo_gym_loads_are_read_as_written(write: Writer, text: str) -> None:
    merged, _ = read_sources([write("a.yaml", text)], [])
    del merged[CONFIG_PATHS]
    assert merged == yaml.safe_load(text)


def test_an_error_in_an_inherited_key_names_the_file_that_set_it(write: Writer) -> None:
    base = write("base.yaml", "base_tool:\n  resources_servers:\n    fake_tool: {answer: a, typo: 1}\n")
    top = write("top.yaml", "config_paths: [base.yaml]\ntool: {_inherit_from: base_tool}\n")
    with pytest.raises(ConfigError) as caught:
        load_config([top])
    assert (caught.value.file, caught.value.key) == (base, "tool.resources_servers.fake_tool.typo")


def test_a_moved_agent_takes_the_environment_servers_reference_with_it(write: Writer) -> None:
    path = write("a.yaml", tool("t") + textwrap.dedent("""
        generic_agent:
          responses_api_agents:
            fake_agent:
              resources_server: {type: resources_servers, name: tool}
        my_agent: {_inherit_from: generic_agent}
        env:
          environment_servers:
            legacy_agent:
              agent_server: {type: responses_api_agents, name: generic_agent}
    """))
    mesh = load_config([path])
    assert set(mesh.instances) == {"tool", "my_agent", "env"}
    env = mesh.instance("env").settings
    assert isinstance(env, legacy_app.Config) and env.agent_server.name == "my_agent"


@pytest.mark.parametrize(
    ("text", "key", "message"),
    [("t: {_inherit_from: nowhere.at_all}\n", "t", "_inherit_from names nowhere.at_all, which does not exist"),
     ("t: {_inherit_from: t}\n", "t", "refers back to itself"),
     ("a: {_inherit_from: b}\nb: {_inherit_from: a}\n", "a", "it is itself a _inherit_from"),
     ("t: {_inherit_from: tool, _copy: tool}\n", "t", "not both"),
     ("t: {_copy: tool, _delete_key: 'a,b'}\n", "t._delete_key", "_delete_key is not supported"),
     ("t: {_copy: tool.resources_servers.fake_tool.answer, x: 1}\n", "t", "is not a mapping"),
     ("a1: {_inherit_from: ag}\na2: {_inherit_from: ag}\nag:\n  responses_api_agents:\n    fake_agent: {}\n"
      "env:\n  environment_servers:\n    legacy_agent:\n      agent_server: {name: ag}\n",
      "env.environment_servers.legacy_agent.agent_server.name", "was moved (_inherit_from) to a1, a2")],
)
def test_directive_errors(write: Writer, text: str, key: str, message: str) -> None:
    path = write("a.yaml", tool("x") + text)
    with pytest.raises(ConfigError) as caught:
        load_config([path])
    assert (caught.value.file, caught.value.key) == (path, key)
    assert message in str(caught.value) and "\n" not in str(caught.value)


# ---- top-level keys ------------------------------------------------------------------------------


def test_values_only_interpolations_read_are_kept_out_of_the_mesh(write: Writer) -> None:
    path = write("a.yaml", tool("${policy_name}") + "policy_name: my-model\njudge: {url: x}\nunused: '${judge.url}'\n")
    with pytest.raises(ConfigError, match="unknown top-level key") as caught:
        load_config([path])
    assert caught.value.key == "unused"  # judge is read by ${judge.url}; unused is read by nobody
    path = write("b.yaml", tool("${policy_name}") + "policy_name: my-model\n")
    mesh = load_config([path])
    assert answer_of([path]) == "my-model" and "policy_name" not in mesh.raw


def test_default_host_and_the_port_keys(write: Writer) -> None:
    path = write("a.yaml", tool("x") + tool("y", "pinned").replace("'y'}", "'y', host: 127.0.0.2}")
                 + "default_host: 127.0.0.3\nport_range_low: 14000\nport_range_high: 14010\n"
                 "disallowed_ports: [14001]\n")
    mesh = load_config([path])
    assert mesh.instance("tool").settings.host == "127.0.0.3" and mesh.head_server.host == "127.0.0.3"
    assert mesh.instance("pinned").settings.host == "127.0.0.2"
    assert (mesh.ports.port_range_low, mesh.ports.port_range_high, mesh.ports.disallowed_ports) == (
        14000, 14010, [14001])
    again = load_config_dict(mesh.with_ports({"tool": 14002}).raw)  # what a child is given
    assert again.instance("tool").settings.host == "127.0.0.3" and again.ports == mesh.ports


# ---- NeMo Gym's server keys ----------------------------------------------------------------------


def test_nemo_gyms_server_keys_are_typed(write: Writer) -> None:
    path = write("a.yaml", """
        tool:
          resources_servers:
            fake_tool:
              entrypoint: app.py
              domain: knowledge
              verified: false
              verified_url: null
              description: a tool
              value: it helps
              num_workers: 1
              datasets:
                - {name: train, type: train, license: Apache 2.0, jsonl_fpath: t.jsonl, num_repeats: 2,
                   source: {type: huggingface, repo_id: org/data}}
                - {name: bench, type: benchmark, jsonl_fpath: b.jsonl, prepare_script: prepare.py}
        other:
          resources_servers:
            fake_tool: {entrypoint: other.py}
    """)
    mesh = load_config([path])
    settings = mesh.instance("tool").settings
    assert (settings.domain, settings.description, settings.value) == (Domain.KNOWLEDGE, "a tool", "it helps")
    train, bench = settings.datasets
    assert (train.type, train.license, train.num_repeats, bench.type) == ("train", "Apache 2.0", 2, "benchmark")
    other = mesh.instance("other")
    assert other.module == "resources_servers.fake_tool.other" and isinstance(other.settings, AgentConfig)


def test_an_environment_agent_server_may_leave_its_type_out_but_must_be_an_agent(write: Writer) -> None:
    text = tool("t") + ("a:\n  responses_api_agents:\n    fake_agent:\n"
                        "      resources_server: {type: resources_servers, name: tool}\n")
    path = write("a.yaml", text + "env:\n  environment_servers:\n    legacy_agent:\n      agent_server: {name: a}\n")
    env = load_config([path]).instance("env").settings
    assert isinstance(env, legacy_app.Config) and env.agent_server == ServerRef(type="responses_api_agents", name="a")
    path = write("b.yaml", text + "env:\n  environment_servers:\n    legacy_agent:\n"
                 "      agent_server: {type: resources_servers, name: tool}\n")
    with pytest.raises(ConfigError, match="agent_server must be a responses_api_agents instance") as caught:
        load_config([path])
    assert caught.value.key == "env.environment_servers.legacy_agent.agent_server"


def test_the_legacy_relay_needs_a_resources_server(write: Writer) -> None:
    text = tool("t") + "a:\n  responses_api_agents:\n    fake_agent: {}\n"
    path = write("a.yaml", text + "env:\n  environment_servers:\n    legacy_agent:\n      agent_server: {name: a}\n")
    with pytest.raises(ConfigError, match="agent 'a' names no resources_server") as caught:
        load_config([path])
    assert (caught.value.file, caught.value.key) == (path, "env.environment_servers.legacy_agent")
    explicit = "      resources_server: {type: resources_servers, name: tool}\n"
    env = load_config([write("b.yaml", Path(path).read_text() + explicit)]).instance("env").settings
    assert isinstance(env, legacy_app.Config) and env.resources_server == ServerRef(type="resources_servers",
                                                                                      name="tool")


def test_oc_select_takes_the_value_or_the_default(write: Writer) -> None:
    path = write("a.yaml", tool("${oc.select:judge_url,none-given}")
                 + tool("${oc.select:tool.resources_servers.fake_tool.answer,x}-again", "third")
                 + "other:\n  resources_servers:\n    fake_tool: {entrypoint: other.py, port: '${oc.select:p}'}\n")
    mesh = load_config([path])
    assert answer_of([path]) == "none-given" and answer_of([path], "third") == "none-given-again"
    assert mesh.instance("other").settings.port is None  # no default: null
    assert answer_of([path], overrides=("++judge_url=http://judge",)) == "http://judge"


def test_files_merge_as_nemo_gyms_merge_does(tmp_path: Path) -> None:
    """omegaconf 2.3.1's ``OmegaConf.merge``, which NeMo Gym merges its files with: a later file's ``???``
    keeps the earlier value; a mapping over a list, or a list over a mapping, is refused."""
    from nemo_gym_ckpt.config_sources import read_sources

    base, over = tmp_path / "base.yaml", tmp_path / "over.yaml"
    base.write_text("a: 1\nb: {x: [1]}\n")
    over.write_text("a: ???\nb:\n  x: ???\n  y: ???\n")
    tree, origins = read_sources([base, over], [])
    assert (tree["a"], tree["b"]) == (1, {"x": [1], "y": "???"})
    assert origins[("a",)] == str(base.resolve())
    over.write_text("b: {x: {z: 1}}\n")
    with pytest.raises(ConfigError, match=r"key 'b\.x': a mapping cannot be merged over the list .*base\.yaml gives it"
                       ) as caught:
        read_sources([base, over], [])
    assert caught.value.file == str(over.resolve())
