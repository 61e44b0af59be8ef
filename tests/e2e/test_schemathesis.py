"""schemathesis over every server's OpenAPI, on real processes with checkpointing on.

The quickstart mesh plus the shipped config of every other implementation of the project (kv_store,
mcqa, math_verify, string_match, python_repl, the restart-only agent, nim with its agent, the
legacy_agent relay), each its own process, and the head server.
For each server its ``/openapi.json`` is read over HTTP and every operation gets ``EXAMPLES``
generated cases valid by the schema and ``EXAMPLES`` that break it, each sent with the control
bearer and without it; rollout-scoped paths go under ``/ng-rollout/<key>/``. Every reply must be
below 500 and every error must be ``{"error": {"code", "detail"}}`` (checked for every reply;
schemathesis's own ``not_a_server_error`` too). A control call that opened a checkpoint is resumed
at once, so the next cases find the participant idle (a prepare with a far deadline would otherwise
hold every later data call). The counts are printed (``-s``) and kept in ``SUMMARY``.

``cpu_s`` is the CPU time of the whole run (this process and every server process), the measure
of its cost on a busy machine. ``NGC_SCHEMATHESIS_EXAMPLES`` sets the number of examples per
operation and mode (CI: 3).
"""

from __future__ import annotations

import os
import secrets
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from nemo_gym_ckpt.config import PROJECT_ROOT, load_config
from nemo_gym_ckpt.launch.launcher import MeshLauncher

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]  # 92 CPU-seconds; 109 s at load 11, 251 s at load 16

EXAMPLES = int(os.environ.get("NGC_SCHEMATHESIS_EXAMPLES", "3"))
TOKEN = "schemathesis-" + secrets.token_hex(8)
CALL_TIMEOUT_S = 30.0
CONTROL = "/ng-control/"
CONFIGS = [PROJECT_ROOT / path for path in (
    "configs/quickstart.yaml", "resources_servers/kv_store/configs/kv_store.yaml",
    "resources_servers/mcqa/configs/mcqa.yaml", "resources_servers/math_verify/configs/math_verify.yaml",
    "resources_servers/string_match/configs/string_match.yaml",
    "resources_servers/python_repl/configs/python_repl.yaml",
    "agents/restart_only_agent/configs/restart_only_agent.yaml", "environment_servers/nim/configs/nim.yaml",
    "environment_servers/legacy_agent/configs/legacy_agent.yaml")]
SUMMARY: Counter[str] = Counter()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshLauncher]:
    root = tmp_path_factory.mktemp("checkpoints")
    launcher = MeshLauncher(load_config(CONFIGS, [
        "head_server.port=0", "checkpoint.enabled=true", f"checkpoint.control_auth_token={TOKEN}",
        f"checkpoint.root={root}"]))
    started, cpu = time.monotonic(), cpu_seconds()
    launcher.start(ready_timeout_s=180)
    SUMMARY["launch_s"] = round(time.monotonic() - started)
    try:
        yield launcher
    finally:
        launcher.stop()
        SUMMARY["cpu_s"] = round(cpu_seconds() - cpu)  # this process and every server (reaped by stop)
        print(f"\nschemathesis: {dict(SUMMARY)}")


def cpu_seconds() -> float:
    used = os.times()
    return used.user + used.system + used.children_user + used.children_system


def structured(reply: httpx.Response) -> bool:
    try:
        body = reply.json()
    except ValueError:
        return False
    error = body.get("error") if isinstance(body, dict) else None
    return (set(body) == {"error"} and isinstance(error, dict) and set(error) == {"code", "detail"}
            and isinstance(error["code"], str) and isinstance(error["detail"], str))


def body_of(kwargs: dict[str, Any]) -> dict[str, Any]:
    """httpx's arguments for the body and query of schemathesis's requests-style transport kwargs."""
    sent = {key: kwargs[key] for key in ("params", "json", "files") if kwargs.get(key) is not None}
    data = kwargs.get("data")
    if isinstance(data, str | bytes):
        sent["content"] = data
    elif data is not None:
        sent["data"] = data
    return sent


def reopen(http: httpx.Client, url: str) -> None:
    """Resume whatever checkpoint a fuzzed control call left open on the participant at ``url``."""
    status = http.get(f"{url}{CONTROL}v1/checkpoint/status", headers={"authorization": f"Bearer {TOKEN}"})
    if status.status_code == 200 and status.json()["checkpoint_id"] is not None:
        body = {"checkpoint_id": status.json()["checkpoint_id"], "deadline_ts": 0.0}
        http.post(f"{url}{CONTROL}v1/checkpoint/resume", json=body, headers={"authorization": f"Bearer {TOKEN}"})


def fuzz(http: httpx.Client, url: str, operation: Any, failures: list[str]) -> None:
    scoped = not operation.path.startswith(CONTROL)

    def send(case: Any, mode: str) -> None:
        for auth in (True, False):
            base = f"{url}/ng-rollout/fz-{secrets.token_hex(3)}" if scoped else url
            kwargs = case.as_transport_kwargs(base_url=base)
            headers = {key: value for key, value in kwargs.pop("headers", {}).items()
                       if key.lower() != "authorization"}
            if auth:
                headers["authorization"] = f"Bearer {TOKEN}"
            cookies = kwargs.pop("cookies", None) or {}
            if cookies:
                headers["cookie"] = "; ".join(f"{key}={value}" for key, value in cookies.items())
            method, target = kwargs.pop("method"), kwargs.pop("url")
            SUMMARY["requests"] += 1
            try:
                reply = http.request(method, target, headers=headers, **body_of(kwargs))
            except httpx.TransportError as error:
                SUMMARY["transport_errors"] += 1
                failures.append(f"{method} {target} ({mode}, token={auth}): {type(error).__name__} {error}; "
                                f"headers {headers} body {str(body_of(kwargs))[:300]}")
                continue
            SUMMARY[f"{reply.status_code // 100}xx"] += 1
            where = f"{operation.method.upper()} {operation.path} ({mode}, token={auth}): {reply.status_code}"
            if reply.status_code >= 500:
                failures.append(f"{where} {reply.text[:300]}")
            elif reply.status_code >= 400 and not structured(reply):
                failures.append(f"{where} unstructured error {reply.text[:300]}")
            if not scoped and reply.status_code == 200:
                reopen(http, url)

    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        try:
            _run(operation.as_strategy(generation_mode=mode), lambda case, label=mode.value: send(case, label))
        except Unsatisfiable:  # nothing to break: an operation without parameters or body
            SUMMARY["operations_without_negative_cases"] += 1


def _run(strategy: Any, each: Any) -> None:
    """``each(case)`` for ``EXAMPLES`` cases of ``strategy`` (derandomized: the same cases every run)."""

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case: Any) -> None:
        each(case)

    run()


def test_every_server_answers_fuzzed_requests_without_a_5xx_and_with_structured_errors(
    mesh: MeshLauncher,
) -> None:
    failures: list[str] = []
    started = time.monotonic()
    with httpx.Client(trust_env=False, timeout=CALL_TIMEOUT_S) as http:
        for url in [mesh.head_url, *map(mesh.url_of, mesh.names)]:
            spec = http.get(f"{url}/openapi.json").json()
            schema = schemathesis.openapi.from_dict(spec)
            for result in schema.get_all_operations():
                fuzz(http, url, result.ok(), failures)
            SUMMARY["servers"] += 1
    SUMMARY["fuzz_s"] = round(time.monotonic() - started)
    assert failures == [], "\n".join(failures[:30])
    assert SUMMARY["servers"] == len(mesh.names) + 1 == 15 and SUMMARY["requests"] > 0
