"""A NeMo Gym server in our mesh is served as our own servers are: NeMo Gym's string_match, launched
through the bridge in NeMo Gym's Python environment (``$NEMO_GYM_PYTHON``, else built by
``scripts/nemo_gym_env.sh``; never skipped), checkpointing on.

Checked on the real process: an idle connection is kept for our servers' keep-alive (60 s), not
uvicorn's 5 s (the mesh client's pool reuses it); a client that stalls mid-body is never in flight,
so a prepare is ready at once; a body over the block's ``max_body_bytes`` is 413; bodies that NeMo
Gym's own reader takes and then fails on (nested 5,000 deep, a lone surrogate) are 400, not its 500.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from nemo_gym_ckpt.config import NEMO_GYM_PYTHON_ENV, PROJECT_ROOT, load_config
from nemo_gym_ckpt.launch.launcher import MeshLauncher
from tests.support.nemo_gym_env import nemo_gym_python

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

NAME = "string_match"
CONFIG = PROJECT_ROOT / "resources_servers" / "nemo_gym" / "string_match" / "configs" / "string_match.yaml"
TOKEN = "bridge-t0ken"
MAX_BODY_BYTES = 64 * 1024
IDLE_S = 8.0
"""Longer than uvicorn's default keep-alive (5 s), far shorter than ours (60 s)."""
RESPONSE = {"id": "r", "object": "response", "created_at": 0, "model": "m", "parallel_tool_calls": False,
            "tool_choice": "auto", "tools": [], "output": [{
                "type": "message", "role": "assistant", "id": "m", "status": "completed",
                "content": [{"type": "output_text", "text": "4", "annotations": []}]}]}
VERIFY = {"responses_create_params": {"input": "2+2?"}, "response": RESPONSE, "expected_answer": "4"}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshLauncher]:
    root = tmp_path_factory.mktemp("bridge")
    overrides = ["checkpoint.enabled=true", f"checkpoint.control_auth_token={TOKEN}", f"checkpoint.root={root}",
                 f"{NAME}.resources_servers.{NAME}.max_body_bytes={MAX_BODY_BYTES}"]
    env = {**os.environ, NEMO_GYM_PYTHON_ENV: nemo_gym_python()}
    launcher = MeshLauncher(load_config([CONFIG], overrides), env=env)
    with launcher:
        launcher.start(ready_timeout_s=300)
        yield launcher


def address(launcher: MeshLauncher) -> tuple[str, int]:
    settings = launcher.mesh.instance(NAME).settings
    return settings.host, int(settings.port or 0)


def health_request() -> bytes:
    return b"GET /health HTTP/1.1\r\nhost: ng\r\n\r\n"


def read_reply(conn: socket.socket) -> bytes:
    """One short reply (``/health``): its head and body, read until the body is complete."""
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = conn.recv(65536)
        assert chunk, f"the connection closed mid-reply: {data!r}"
        data += chunk
    return data


def test_an_idle_connection_is_kept_for_our_keep_alive(launched: MeshLauncher) -> None:
    with socket.create_connection(address(launched), timeout=10) as conn:
        conn.sendall(health_request())
        assert read_reply(conn).startswith(b"HTTP/1.1 200")
        conn.settimeout(IDLE_S)
        try:
            closed = conn.recv(1) == b""
        except TimeoutError:
            closed = False
        assert not closed, f"the bridged server closed an idle connection within {IDLE_S:g} s"
        conn.settimeout(10)
        conn.sendall(health_request())  # the pool's reuse of it works
        assert read_reply(conn).startswith(b"HTTP/1.1 200")


def test_a_client_stalled_mid_body_does_not_hold_a_prepare(launched: MeshLauncher) -> None:
    head = (b"POST /ng-rollout/stalled-r1/a_tool HTTP/1.1\r\nhost: ng\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n")
    auth = {"authorization": f"Bearer {TOKEN}"}
    with socket.create_connection(address(launched), timeout=10) as conn, httpx.Client(
            base_url=launched.url_of(NAME), headers=auth, timeout=30) as control:
        conn.sendall(head + b'{"hold": ')
        # no event to wait for (the fixed server shows nothing until its 408): this pause only makes sure
        # that a shell which admits before reading the body has admitted it when the prepare comes
        time.sleep(0.5)
        prepared = control.post("/ng-control/v1/checkpoint/prepare",
                                json={"checkpoint_id": "c1", "deadline_ts": time.time() + 5})
        control.post("/ng-control/v1/checkpoint/resume", json={"checkpoint_id": "c1", "deadline_ts": time.time() + 30})
    assert prepared.status_code == 200, prepared.text
    report = prepared.json()["report"]
    assert (report["ready"], report["counts"]["in_flight"]) == (True, 0), report


def test_a_body_over_the_blocks_limit_is_a_413(launched: MeshLauncher) -> None:
    padded = {**VERIFY, "padding": "x" * MAX_BODY_BYTES}
    with httpx.Client(base_url=launched.url_of(NAME), timeout=30) as http:
        fits = http.post("/ng-rollout/limit-r1/verify", json=VERIFY)
        refused = http.post("/ng-rollout/limit-r2/verify", json=padded)
    assert fits.status_code == 200 and "reward" in fits.json(), fits.text
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "payload_too_large", refused.text[:300]


@pytest.mark.parametrize(("case", "body"), [
    ("nested 5,000 deep", b'{"a":' * 5000 + b"1" + b"}" * 5000),
    ("a lone surrogate", b'{"expected_answer": "\\ud800", "x": 1}'),
])
def test_a_body_nemo_gym_would_fail_on_is_a_400(launched: MeshLauncher, case: str, body: bytes) -> None:
    with httpx.Client(base_url=launched.url_of(NAME), timeout=30) as http:
        reply = http.post("/ng-rollout/odd-r1/verify", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_request", (case, reply.text)
