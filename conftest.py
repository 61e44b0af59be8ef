"""Fixtures shared by every test of the repository (tests/ and the server folders' tests/).

- ``root``: an empty ``checkpoints`` folder of the test's own, the ``checkpoint.root`` of its mesh.
- ``serve_app(app) -> url``: a real uvicorn server for an ASGI app, on a free 127.0.0.1 port, up
  (readiness waited for) before it returns and stopped after the test.

Under pytest-xdist (the default ``-n 2 --dist loadfile``) each worker launches meshes from its own
slice of the free-port range (``$NEMO_GYM_CKPT_PORT_RANGE``), and the e2e tier runs on one worker
(tests/support/parallel.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_ckpt.launch.head import ThreadedServer
from nemo_gym_ckpt.launch.launcher import PORT_RANGE_ENV
from tests.support.parallel import TierFileScheduling, worker_port_range

if "PYTEST_XDIST_WORKER" in os.environ:  # children inherit it: collect, run and demo subprocesses too
    os.environ.setdefault(PORT_RANGE_ENV, worker_port_range(os.environ["PYTEST_XDIST_WORKER"],
                                                            int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> TierFileScheduling | None:
    """``--dist loadfile`` (the default here) keeps the e2e tier on one worker: tests/support/parallel.py."""
    return TierFileScheduling(config, log) if config.getvalue("dist") == "loadfile" else None


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "checkpoints"
    path.mkdir()
    return path


@pytest.fixture
def serve_app() -> Iterator[Callable[[Any], str]]:
    servers: list[ThreadedServer] = []

    def start(app: Any) -> str:
        server = ThreadedServer(app, "127.0.0.1", 0, name="test-server")
        server.start(timeout_s=10.0)
        servers.append(server)
        return server.url

    yield start
    for server in reversed(servers):
        server.stop()
