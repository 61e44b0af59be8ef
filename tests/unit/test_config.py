"""Config loading in NeMo Gym's shape: merge, config_paths, directives, interpolation, overrides,
typed validation, old keys refused, and one-line errors."""

from __future__ import annotations

import sys
import textwrap
import types
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from nemo_gym_ckpt.config import (
    PROJECT_ROOT,
    ServerConfig,
    ServerRef,
    load_config,
    load_config_dict,
    parse_overrides,
)
from nemo_gym_ckpt.errors import ConfigError

pytestmark = pytest.mark.unit


def _implementation(name: str, config: type[ServerConfig]) -> types.ModuleType:
    """An ``app`` module as config.py finds it: a module object declaring ``Config(ServerConfig)``."""
    module = types.ModuleType(name)
    module.Config = config
    return module


class ToolConfig(ServerConfig):
    answer: str
    retries: int = 3


class AgentConfig(ServerConfig):
    resources_server: ServerRef
    max_steps: int = 8


@pytest.fixture(autouse=True)
def fake_implementations(monkeypatch: pytest.MonkeyPatch) -> None:
    """``resources_servers/fake_tool`` and ``agents/fake_agent``, without folders on disk."""
    tool = _implementation("resources_servers.fake_tool.app", ToolConfig)
    agent = _implementation("agents.fake_agent.app", AgentConfig)
    monkeypatch.setitem(sys.modules, "resources_servers.fake_tool.app", tool)
    monkeypatch.setitem(sys.modules, "agents.fake_agent.app", agent)


Writer = Callable[[str, str], str]


@pytest.fixture
def write(tmp_path: Path) -> Writer:
    def write(name: str, text: str) -> str:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return str(path)

    return write


MESH = """
    tool:
      resources_servers:
        fake_tool:
          entrypoint: app.py
          domain: math
          answer: "42"
    agent:
      responses_api_agents:
        fake_agent:
          resources_server: {type: resources_servers, name: tool}
"""


def test_a_valid_mesh_is_typed(write: Writer) -> None:
    mesh = load_config([write("a.yaml", MESH)])
    assert list(mesh.instances) == ["tool", "agent"]
    tool = mesh.instance("tool")
    assert isinstance(tool.settings, ToolConfig)
    assert (tool.type, tool.implementation, tool.module) == ("resources_servers", "fake_tool",
                                                              "resources_servers.fake_tool.app")
    assert tool.settings.answer == "42" and tool.settings.retries == 3 and tool.settings.port is None
    agent = mesh.instance("agent").settings
    assert isinstance(agent, AgentConfig)
    assert agent.resources_server == ServerRef(type="resources_servers", name="tool")
    assert mesh.head_url == "http://127.0.0.1:11000"
    assert not mesh.checkpoint.enabled
    assert mesh.instance("agent").module == "agents.fake_agent.app"  # responses_api_agents live in agents/
    assert mesh.instance("agent").folder == "agents/fake_agent"


def test_later_files_win_and_nested_blocks_merge(write: Writer) -> None:
    first = write("a.yaml", MESH)
    second = write("b.yaml", """
        tool:
          resources_servers:
            fake_tool:
              retries: 5
        head_server: {port: 12000}
    """)
    mesh = load_config([first, second])
    settings = mesh.instance("tool").settings
    assert isinstance(settings, ToolConfig)
    assert (settings.answer, settings.retries) == ("42", 5)
    assert mesh.head_server.port == 12000
    assert load_config([second, first]).head_server.port == 12000
    third = write("c.yaml", "head_server: {port: 13000}\n")
    assert load_config([first, second, third]).head_server.port == 13000


def test_interpolation_keeps_types_and_formats_strings(write: Writer) -> None:
    path = write("a.yaml", MESH + """
    tries: 7
    word: forty
    tool_extra:
      resources_servers:
        fake_tool:
          answer: "${word}-two"
          retries: ${tries}
          datasets:
            - {name: d, type: example, jsonl_fpath: "data/${tool_extra.resources_servers.fake_tool.answer}.jsonl"}
    """)
    settings = load_config([path]).instance("tool_extra").settings
    assert isinstance(settings, ToolConfig)
    assert (settings.answer, settings.retries) == ("forty-two", 7)
    assert settings.datasets[0].jsonl_fpath == Path("data/forty-two.jsonl")


