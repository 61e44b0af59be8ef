"""The exporter a mesh's ``telemetry:`` block turns on (docs/protocol.md section 9).

``install_telemetry(config, service)`` runs once per process (each server child before its app is
built, the collector before it coordinates). With ``enabled: false`` it returns ``None`` and imports
nothing: checkpoint telemetry stays on the OpenTelemetry API, which costs nothing. Enabled, it needs
the OpenTelemetry SDK and its OTLP exporter (the ``otel`` extra; without them the process stops with
a ``ConfigError`` naming the extra, or, with ``sdk_required=False``, logs one warning and exports
nothing), sets the global tracer and meter providers for ``service`` (the instance name), and opens
the ``checkpoint`` span group when ``span_groups`` names it.

Nothing here waits on the endpoint without a deadline: each export gives up after ``EXPORT_TIMEOUT_S``,
its retries included and however slowly the endpoint answers (the exporter sends through an
``otlp_http.DeadlineSession``: ``requests`` alone bounds each socket read, so an endpoint that sent a
byte every half second held one export for ever), ``Exporting.shutdown`` (the final flush) after
``SHUTDOWN_DEADLINE_S`` for both providers together, below the launcher's 5 s stop grace, and the
SDK's own exit hooks are off, so a hung endpoint never holds a process's exit. A server runs
``Exporting.aclose`` as its app shuts down; the collector calls ``Exporting.shutdown`` as it ends.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import FastAPI
from opentelemetry import metrics, trace

from nemo_gym_ckpt.checkpoint.telemetry import open_span_groups
from nemo_gym_ckpt.config import TelemetryConfig
from nemo_gym_ckpt.errors import ConfigError
from nemo_gym_ckpt.server import close_on_shutdown

__all__ = [
    "EXPORT_TIMEOUT_S",
    "EXTRA",
    "SHUTDOWN_DEADLINE_S",
    "Exporting",
    "flush_telemetry_at_shutdown",
    "install_telemetry",
]

EXTRA = "otel"
"""The optional extra that brings the SDK and the OTLP exporter: ``pip install 'nemo-gym-ckpt[otel]'``."""
EXPORT_TIMEOUT_S = 2.0
"""How long one OTLP export may take, its retries included (the SDK's default is 10 s): what a hung
or slow endpoint costs each batch, in the exporter's own thread. The SDK's retry loop stops at this
deadline, and each request it sends is held to the time left (``otlp_http.DeadlineSession``)."""
SHUTDOWN_DEADLINE_S = 3.0
"""How long ``Exporting.shutdown`` waits for the final flush of both providers together; then it
gives up with a warning and what they held is lost. Below the launcher's ``stop_grace_s`` (5 s), so a
server that exports to a hung endpoint still stops by itself."""

logger = logging.getLogger(__name__)


@dataclass
class Exporting:
    """The SDK providers this process exports through (``None`` where that signal is off)."""

    tracer_provider: Any
    meter_provider: Any

    def shutdown(self, deadline_s: float = SHUTDOWN_DEADLINE_S) -> bool:
        """Flush and stop both providers, waiting at most ``deadline_s`` for both together.

        Each stops in a daemon thread of its own; one still flushing at the deadline is left behind
        (it never holds the process's exit) with a logged warning. True when both finished in time.
        """
        end = time.monotonic() + deadline_s
        stopping = {signal: _in_daemon_thread(f"telemetry-shutdown-{signal}", stop)
                    for signal, stop in self._stops(deadline_s)}
        for thread in stopping.values():
            thread.join(max(0.0, end - time.monotonic()))
        stuck = [signal for signal, thread in stopping.items() if thread.is_alive()]
        if stuck:
            logger.warning("telemetry: gave up flushing %s after %g s (the OTLP endpoint does not answer "
                           "in time); what they held is lost", " and ".join(stuck), deadline_s)
        return not stuck

    async def aclose(self) -> None:
        """``shutdown`` off the event loop, for an app's shutdown (uvicorn ends a process that got
        SIGTERM by raising the signal again once the app is down: no ``atexit`` hook runs then)."""
        await asyncio.to_thread(self.shutdown)

    def _stops(self, deadline_s: float) -> list[tuple[str, Callable[[], object]]]:
        """Each provider's shutdown, by signal (the meter provider's also told the deadline)."""
        stops: list[tuple[str, Callable[[], object]]] = []
        if self.tracer_provider is not None:
            stops.append(("traces", self.tracer_provider.shutdown))
        if self.meter_provider is not None:
            stops.append(("metrics", partial(self.meter_provider.shutdown, timeout_millis=deadline_s * 1000)))
        return stops


def _in_daemon_thread(name: str, run: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def install_telemetry(config: TelemetryConfig, service: str, *, sdk_required: bool = True) -> Exporting | None:
    """Export this process's telemetry as ``config`` says; ``None`` (and nothing imported) when off.

    Without the SDK: a ``ConfigError`` naming the extra, or (``sdk_required=False``, a process in an
    environment this project does not install, such as NeMo Gym's) one warning and ``None``.
    """
    if not config.enabled:
        return None
    missing = _missing_sdk(config)
    if missing is not None:
        if sdk_required:
            raise ConfigError(f"telemetry.enabled needs the OpenTelemetry SDK and OTLP exporter: install the "
                              f"{EXTRA!r} extra (pip install 'nemo-gym-ckpt[{EXTRA}]'); {missing}",
                              key="telemetry.enabled")
        logger.warning("telemetry.enabled, but this Python environment lacks the OpenTelemetry SDK or its "
                       "OTLP exporter (%s): %s runs without exporting telemetry", missing, service)
        return None
    return _install(config, service)


def _install(config: TelemetryConfig, service: str) -> Exporting:
    resources = importlib.import_module("opentelemetry.sdk.resources")
    resource = resources.Resource.create({"service.name": service})
    exporting = Exporting(
        _tracer_provider(config, resource) if config.traces_enabled else None,
        _meter_provider(config, resource) if config.metrics_enabled else None,
    )
    if exporting.tracer_provider is not None:
        trace.set_tracer_provider(exporting.tracer_provider)
        open_span_groups(config.groups())
    if exporting.meter_provider is not None:
        metrics.set_meter_provider(exporting.meter_provider)
    return exporting


def _tracer_provider(config: TelemetryConfig, resource: Any) -> Any:
    sdk = importlib.import_module("opentelemetry.sdk.trace")
    export = importlib.import_module("opentelemetry.sdk.trace.export")
    if config.exporter == "console":
        exporter = export.ConsoleSpanExporter()
    else:
        otlp = importlib.import_module("opentelemetry.exporter.otlp.proto.http.trace_exporter")
        exporter = otlp.OTLPSpanExporter(**_otlp_args(config, "traces"))
    provider = sdk.TracerProvider(resource=resource, shutdown_on_exit=False)  # Exporting.shutdown, bounded
    provider.add_span_processor(export.BatchSpanProcessor(exporter))
    return provider


def _meter_provider(config: TelemetryConfig, resource: Any) -> Any:
    sdk = importlib.import_module("opentelemetry.sdk.metrics")
    export = importlib.import_module("opentelemetry.sdk.metrics.export")
    if config.exporter == "console":
        exporter = export.ConsoleMetricExporter()
    else:
        otlp = importlib.import_module("opentelemetry.exporter.otlp.proto.http.metric_exporter")
        exporter = otlp.OTLPMetricExporter(**_otlp_args(config, "metrics"))
    reader = export.PeriodicExportingMetricReader(
        exporter, export_interval_millis=config.metrics_export_interval_s * 1000)
    return sdk.MeterProvider(resource=resource, metric_readers=[reader], shutdown_on_exit=False)


def _otlp_args(config: TelemetryConfig, signal: str) -> dict[str, Any]:
    """The exporter's endpoint (``<otlp_endpoint>/v1/<signal>``; unset: the standard environment
    variables decide), headers, ``EXPORT_TIMEOUT_S`` and a session of its own that holds each request
    to the time its export has left, however slowly the endpoint answers (``otlp_http``)."""
    from nemo_gym_ckpt.checkpoint.otlp_http import DeadlineSession  # needs requests: telemetry on only

    args: dict[str, Any] = {"headers": dict(config.otlp_headers), "timeout": EXPORT_TIMEOUT_S,
                            "session": DeadlineSession(EXPORT_TIMEOUT_S)}
    if config.otlp_endpoint is not None:
        args["endpoint"] = f"{config.otlp_endpoint.rstrip('/')}/v1/{signal}"
    return args


def _sdk_modules(config: TelemetryConfig) -> list[str]:
    """The modules ``config``'s telemetry imports beyond the API."""
    modules = ["opentelemetry.sdk.resources", "opentelemetry.sdk.trace", "opentelemetry.sdk.trace.export",
               "opentelemetry.sdk.metrics", "opentelemetry.sdk.metrics.export"]
    if config.exporter == "otlp":
        modules += ["opentelemetry.exporter.otlp.proto.http.trace_exporter",
                    "opentelemetry.exporter.otlp.proto.http.metric_exporter"]
    return modules


def _missing_sdk(config: TelemetryConfig) -> str | None:
    """Why the SDK cannot be imported here (the import error), or ``None``."""
    for name in _sdk_modules(config):
        try:
            importlib.import_module(name)
        except ImportError as error:
            return str(error)
    return None


def flush_telemetry_at_shutdown(app: FastAPI, exporting: Exporting | None) -> FastAPI:
    """``app`` with the exporters' final flush chained into its shutdown (``Exporting.aclose``: bounded,
    so a hung OTLP endpoint never holds the server's stop); ``app`` as it is when telemetry is off."""
    return app if exporting is None else close_on_shutdown(app, exporting.aclose)
