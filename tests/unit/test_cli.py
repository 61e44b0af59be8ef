"""The ``nemo-gym-ckpt`` command: lazy dispatch, exit statuses, one-line errors."""

from __future__ import annotations

import argparse
import importlib
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import nemo_gym_ckpt
from nemo_gym_ckpt import cli
from nemo_gym_ckpt.cli.arguments import head_url, seconds
from nemo_gym_ckpt.cli.run import print_line, split_items
from nemo_gym_ckpt.config import PROJECT_ROOT
from nemo_gym_ckpt.errors import ConfigError

pytestmark = pytest.mark.unit


def _command_module(name: str, result: int | Exception) -> tuple[types.ModuleType, list[argparse.Namespace]]:
    """A subcommand module as the CLI sees it: ``configure(parser)`` and ``main(args) -> int``."""
    module = types.ModuleType(name)
    seen: list[argparse.Namespace] = []

    def configure(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("target")
        parser.add_argument("--times", type=int, default=1)

    def main(args: argparse.Namespace) -> int:
        seen.append(args)
        if isinstance(result, Exception):
            raise result
        return result

    module.configure = configure  # type: ignore[attr-defined]
    module.main = main  # type: ignore[attr-defined]
    return module, seen


AddCommand = Callable[..., None]
Capture = pytest.CaptureFixture[str]


@pytest.fixture
def add_command(monkeypatch: pytest.MonkeyPatch) -> AddCommand:
    def add(name: str, module_name: str, module: types.ModuleType | None = None) -> None:
        monkeypatch.setitem(cli.COMMANDS, name, cli.Command(module_name, f"the {name} command"))
        if module is not None:
            monkeypatch.setitem(sys.modules, module_name, module)

    return add


def test_every_fixed_command_is_listed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(["--help"])
    assert caught.value.code == 0
    out = capsys.readouterr().out
    for name in ("run", "collect", "checkpoint", "bench", "demo"):
        assert f"  {name} " in out
    assert {name: command.module for name, command in cli.COMMANDS.items()} == {
        name: f"nemo_gym_ckpt.cli.{name}" for name in ("run", "collect", "checkpoint", "bench", "demo")
    }


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_command_module_declares_configure_and_main(name: str) -> None:
    module = importlib.import_module(cli.COMMANDS[name].module)
    assert callable(module.configure) and callable(module.main)


@pytest.mark.parametrize("argv", [[], ["no-such-command"], ["run"], ["run", "--bogus", "x.yaml"]])
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(argv)
    assert caught.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_dispatch_parses_with_the_commands_own_parser(add_command: AddCommand) -> None:
    module, seen = _command_module("ngc_test_cmd_ok", 3)
    add_command("probe", "ngc_test_cmd_ok", module)
    assert cli.main(["probe", "there", "--times", "4"]) == 3
    assert [(args.target, args.times) for args in seen] == [("there", 4)]


def test_a_config_error_is_one_line_and_exit_2(add_command: AddCommand, capsys: Capture) -> None:
    module, _ = _command_module("ngc_test_cmd_config", ConfigError("bad value", file="m.yaml", key="a.b"))
    add_command("probe", "ngc_test_cmd_config", module)
    assert cli.main(["probe", "x"]) == 2
    assert capsys.readouterr().err == "nemo-gym-ckpt: config error: m.yaml, key 'a.b': bad value\n"


def test_a_missing_dependency_of_a_command_is_not_hidden(
    add_command: AddCommand, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ngc_test_cmd_broken.py").write_text("import ngc_test_dependency_that_is_absent\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    add_command("broken", "ngc_test_cmd_broken")
    with pytest.raises(ModuleNotFoundError, match="ngc_test_dependency_that_is_absent"):
        cli.main(["broken"])


def test_run_reports_a_config_error_on_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "mesh.yaml"
    path.write_text("sm:\n  resources_servers:\n    string_match: {mood: exact}\n")
    assert cli.main(["run", str(path), "head_server.port=0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("nemo-gym-ckpt: config error: ")
    assert str(path) in err and "key 'sm.resources_servers.string_match.mood'" in err and "unknown key" in err


def test_run_arguments_split_configs_from_overrides() -> None:
    assert split_items(["a.yaml", "x.y=1", "b.yml", "+z=[1]"]) == (["a.yaml", "b.yml"], ["x.y=1", "+z=[1]"])


def test_the_public_api_is_exactly_all() -> None:
    for name in nemo_gym_ckpt.__all__:
        assert getattr(nemo_gym_ckpt, name) is not None, name
    assert set(nemo_gym_ckpt.__all__) <= set(dir(nemo_gym_ckpt))
    with pytest.raises(AttributeError):
        _ = nemo_gym_ckpt.not_a_public_name  # type: ignore[attr-defined]
    from nemo_gym_ckpt.launch.launcher import MeshLauncher

    assert nemo_gym_ckpt.MeshLauncher is MeshLauncher


def test_run_prefixes_each_server_line_with_its_name(capsys: pytest.CaptureFixture[str]) -> None:
    print_line("policy_model", "INFO uvicorn: started")
    print_line("sm", "")
    assert capsys.readouterr().out == "[policy_model] INFO uvicorn: started\n[sm] \n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["configs/quickstart.yaml", "head_server.port=" + "9" * 5_000], "int of 5,000 characters"),
     (["configs/quickstart.yaml", "head_server.port=int(1e400)"], "int() at column 1: cannot convert float infinity"),
     (["a" * 300 + ".yaml"], "cannot be looked for: File name too long"),
     (["~ngc-no-such-user-5a1c/mesh.yaml"], "cannot be found: no home directory for")],
    ids=["5,000-digit port", "unbuildable int", "name over NAME_MAX", "~user of no user"],
)
def test_run_reports_a_scalar_or_a_path_it_cannot_use_on_one_line(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(PROJECT_ROOT)  # were tracebacks (ValueError, OSError, RuntimeError)
    assert cli.main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nemo-gym-ckpt: config error: ") and message in err


def _command_parser(name: str) -> argparse.ArgumentParser:
    """The parser ``cli.main`` builds for command ``name``."""
    parser = argparse.ArgumentParser(prog=f"{cli.PROG} {name}")
    importlib.import_module(cli.COMMANDS[name].module).configure(parser)
    return parser


def _options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """Every option of ``parser`` and of its subcommands (``checkpoint status``, ...)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _options(sub)
        elif action.option_strings:
            yield action


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_duration_flag_of_every_command_is_a_bounded_duration(name: str) -> None:
    """A flag in seconds (``..._s``) takes only ``arguments.seconds``: never a bare float, which takes
    ``inf`` and ``nan`` (deadlines never reached) and any negative number."""
    options = list(_options(_command_parser(name)))
    durations = {action.option_strings[0]: action.type for action in options if action.dest.endswith("_s")}
    assert durations and all(kind is seconds for kind in durations.values()), durations
    assert [action.option_strings for action in options if action.type is float] == []


DURATION_FLAGS = [
    ("run", ["mesh.yaml"], "--ready-timeout-s"),
    ("checkpoint", ["status", "--head", "http://127.0.0.1:1"], "--timeout-s"),
    ("checkpoint", ["prepare", "--id", "c1", "--head", "http://127.0.0.1:1"], "--timeout-s"),
    ("bench", [], "--duration-s"),
    ("demo", [], "--ready-timeout-s"),
]


@pytest.mark.parametrize(("name", "argv", "flag"), DURATION_FLAGS)
@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "-1", "0", "1e9", "1e308"])
def test_a_duration_flag_refuses_what_is_not_a_bounded_duration(
    name: str, argv: list[str], flag: str, value: str, capsys: Capture
) -> None:
    parser = _command_parser(name)
    with pytest.raises(SystemExit) as caught:  # `run --ready-timeout-s nan` waited for ever
        parser.parse_args([*argv, f"{flag}={value}"])
    assert caught.value.code == 2
    assert f"argument {flag}: must be more than 0 and at most 3.1536e+07 seconds" in capsys.readouterr().err
    assert getattr(parser.parse_args([*argv, f"{flag}=2.5"]), flag[2:].replace("-", "_")) == 2.5


@pytest.mark.parametrize("url", ["http://[::1", "notaurl", "ftp://127.0.0.1:1", "http://", "http://127.0.0.1:99999",
                                 "http://127.0.0.1:0"])
def test_a_bad_head_url_is_a_usage_error_on_one_line(
    url: str, capsys: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``checkpoint status --head 'http://[::1'`` ended in an httpx traceback; a URL without a scheme
    or host failed only once sent (exit 1)."""
    monkeypatch.setenv("GYM_CKPT_TOKEN", "t" * 32)
    with pytest.raises(SystemExit) as caught:
        cli.main(["checkpoint", "status", "--head", url])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: nemo-gym-ckpt checkpoint status ")  # argparse's usage, then one line
    assert err.splitlines()[-1].startswith(f"nemo-gym-ckpt checkpoint status: error: argument --head: {url!r} ")


def test_collect_refuses_a_bad_head_url_too(capsys: Capture) -> None:
    with pytest.raises(SystemExit) as caught:
        _command_parser("collect").parse_args(["--output", "o.jsonl", "--head", "http://[::1"])
    assert caught.value.code == 2
    assert "argument --head: 'http://[::1' is not a URL: Invalid port" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["http://127.0.0.1:11000", "https://head.example:8443/", "http://[::1]:11000"])
def test_a_head_url_is_taken_as_written(url: str) -> None:
    assert head_url(url) == url
