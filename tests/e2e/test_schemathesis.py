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
hold every later data call). The cases are drawn in the test's thread and sent, in the order they
were drawn, from a thread of their own (``Sender``): hypothesis draws the next cases while the
servers answer the last. The counts are printed (``-s``) and kept in ``SUMMARY``.

``cpu_s`` is the CPU time of the whole run (this process and every server process), the measure
of its cost on a busy machine. ``NGC_SCHEMATHESIS_EXAMPLES`` sets the number of examples per
operation and mode (CI: 3).
"""

from __future__ import annotations

import os
import queue
import secrets
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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
SEND_DEADLINE_S = 300.0
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


@dataclass(frozen=True)
class Request:
    """One fuzzed request, as made from its case: sent later, by the ``Sender``."""

    url: str  # the server's
    scoped: bool
    where: str  # the operation, the mode and whether the token went with it
    method: str
    target: str
    headers: dict[str, str]
    body: dict[str, Any]


class Sender:
    """Sends the requests one after another in the order they were made, from a thread of its own, so
    that hypothesis draws the next cases while a request is in flight (the same requests, in the same
    order, as sending each where it is made). Its counts go to ``counts``; an error of its own ends it
    and is raised again by ``put`` or ``finish``."""

    def __init__(self, failures: list[str]) -> None:
        self.failures = failures
        self.counts: Counter[str] = Counter()
        self._outbox: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="schemathesis-sender")
        self._sending = self._pool.submit(self._run)

    def put(self, request: Request) -> None:
        if self._sending.done():
            self._sending.result()  # its error
            raise AssertionError("the sender ended before the last request")
        self._outbox.put(request)

    def finish(self) -> None:
        """Wait (``SEND_DEADLINE_S`` at most) until every request made so far is sent."""
        self._outbox.put(None)
        try:
            self._sending.result(timeout=SEND_DEADLINE_S)
        finally:
            self._pool.shutdown(wait=False)

    def _run(self) -> None:
        with httpx.Client(trust_env=False, timeout=CALL_TIMEOUT_S) as http:
            while (request := self._outbox.get(timeout=SEND_DEADLINE_S)) is not None:
                self._send(http, request)

    def _send(self, http: httpx.Client, request: Request) -> None:
        self.counts["requests"] += 1
        try:
            reply = http.request(request.method, request.target, headers=request.headers, **request.body)
        except httpx.TransportError as error:
            self.counts["transport_errors"] += 1
            self.failures.append(f"{request.method} {request.target} ({request.where}): {type(error).__name__} "
                                 f"{error}; headers {request.headers} body {str(request.body)[:300]}")
            return
        self.counts[f"{reply.status_code // 100}xx"] += 1
        where = f"{request.where}: {reply.status_code}"
        if reply.status_code >= 500:
            self.failures.append(f"{where} {reply.text[:300]}")
        elif reply.status_code >= 400 and not structured(reply):
            self.failures.append(f"{where} unstructured error {reply.text[:300]}")
        if not request.scoped and reply.status_code == 200:
            reopen(http, request.url)


def fuzz(sender: Sender, url: str, operation: Any) -> None:
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
            where = f"{operation.method.upper()} {operation.path} ({mode}, token={auth})"
            sender.put(Request(url, scoped, where, method, target, headers, body_of(kwargs)))

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
    sender = Sender(failures)
    try:
        with httpx.Client(trust_env=False, timeout=CALL_TIMEOUT_S) as http:
            for url in [mesh.head_url, *map(mesh.url_of, mesh.names)]:
                spec = http.get(f"{url}/openapi.json").json()
                schema = schemathesis.openapi.from_dict(spec)
                for result in schema.get_all_operations():
                    fuzz(sender, url, result.ok())
                SUMMARY["servers"] += 1
    finally:
        sender.finish()
    SUMMARY.update(sender.counts)
    SUMMARY["fuzz_s"] = round(time.monotonic() - started)
    assert failures == [], "\n".join(failures[:30])
    assert SUMMARY["servers"] == len(mesh.names) + 1 == 15 and SUMMARY["requests"] > 0
