"""The resolved mesh config, handed from the launcher to each server process in a private file.

Linux caps one environment string at 128 KiB (``MAX_ARG_STRLEN``), so a config passed in the
environment made every server's start fail (``E2BIG``) once it held a long prompt. The launcher
writes the resolved config (ports assigned) as JSON to ``mesh.json`` in a directory of its own
(``ConfigFile``: mode 700, the file mode 600, since the config may hold secrets such as the control
token), through a temporary file renamed into place, and names the file in ``CONFIG_FILE_ENV``. A
server process reads it once at start (``read_config_file``): a file that is gone (its launcher
stopped and removed it) or cannot be read is a ``ConfigError`` naming it.

The file is not fsynced: it matters only while its launcher runs. The directory is removed when the
mesh stops; its name carries the launcher's pid, so one left by a launcher that was SIGKILLed is
removed by the next launcher on the host.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from nemo_gym_ckpt.errors import ConfigError, LaunchError

__all__ = ["CONFIG_FILE_ENV", "MAX_CONFIG_FILE_BYTES", "ConfigFile", "read_config_file"]

CONFIG_FILE_ENV = "NEMO_GYM_CKPT_CONFIG_FILE"
MAX_CONFIG_FILE_BYTES = 64 << 20
"""The bound on the resolved config as JSON (config files are at most 4 MiB each, copies bounded)."""
FILE_NAME = "mesh.json"
_PREFIX = "ngc-mesh-config-"
_NEW_PRIVATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)


class ConfigFile:
    """The launcher's private copy of the resolved config for its server processes."""

    def __init__(self) -> None:
        self.directory: Path | None = None

    def write(self, raw: Mapping[str, Any]) -> Path:
        """Write ``raw`` (replacing what was there whole) and return the file's path."""
        data = _encoded(raw)
        if self.directory is None:
            _remove_stale_directories()
            self.directory = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-"))
        path = self.directory / FILE_NAME
        temp = path.with_suffix(".tmp")
        fd = os.open(temp, _NEW_PRIVATE, 0o600)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            os.rename(temp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        return path

    def remove(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


def _encoded(raw: Mapping[str, Any]) -> bytes:
    try:
        data = orjson.dumps(raw, option=orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError as error:
        raise LaunchError(f"the resolved config cannot be handed to the servers as JSON: {error}") from None
    if len(data) > MAX_CONFIG_FILE_BYTES:
        raise LaunchError(f"the resolved config is {len(data):,} bytes of JSON, over the bound of "
                          f"{MAX_CONFIG_FILE_BYTES >> 20} MiB")
    return data


def _remove_stale_directories() -> None:
    """The directories of launchers that are gone (a SIGKILLed one cannot remove its own)."""
    for stale in Path(tempfile.gettempdir()).glob(f"{_PREFIX}*"):
        pid = stale.name.removeprefix(_PREFIX).partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def read_config_file(path: str) -> dict[str, Any]:
    """The resolved config in the file ``path`` (``ConfigError`` if gone, unreadable, too large or not JSON)."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_CONFIG_FILE_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"cannot read the mesh config {path}: {error.strerror} (the launcher that started "
                          "this server removes it when it stops)") from None
    if len(data) > MAX_CONFIG_FILE_BYTES:
        raise ConfigError(f"the mesh config {path} is over {MAX_CONFIG_FILE_BYTES >> 20} MiB")
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as error:
        raise ConfigError(f"the mesh config {path} is not valid JSON: {error}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"the mesh config {path} holds no mapping")
    return raw
