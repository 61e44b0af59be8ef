"""Fixtures of the tests/ tiers: real meshes of processes (``root`` and ``serve_app``, shared with the
server folders' tests, are in the repository's top ``conftest.py``).

- ``launch_mesh(*configs, overrides=...) -> MeshLauncher``: a started mesh from YAML (files under
  ``tests/fixtures/`` by bare name), head server on a free port; stopped after the test, and the
  test fails if a server process outlives the stop.
- ``FIXTURES``: the folder of test configs. To wait for a URL's ``/health`` with a deadline, use
  ``nemo_gym_ckpt.launch.launcher.wait_for_health(url, timeout_s=...)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_ckpt.config import load_config
from nemo_gym_ckpt.launch.launcher import MeshLauncher

FIXTURES = Path(__file__).parent / "fixtures"


def fixture_path(config: str | Path) -> str:
    path = Path(config)
    return str(path if path.is_absolute() or path.exists() else FIXTURES / path)


@pytest.fixture
def launch_mesh() -> Iterator[Callable[..., MeshLauncher]]:
    launchers: list[MeshLauncher] = []

    def launch(
        *configs: str | Path, overrides: Sequence[str] = (), ready_timeout_s: float = 30.0, **kwargs: Any
    ) -> MeshLauncher:
        mesh = load_config([fixture_path(c) for c in configs], ["head_server.port=0", *overrides])
        launcher = MeshLauncher(mesh, **kwargs)
        launcher.start(ready_timeout_s=ready_timeout_s)
        launchers.append(launcher)
        return launcher

    yield launch
    pids = [pid for launcher in launchers for pid in launcher.pids.values()]
    for launcher in launchers:
        launcher.stop()
    survivors = [pid for pid in pids if _pid_alive(pid)]
    assert not survivors, f"server processes outlived the launcher's stop: {survivors}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
