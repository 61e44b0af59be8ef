"""Fixtures shared by every test of the repository (tests/ and the server folders' tests/).

- ``root``: an empty ``checkpoints`` folder of the test's own, the ``checkpoint.root`` of its mesh.
- ``serve_app(app) -> url``: a real uvicorn server for an ASGI app, on a free 127.0.0.1 port, up
  (readiness waited for) before it returns and stopped after the test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_ckpt.launch.head import ThreadedServer


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