def test_env_interpolation_with_and_without_default(write: Writer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NG_TEST_ANSWER", "from-env")
    monkeypatch.delenv("NG_TEST_UNSET", raising=False)
    path = write("a.yaml", MESH + """
    env_tool:
      resources_servers:
        fake_tool:
          answer: ${oc.env:NG_TEST_ANSWER}
          retries: ${oc.env:NG_TEST_UNSET,9}
    """)
    settings = load_config([path]).instance("env_tool").settings
    assert isinstance(settings, ToolConfig)
    assert (settings.answer, settings.retries) == ("from-env", 9)
    monkeypatch.setenv("NG_TEST_UNSET", "4")
    settings = load_config([path]).instance("env_tool").settings
    assert isinstance(settings, ToolConfig) and settings.retries == 4


def test_overrides_win_over_files_and_add_keys(write: Writer) -> None:
    path = write("a.yaml", MESH)
    mesh = load_config([path], ["tool.resources_servers.fake_tool.retries=11", "+head_server.port=0",
                                "++agent.responses_api_agents.fake_agent.port=15001"])
    settings = mesh.instance("tool").settings
    assert isinstance(settings, ToolConfig) and settings.retries == 11
    assert mesh.head_server.port == 0
    assert mesh.url_of("agent") == "http://127.0.0.1:15001"


def test_an_override_fills_an_empty_block(write: Writer) -> None:
    path = write("a.yaml", """
        tool:
          resources_servers:
            fake_tool:
    """)
    mesh = load_config([path], ["tool.resources_servers.fake_tool.answer=given"])
    settings = mesh.instance("tool").settings
    assert isinstance(settings, ToolConfig) and settings.answer == "given"


def test_parse_overrides_reads_values_as_hydra_does() -> None:
    assert parse_overrides(["a.b=1", "+c=[1, 2]", "d=text", "e=", "f='x=y'", "++g.h=true"]) == [
        (("a", "b"), 1), (("c",), [1, 2]), (("d",), "text"), (("e",), ""), (("f",), "x=y"), (("g", "h"), True),
    ]


def test_with_ports_round_trips_through_the_raw_dict(write: Writer) -> None:
    mesh = load_config([write("a.yaml", MESH)])
    placed = mesh.with_ports({"tool": 15010, "agent": 15011}, head_port=15012)
    assert placed.url_of("tool") == "http://127.0.0.1:15010"
    assert placed.head_url == "http://127.0.0.1:15012"
    again = load_config_dict(placed.raw)
    assert again.url_of("agent") == "http://127.0.0.1:15011"
    assert mesh.instance("tool").settings.port is None, "with_ports must not change the original"


def test_an_ipv6_host_is_written_in_brackets_in_every_url(write: Writer) -> None:
    mesh = load_config([write("a.yaml", MESH)], ["+default_host=::1"]).with_ports({"tool": 15010}, head_port=15012)
    assert (mesh.url_of("tool"), mesh.head_url) == ("http://[::1]:15010", "http://[::1]:15012")
    assert httpx.URL(mesh.url_of("tool")).host == "::1"  # a URL the client can use


def test_a_real_implementation_validates_its_block(write: Writer) -> None:
    path = write("sm.yaml", """
        sm:
          resources_servers:
            string_match: {entrypoint: app.py, domain: knowledge, mode: substring}
    """)
    assert load_config([path]).instance("sm").settings.mode == "substring"
    with pytest.raises(ConfigError, match=r"key 'sm\.resources_servers\.string_match\.mode'"):
        load_config([path], ["sm.resources_servers.string_match.mode=fuzzy"])


# ---- errors: each names the file and the key, on one line ----------------------------------------

ERROR_CASES = {
    "unknown key": (
        "tool:\n  resources_servers:\n    fake_tool: {answer: a, retires: 2}\n",
        [], "tool.resources_servers.fake_tool.retires", "unknown key",
    ),
    "wrong value type": (
        "tool:\n  resources_servers:\n    fake_tool: {answer: a, retries: many}\n",
        [], "tool.resources_servers.fake_tool.retries", "integer",
    ),
    "required field missing": (
        "tool:\n  resources_servers:\n    fake_tool: {}\n",
        [], "tool.resources_servers.fake_tool.answer", "required value is missing",
    ),
    "??? left in place": (
        "tool:\n  resources_servers:\n    fake_tool: {answer: '???'}\n",
        [], "tool.resources_servers.fake_tool.answer",
        "required value is missing (???): set it, e.g. ++tool.resources_servers.fake_tool.answer=<value>",
    ),
    "reference to a missing server": (
        "agent:\n  responses_api_agents:\n    fake_agent:\n"
        "      resources_server: {type: resources_servers, name: nope}\n",
        [], "agent.responses_api_agents.fake_agent.resources_server", "'nope', which is not defined",
    ),
    "reference of the wrong type": (
        "tool:\n  resources_servers:\n    fake_tool: {answer: a}\n"
        "agent:\n  responses_api_agents:\n    fake_agent:\n"
        "      resources_server: {type: responses_api_agents, name: tool}\n",
        [], "agent.responses_api_agents.fake_agent.resources_server",
        "as responses_api_agents, but it is resources_servers",
    ),
    "wrong server type key": (
        "tool:\n  resources_servers:\n    fake_tool: {answer: a}\n  resource_servers: {}\n",
        [], "tool", "expected exactly one server type key",
    ),
    "a mapping without a type key": (
        "tool:\n  resource_servers:\n    fake_tool: {answer: a}\n",
        [], "tool", "unknown top-level key: expected a server instance",
    ),
    "an unknown top-level scalar": (
        "tool:\n  resources_servers:\n    fake_tool: {answer: a}\nchekpoint: true\n",
        [], "chekpoint", "unknown top-level key",
    ),
    "a NeMo Gym launcher key": (
        "tool:\n  resources_servers:\n    fake_tool: {answer: a}\ndry_run: false\n",
        [], "dry_run", "a NeMo Gym launcher setting that this launcher does not take",
    ),
    "the old model type key": (
        "model:\n  model_servers:\n    policy_model: {}\n",
        [], "model.model_servers", "'model_servers' is the old type key: write 'responses_api_models'",
    ),
    "the old agent type key": (
        "agent:\n  agents:\n    fake_agent: {}\n",
        [], "agent.agents", "'agents' is the old type key: write 'responses_api_agents'",
    ),
    "an old reference type": (
        "tool:\n  resources_servers:\n    fake_tool: {answer: a}\n"
        "agent:\n  responses_api_agents:\n    fake_agent:\n      resources_server: {type: agents, name: tool}\n",
        [], "agent.responses_api_agents.fake_agent.resources_server.type",
        "reference type 'agents' is the old type key: write type: responses_api_agents",
    ),
    "an environment's old agent key": (
        "env:\n  environment_servers:\n    single_agent_turn:\n"
        "      agent: {type: responses_api_agents, name: a}\n",
        [], "env.environment_servers.single_agent_turn.agent", "'agent' is now 'agent_server'",
    ),
    "an environment's old timeout key": (
        "env:\n  environment_servers:\n    nim:\n      episode_timeout_s: 5\n",
        [], "env.environment_servers.nim.episode_timeout_s", "'episode_timeout_s' is now "
        "'default_episode_timeout_seconds'",
    ),
    "an entrypoint outside the folder": (
        "tool:\n  resources_servers:\n    fake_tool: {answer: a, entrypoint: ../app.py}\n",
        [], "tool.resources_servers.fake_tool.entrypoint",
        "expected a .py file inside the implementation folder",
    ),
    "an entrypoint that is not there": (
        "sm:\n  resources_servers:\n    string_match: {entrypoint: main.py}\n",
        [], "sm.resources_servers.string_match.entrypoint",
        "no entrypoint main.py in resources_servers/string_match/",
    ),
    "a domain NeMo Gym does not know": (
        "tool:\n  resources_servers:\n    fake_tool: {answer: a, domain: cooking}\n",
        [], "tool.resources_servers.fake_tool.domain", "'math'",
    ),
    "a train dataset without a license": (
        "tool:\n  resources_servers:\n    fake_tool:\n      answer: a\n"
        "      datasets: [{name: d, type: train, jsonl_fpath: d.jsonl}]\n",
        [], "tool.resources_servers.fake_tool.datasets.0", "a train dataset needs a license",
    ),
    "a dataset without a type": (
        "tool:\n  resources_servers:\n    fake_tool:\n      answer: a\n"
        "      datasets: [{name: d, jsonl_fpath: d.jsonl}]\n",
        [], "tool.resources_servers.fake_tool.datasets.0.type", "required value is missing",
    ),
    "a license NeMo Gym does not list": (
        "tool:\n  resources_servers:\n    fake_tool:\n      answer: a\n"
        "      datasets: [{name: d, type: example, license: WTFPL, jsonl_fpath: d.jsonl}]\n",
        [], "tool.resources_servers.fake_tool.datasets.0.license", "'Apache 2.0'",
    ),
    "more worker processes than the bound": (
        "tool:\n  resources_servers:\n    fake_tool: {answer: a, num_workers: 65}\n",
        [], "tool.resources_servers.fake_tool.num_workers", "less than or equal to 64",
    ),
    "worker processes on a model server": (
        "w:\n  responses_api_models:\n    inference_worker: {num_workers: 2}\n",
        [], "w.responses_api_models.inference_worker.num_workers", "refused on a model server",
    ),
    "worker processes on a NeMo Gym package server": (
        "t:\n  resources_servers:\n    string_match: {package: nemo_gym, domain: other, num_workers: 2}\n",
        [], "t.resources_servers.string_match.num_workers", "refused on a nemo_gym package server",
    ),
    "an episode queue": (
        "env:\n  environment_servers:\n    nim:\n      agent_server: {name: a}\n      max_concurrent_episodes: 4\n"
        "      queue_timeout_seconds: 1\na:\n  responses_api_agents:\n    fake_agent:\n"
        "      resources_server: {type: resources_servers, name: t}\nt:\n  resources_servers:\n"
        "    fake_tool: {answer: x}\n",
        [], "env.environment_servers.nim", "NeMo Gym's episode queue",
    ),
    "a port range upside down": (
        "port_range_low: 15000\nport_range_high: 14000\ntool:\n  resources_servers:\n    fake_tool: {answer: a}\n",
        [], "port_range_high", "port_range_low 15000 is above port_range_high 14000",
    ),
    "unknown implementation": (
        "tool:\n  resources_servers:\n    no_such_impl_here: {}\n",
        [], "tool.resources_servers.no_such_impl_here", "unknown implementation",
    ),
    "unset environment variable": (
        "tool:\n  resources_servers:\n    fake_tool: {answer: '${oc.env:NG_TEST_NEVER_SET}'}\n",
        [], "tool.resources_servers.fake_tool.answer", "NG_TEST_NEVER_SET is not set",
    ),
    "interpolation of a missing key": (
        "tool:\n  resources_servers:\n    fake_tool: {answer: '${nowhere.at_all}'}\n",
        [], "tool.resources_servers.fake_tool.answer", "refers to a key that does not exist",
    ),
    "interpolation cycle": (
        "a: ${b}\nb: ${a}\ntool:\n  resources_servers:\n    fake_tool: {answer: x}\n",
        [], "a", "interpolation cycle",
    ),
    "two servers on one port": (
        "tool:\n  resources_servers:\n    fake_tool: {answer: a, port: 15100}\n"
        "tool2:\n  resources_servers:\n    fake_tool: {answer: b, port: 15100}\n",
        [], "tool2.resources_servers.fake_tool.port", "also the port of tool",
    ),
    "a server on the head port": (
        "head_server: {port: 15200}\ntool:\n  resources_servers:\n    fake_tool: {answer: a, port: 15200}\n",
        [], "tool.resources_servers.fake_tool.port", "also the port of head_server",
    ),
    "bad head server block": (
        "head_server: {port: 99999}\ntool:\n  resources_servers:\n    fake_tool: {answer: a}\n",
        [], "head_server.port", "65535",
    ),
    "a head server that is not a mapping": (
        "head_server: localhost\ntool:\n  resources_servers:\n    fake_tool: {answer: a}\n",
        [], "head_server", "expected a mapping of settings, got a str: 'localhost'",
    ),
    "settings that are a list": (
        "tool:\n  resources_servers:\n    fake_tool: [answer, a]\n",
        [], "tool.resources_servers.fake_tool", "expected a mapping of settings, got a list",
    ),
    "checkpointing without a token": (
        "checkpoint: {enabled: true}\ntool:\n  resources_servers:\n    fake_tool: {answer: a}\n",
        [], "checkpoint", "control_auth_token is required",
    ),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_config_errors_name_file_and_key_on_one_line(
    case: str, write: Writer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NG_TEST_NEVER_SET", raising=False)
    text, overrides, key, message = ERROR_CASES[case]
    path = write("mesh.yaml", text)
    with pytest.raises(ConfigError) as caught:
        load_config([path], overrides)
    error = caught.value
    assert (error.file, error.key) == (path, key)
    assert message in str(error) and f"key '{key}'" in str(error) and path in str(error)
    assert "\n" not in str(error)


def test_an_error_set_on_the_command_line_names_the_command_line(write: Writer) -> None:
    path = write("a.yaml", MESH)
    with pytest.raises(ConfigError) as caught:
        load_config([path], ["tool.resources_servers.fake_tool.typo=1"])
    assert caught.value.file == "<command line>"
    assert caught.value.key == "tool.resources_servers.fake_tool.typo"


def test_the_file_that_set_the_bad_value_is_named(write: Writer) -> None:
    base = write("base.yaml", MESH)
    bad = write("bad.yaml", "tool:\n  resources_servers:\n    fake_tool: {retries: lots}\n")
    with pytest.raises(ConfigError) as caught:
        load_config([base, bad])
    assert caught.value.file == bad


def test_a_required_value_can_be_supplied_by_override(write: Writer) -> None:
    path = write("a.yaml", "tool:\n  resources_servers:\n    fake_tool: {answer: '???'}\n")
    mesh = load_config([path], ["tool.resources_servers.fake_tool.answer=given"])
    assert mesh.instance("tool").settings.answer == "given"


@pytest.mark.parametrize(
    ("text", "message"),
    [("a: [1, 2\n", "not valid YAML"), ("- 1\n- 2\n", "expected a mapping at the top level"),
     ("head_server: {port: 1}\n", "defines no server instance")],
)
def test_file_level_errors(text: str, message: str, write: Writer) -> None:
    path = write("bad.yaml", text)
    with pytest.raises(ConfigError, match=message) as caught:
        load_config([path])
    assert "\n" not in str(caught.value)


def test_missing_file_and_no_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="file not found") as caught:
        load_config([missing])
    assert caught.value.file == missing
    with pytest.raises(ConfigError, match="no config file"):
        load_config([])


@pytest.mark.parametrize("item", ["novalue", "=1", "a..b=1", "+=2", "~a.b"])
def test_malformed_overrides(item: str) -> None:
    with pytest.raises(ConfigError, match=r"is not key=value|deleting a key|is not a key NeMo Gym's Hydra") as caught:
        parse_overrides([item])
    assert caught.value.file == "<command line>"


QUICKSTART = str(PROJECT_ROOT / "configs" / "quickstart.yaml")


@pytest.mark.parametrize("value", ["1e-9", "0.09", "0", "-1", ".nan", ".inf", "3601"])
def test_the_metrics_export_interval_is_a_tenth_of_a_second_to_an_hour(value: str) -> None:
    """1e-9 s was taken: the SDK's reader then exported in a busy loop."""
    with pytest.raises(ConfigError, match=r"key 'telemetry\.metrics_export_interval_s'"):
        load_config([QUICKSTART], [f"+telemetry.metrics_export_interval_s={value}"])


@pytest.mark.parametrize("value", ["0.1", "10", "3600"])
def test_a_metrics_export_interval_within_its_bounds_loads(value: str) -> None:
    mesh = load_config([QUICKSTART], [f"+telemetry.metrics_export_interval_s={value}"])
    assert mesh.telemetry.metrics_export_interval_s == float(value)
