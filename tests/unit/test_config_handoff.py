"""How a server process gets the resolved config: a private file the launcher writes (never one
environment string, which Linux caps at 128 KiB), and NeMo Gym's own environment variable refused
past that cap with its size."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from nemo_gym_ckpt.bridge.global_config import CONFIG_DICT_ENV, MAX_ENV_STRING_BYTES, nemo_gym_config_env_value
from nemo_gym_ckpt.errors import ConfigError, LaunchError
from nemo_gym_ckpt.launch import config_file
from nemo_gym_ckpt.launch.config_file import ConfigFile, read_config_file

pytestmark = pytest.mark.unit

PROMPT = "x" * (200 << 10)  # a long prompt: more than one environment string may hold
RAW = {"sm": {"resources_servers": {"string_match": {"description": PROMPT, "port": 15000}}},
       "checkpoint": {"enabled": True, "control_auth_token": "secret-token-1234"}}


@pytest.fixture(autouse=True)
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_the_config_is_written_whole_to_a_private_file_and_read_back() -> None:
    handoff = ConfigFile()
    path = handoff.write(RAW)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds the control token
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert read_config_file(str(path)) == RAW
        assert handoff.write({"other": 1}) == path and read_config_file(str(path)) == {"other": 1}
        names = sorted(p.name for p in path.parent.iterdir())
        assert names == sorted([path.name, config_file.LOCK_NAME])  # no temporary file left
    finally:
        handoff.remove()
    assert not path.parent.exists()


def test_a_file_that_is_gone_is_one_config_error_naming_it() -> None:
    handoff = ConfigFile()
    path = handoff.write(RAW)
    handoff.remove()
    with pytest.raises(ConfigError, match=r"cannot read the mesh config .*: No such file or directory") as caught:
        read_config_file(str(path))
    assert str(path) in str(caught.value) and "removes it when it stops" in str(caught.value)


@pytest.mark.parametrize(("content", "message"), [(b"{not json", "is not valid JSON"), (b"[1]", "holds no mapping")])
def test_a_file_that_is_not_a_config_is_one_config_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "mesh.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        read_config_file(str(path))


def test_a_config_over_the_bound_is_refused_by_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_file, "MAX_CONFIG_FILE_BYTES", 1 << 10)
    with pytest.raises(LaunchError, match=r"the resolved config is 204,9\d\d bytes of JSON, over the bound"):
        ConfigFile().write(RAW)


_DIES_HOLDING_ITS_DIRECTORY = (
    "import os, sys; from nemo_gym_ckpt.launch.config_file import ConfigFile; "
    "print(ConfigFile().write({'a': 1}).parent, flush=True); os._exit(0)"  # as if SIGKILLed: no remove
)


def test_the_directory_of_a_launcher_that_is_gone_is_removed_by_the_next(private_tmp: Path) -> None:
    died = subprocess.run([sys.executable, "-c", _DIES_HOLDING_ITS_DIRECTORY], capture_output=True, text=True,
                          check=True, timeout=60, env={**os.environ, "TMPDIR": str(private_tmp)})
    stale = Path(died.stdout.strip())
    assert stale.parent == private_tmp and stale.exists()
    running = ConfigFile()
    live = running.write(RAW).parent
    assert not stale.exists()  # its launcher is gone: its lock with it
    handoff = ConfigFile()
    handoff.write(RAW)
    handoff.remove()
    assert live.exists()  # this one's launcher runs
    running.remove()


def test_a_running_launchers_directory_is_kept_whatever_pid_its_name_carries(private_tmp: Path) -> None:
    """A launcher in another pid namespace (a container sharing the temporary directory) has a pid
    that means nothing here: its lock, not its pid, says it runs."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()
    running = ConfigFile()
    own = running.write(RAW).parent
    elsewhere = own.with_name(f"ngc-mesh-config-{dead}-elsewhere")
    own.rename(elsewhere)  # what a launcher of another pid namespace would have made
    handoff = ConfigFile()
    handoff.write(RAW)
    handoff.remove()
    assert elsewhere.exists()
    running.remove()


def test_a_directory_removed_while_its_launcher_runs_is_made_again(private_tmp: Path) -> None:
    handoff = ConfigFile()
    first = handoff.write(RAW)
    shutil.rmtree(first.parent)  # a temporary-file cleaner, say
    again = handoff.write(RAW)
    assert read_config_file(str(again)) == RAW
    handoff.remove()


# ---- NeMo Gym's servers read it from one environment variable: refused past Linux's cap ----------


def test_nemo_gyms_config_variable_over_linuxs_cap_is_refused_with_its_size() -> None:
    with pytest.raises(ConfigError) as caught:
        nemo_gym_config_env_value(RAW)
    message = str(caught.value)
    assert CONFIG_DICT_ENV in message and f"{MAX_ENV_STRING_BYTES:,}" in message and "E2BIG" in message
    assert "\n" not in message


def test_nemo_gyms_config_variable_under_the_cap_is_what_the_server_can_be_given() -> None:
    raw = {"sm": {"resources_servers": {"string_match": {"description": "x" * 100_000, "port": 15000}}}}
    value = nemo_gym_config_env_value(raw)
    assert "x" * 100_000 in value
    script = f"import os; print(len(os.environ[{CONFIG_DICT_ENV!r}]))"
    done = subprocess.run([sys.executable, "-c", script], env={CONFIG_DICT_ENV: value},
                          capture_output=True, text=True, timeout=30, check=True)  # the kernel takes it
    assert int(done.stdout) == len(value)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's MAX_ARG_STRLEN")
def test_the_cap_is_linuxs() -> None:
    longest = "x" * (MAX_ENV_STRING_BYTES - len(CONFIG_DICT_ENV) - 2)  # NAME=value and its NUL
    command = [sys.executable, "-c", "pass"]
    subprocess.run(command, env={CONFIG_DICT_ENV: longest}, check=True, timeout=30)
    with pytest.raises(OSError, match="Argument list too long"):
        subprocess.run(command, env={CONFIG_DICT_ENV: longest + "x"}, check=True, timeout=30)
