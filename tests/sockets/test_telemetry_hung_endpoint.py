"""Telemetry to an OTLP endpoint on 127.0.0.1 that accepts connections and never answers (a hung
collector): the final flush gives up at its deadline and a process's exit is never held.

Each case runs in a process of its own (``install_telemetry`` sets the process's global providers)
that records checkpoint operations while every export hangs, as a busy server or the collector would.
Against such an endpoint the old code took about 50 s either way; the bound here is ten times
``SHUTDOWN_DEADLINE_S``.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest

from nemo_gym_ckpt.checkpoint.otlp import EXTRA, SHUTDOWN_DEADLINE_S, install_telemetry
from nemo_gym_ckpt.config import PROJECT_ROOT, TelemetryConfig
from nemo_gym_ckpt.errors import ConfigError
from tests.support.hung_endpoint import hung_endpoint

pytestmark = pytest.mark.sockets

ENABLED = TelemetryConfig.model_validate({"enabled": True})

PROCESS_BOUND_S = 10 * SHUTDOWN_DEADLINE_S
"""How long the process of a case may take in all, its imports and 3000 operations included."""

CASE = """
import sys
from nemo_gym_ckpt.checkpoint.otlp import install_telemetry
from nemo_gym_ckpt.checkpoint.telemetry import Telemetry
from nemo_gym_ckpt.config import TelemetryConfig

endpoint, shut_down = sys.argv[1], sys.argv[2] == "shutdown"
config = TelemetryConfig(enabled=True, otlp_endpoint=endpoint, span_groups="default,checkpoint",
                         metrics_export_interval_s=0.2)
exporting = install_telemetry(config, "hung")
telemetry = Telemetry("resources", "hung")
for index in range(3000):  # more than the span queue holds: several batches to flush
    with telemetry.operation("prepare", f"c{index}"):
        pass
if shut_down:
    print("flushed" if exporting.shutdown() else "gave up", flush=True)
"""


@pytest.fixture
def endpoint() -> Iterator[str]:
    with hung_endpoint() as url:
        yield url


def _run_case(endpoint: str, mode: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([sys.executable, "-c", CASE, endpoint, mode], capture_output=True, text=True,
                              cwd=PROJECT_ROOT, timeout=PROCESS_BOUND_S, check=False)
    except subprocess.TimeoutExpired as expired:
        stderr = expired.stderr.decode(errors="replace") if isinstance(expired.stderr, bytes) else expired.stderr
        raise AssertionError(f"{mode}: still running after {PROCESS_BOUND_S} s with a hung OTLP endpoint "
                             f"(stderr: {(stderr or '')[-500:]})") from None


def test_the_final_flush_gives_up_at_its_deadline(endpoint: str) -> None:
    done = _run_case(endpoint, "shutdown")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "gave up", done.stdout
    # the traces' flush is stuck; the metrics' own shutdown is told the deadline and may end by itself
    assert "telemetry: gave up flushing traces" in done.stderr, done.stderr[-2000:]


def test_a_process_that_never_shut_telemetry_down_exits_at_once(endpoint: str) -> None:
    """No SDK exit hook flushes (and hangs) at interpreter exit: whoever wants the flush calls the
    bounded ``Exporting.shutdown``."""
    done = _run_case(endpoint, "no-shutdown")
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture
def without_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as an environment without the OpenTelemetry SDK (an import of it fails)."""
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.resources", None)


@pytest.mark.usefixtures("without_sdk")
def test_without_the_sdk_a_required_export_is_a_config_error_naming_the_extra() -> None:
    with pytest.raises(ConfigError, match=f"install the '{EXTRA}' extra"):
        install_telemetry(ENABLED, "sm")


@pytest.mark.usefixtures("without_sdk")
def test_without_the_sdk_an_optional_export_is_one_warning_and_no_export(caplog: pytest.LogCaptureFixture) -> None:
    """A NeMo Gym server in our mesh runs in NeMo Gym's environment, which may lack the SDK."""
    with caplog.at_level(logging.WARNING, logger="nemo_gym_ckpt.checkpoint.otlp"):
        assert install_telemetry(ENABLED, "ng_sm", sdk_required=False) is None
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "lacks the OpenTelemetry SDK" in warnings[0] and "ng_sm" in warnings[0], warnings
