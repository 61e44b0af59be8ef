"""The resolved mesh config, handed from the launcher to each server process in a private file.

Linux caps one environment string at 128 KiB (``MAX_ARG_STRLEN``), so a config passed in the
environment made every server's start fail (``E2BIG``) once it held a long prompt. The launcher
writes the resolved config (ports assigned) as JSON to ``mesh.json`` in a directory of its own
(``ConfigFile``: mode 700, the file mode 600, since the config may hold secrets such as the control
token), through a temporary file renamed into place, and names the file in ``CONFIG_FILE_ENV``. A
server process reads it once at start (``read_config_file``): a file that is gone (its launcher
stopped and removed it) or cannot be read is a ``ConfigError`` naming it.

The file is not fsynced: it matters only while its launcher runs. The directory is removed when the
mesh stops. While its launcher runs, the launcher holds an exclusive ``flock`` on the directory's
``LOCK_NAME`` file; a directory whose lock a later launcher can take (its launcher is gone, however it
died: the kernel drops the lock with the process) is removed by that launcher. A lock, not a pid:
launchers in other pid namespaces (containers) sharing this temporary directory see each other's
locks but not each other's pids. A directory gone while its launcher still runs (a temporary-file
cleaner) is made again at the next write.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
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
LOCK_NAME = "launcher.lock"
_UNLOCKED_GRACE_S = 3600.0
"""A directory without its lock file (a launcher killed between making it and locking it) is left
this long before a sweep removes it."""
_PREFIX = "ngc-mesh-config-"
_NEW_PRIVATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)


class ConfigFile:
    """The launcher's private copy of the resolved config for its server processes."""

    def __init__(self) -> None:
        self.directory: Path | None = None
        self._lock_fd: int | None = None

    def write(self, raw: Mapping[str, Any]) -> Path:
        """Write ``raw`` (replacing what was there whole) and return the file's path."""
        data = _encoded(raw)
        try:
            return self._write(data)
        except OSError as error:
            raise LaunchError(f"cannot write the mesh config for the servers: {error}") from None

    def _write(self, data: bytes) -> Path:
        if self.directory is None or not self.directory.is_dir():
            self._make_directory()
        assert self.directory is not None
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

    def _make_directory(self) -> None:
        """A new private directory, locked for as long as this launcher runs (``remove`` unlocks)."""
        self.remove()
        _remove_stale_directories()
        directory = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-"))
        fd = os.open(directory / LOCK_NAME, _NEW_PRIVATE, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new, so no one else holds it
        self.directory, self._lock_fd = directory, fd

    def remove(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


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
    """The directories of launchers that are gone (a SIGKILLed one cannot remove its own): those whose
    lock can be taken, and those never locked that are older than ``_UNLOCKED_GRACE_S``."""
    for directory in Path(tempfile.gettempdir()).glob(f"{_PREFIX}*"):
        with contextlib.suppress(OSError):  # another user's, or removed meanwhile: not ours to judge
            _remove_if_stale(directory)


def _remove_if_stale(directory: Path) -> None:
    try:
        fd = os.open(directory / LOCK_NAME, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        if time.time() - directory.stat().st_mtime > _UNLOCKED_GRACE_S:
            shutil.rmtree(directory, ignore_errors=True)
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # its launcher runs
        shutil.rmtree(directory, ignore_errors=True)
    finally:
        os.close(fd)


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
