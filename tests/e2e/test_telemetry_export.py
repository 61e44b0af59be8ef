"""The config's ``telemetry:`` block turns on OTLP export in every server process: a real server,
launched from YAML, sends its checkpoint spans and metrics over OTLP/HTTP to a collector on
127.0.0.1; the ``checkpoint`` span group is opt-in; off, the SDK is never imported. A NeMo Gym
server in the mesh (NeMo Gym's environment, our shell) exports too, and a hung endpoint never costs
a server its graceful stop."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from nemo_gym_ckpt.checkpoint.coordinator import Coordinator
from nemo_gym_ckpt.config import NEMO_GYM_PYTHON_ENV, load_config
from nemo_gym_ckpt.launch.launcher import MeshLauncher
from nemo_gym_ckpt.testing.waits import until
from tests.support.hung_endpoint import hung_endpoint
from tests.support.nemo_gym_env import nemo_gym_python

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

FIXTURE = Path(__file__).parents[1] / "fixtures" / "string_match.yaml"
TOKEN = "telemetry-test-token"
NEMO_GYM_STRING_MATCH = """
ng_sm:
  resources_servers:
    string_match:
      entrypoint: app.py
      package: nemo_gym
      domain: knowledge
"""
EXPORT_WAIT_S = 30.0


class Received:
    """What an OTLP/HTTP collector was sent: (path, body) of every POST."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()

    def bodies(self, path: str) -> bytes:
        with self.lock:
            return b"".join(body for posted, body in self.posts if posted == path)


@pytest.fixture
def collector() -> Iterator[tuple[str, Received]]:
    received = Received()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = min(int(self.headers.get("content-length", "0")), 16 << 20)
            body = self.rfile.read(length)
            with received.lock:
                received.posts.append((self.path, body))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


async def _checkpoint_once(launcher: MeshLauncher, root: Path) -> None:
    async with Coordinator(launcher.head_url, TOKEN) as coordinator:
        await coordinator.discover()
        deadline = time.time() + 60
        prepared = await coordinator.prepare("otel-1", deadline_ts=deadline)
        assert prepared.prepared, prepared.to_json()
        await coordinator.commit("otel-1", deadline_ts=deadline, checkpoint_dir=str(root / "otel-1"))
        await coordinator.resume("otel-1", deadline_ts=deadline)


def _launched(endpoint: str, root: Path, span_groups: str, *configs: Path,
              env: dict[str, str] | None = None) -> MeshLauncher:
    overrides = [
        "head_server.port=0", "+checkpoint.enabled=true", f"+checkpoint.control_auth_token={TOKEN}",
        f"+checkpoint.root={root}", "+telemetry.enabled=true", f"+telemetry.span_groups='{span_groups}'",
        f"+telemetry.otlp_endpoint={endpoint}", "+telemetry.metrics_export_interval_s=0.5",
    ]
    launcher = MeshLauncher(load_config([FIXTURE, *configs], overrides), env=env)
    launcher.start(ready_timeout_s=120.0)
    return launcher


@pytest.mark.parametrize("span_groups", ["default,checkpoint", "default"])
async def test_a_launched_server_exports_its_checkpoint_telemetry_over_otlp(
    collector: tuple[str, Received], tmp_path: Path, span_groups: str
) -> None:
    endpoint, received = collector
    launcher = _launched(endpoint, tmp_path, span_groups)
    try:
        await _checkpoint_once(launcher, tmp_path)
        await until(lambda: b"gym.checkpoint.operation.duration" in received.bodies("/v1/metrics"),
                    "the checkpoint metrics exported", timeout_s=EXPORT_WAIT_S)
    finally:
        launcher.stop()  # SIGTERM: the server flushes its exporters as its app shuts down
    metrics = received.bodies("/v1/metrics")
    assert b"service.name" in metrics and b"sm" in metrics
    traces = received.bodies("/v1/traces")
    if "checkpoint" in span_groups.split(","):
        for name in (b"gym.checkpoint.prepare", b"gym.checkpoint.commit", b"gym.checkpoint.resume",
                     b"gym.checkpoint.write", b"otel-1"):
            assert name in traces, name
    else:
        assert b"gym.checkpoint" not in traces  # the span group is opt-in; the metrics still come


def test_telemetry_off_imports_no_sdk() -> None:
    """Off (the default), a server process pays nothing: the SDK is not even imported."""
    code = (
        "import sys\n"
        "from nemo_gym_ckpt.checkpoint.otlp import install_telemetry\n"
        "from nemo_gym_ckpt.config import load_config\n"
        "from nemo_gym_ckpt.launch.child import build_app\n"
        f"mesh = load_config([{str(FIXTURE)!r}], ['+checkpoint.enabled=true', '+checkpoint.control_auth_token=t'])\n"
        "assert install_telemetry(mesh.telemetry, 'sm') is None\n"
        "build_app(mesh, 'sm')\n"
        "print(sorted(name for name in sys.modules if name.startswith('opentelemetry.sdk')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


async def test_a_hung_otlp_endpoint_does_not_hold_a_servers_stop(tmp_path: Path) -> None:
    """The final flush gives up at its deadline, below the launcher's stop grace: no SIGKILL."""
    with hung_endpoint() as endpoint:
        launcher = _launched(endpoint, tmp_path, "default,checkpoint")
        try:
            await _checkpoint_once(launcher, tmp_path)  # spans and metrics the exporters still hold
        finally:
            launcher.stop()
    assert launcher.killed == []


async def test_a_nemo_gym_server_in_the_mesh_exports_its_checkpoint_telemetry(
    collector: tuple[str, Received], tmp_path: Path
) -> None:
    """NeMo Gym's string_match, run in NeMo Gym's environment inside our shell, exports as ours do."""
    endpoint, received = collector
    bridged = tmp_path / "ng_sm.yaml"
    bridged.write_text(NEMO_GYM_STRING_MATCH)
    env = {**os.environ, NEMO_GYM_PYTHON_ENV: nemo_gym_python()}
    launcher = _launched(endpoint, tmp_path, "default,checkpoint", bridged, env=env)
    try:
        await _checkpoint_once(launcher, tmp_path)
        await until(lambda: b"ng_sm" in received.bodies("/v1/metrics"),
                    "the NeMo Gym server's checkpoint metrics exported", timeout_s=EXPORT_WAIT_S)
    finally:
        launcher.stop()
    traces = received.bodies("/v1/traces")
    assert b"ng_sm" in traces and b"gym.checkpoint.prepare" in traces
