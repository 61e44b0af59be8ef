"""The exporter a mesh's ``telemetry:`` block turns on (docs/protocol.md section 9).

``install_telemetry(config, service)`` runs once per process (each server child before its app is
built, the collector before it coordinates). With ``enabled: false`` it returns ``None`` and imports
nothing: checkpoint telemetry stays on the OpenTelemetry API, which costs nothing. Enabled, it needs
the OpenTelemetry SDK and its OTLP exporter (the ``otel`` extra; without them the process stops with
a ``ConfigError`` naming the extra), sets the global tracer and meter providers for ``service`` (the
instance name), and opens the ``checkpoint`` span group when ``span_groups`` names it.
``Exporting.shutdown`` flushes both providers; a server runs ``Exporting.aclose`` as its app shuts down.
"""

from __future__ import annotations

import asyncio
import importlib
from dataclasses import dataclass
from typing import Any

from nemo_gym_ckpt.checkpoint.telemetry import open_span_groups
from nemo_gym_ckpt.config import TelemetryConfig
from nemo_gym_ckpt.errors import ConfigError

__all__ = ["EXTRA", "Exporting", "install_telemetry"]

EXTRA = "otel"
"""The optional extra that brings the SDK and the OTLP exporter: ``pip install 'nemo-gym-ckpt[otel]'``."""


@dataclass
class Exporting:
    """The SDK providers this process exports through (``None`` where that signal is off)."""

    tracer_provider: Any
    meter_provider: Any

    def shutdown(self) -> None:
        """Flush and stop both providers (blocking: the exporters send what they hold)."""
        for provider in (self.tracer_provider, self.meter_provider):
            if provider is not None:
                provider.shutdown()

    async def aclose(self) -> None:
        """``shutdown`` off the event loop, for an app's shutdown (uvicorn ends a process that got
        SIGTERM by raising the signal again once the app is down: no ``atexit`` hook runs then)."""
        await asyncio.to_thread(self.shutdown)


def install_telemetry(config: TelemetryConfig, service: str) -> Exporting | None:
    """Export this process's telemetry as ``config`` says; ``None`` (and nothing imported) when off."""
    if not config.enabled:
        return None
    trace_api, metrics_api = _module("opentelemetry.trace"), _module("opentelemetry.metrics")
    resource = _module("opentelemetry.sdk.resources").Resource.create({"service.name": service})
    exporting = Exporting(
        _tracer_provider(config, resource) if config.traces_enabled else None,
        _meter_provider(config, resource) if config.metrics_enabled else None,
    )
    if exporting.tracer_provider is not None:
        trace_api.set_tracer_provider(exporting.tracer_provider)
        open_span_groups(config.groups())
    if exporting.meter_provider is not None:
        metrics_api.set_meter_provider(exporting.meter_provider)
    return exporting


def _tracer_provider(config: TelemetryConfig, resource: Any) -> Any:
    sdk = _module("opentelemetry.sdk.trace")
    export = _module("opentelemetry.sdk.trace.export")
    if config.exporter == "console":
        exporter = export.ConsoleSpanExporter()
    else:
        otlp = _module("opentelemetry.exporter.otlp.proto.http.trace_exporter")
        exporter = otlp.OTLPSpanExporter(**_otlp_args(config, "traces"))
    provider = sdk.TracerProvider(resource=resource)
    provider.add_span_processor(export.BatchSpanProcessor(exporter))
    return provider


def _meter_provider(config: TelemetryConfig, resource: Any) -> Any:
    sdk = _module("opentelemetry.sdk.metrics")
    export = _module("opentelemetry.sdk.metrics.export")
    if config.exporter == "console":
        exporter = export.ConsoleMetricExporter()
    else:
        otlp = _module("opentelemetry.exporter.otlp.proto.http.metric_exporter")
        exporter = otlp.OTLPMetricExporter(**_otlp_args(config, "metrics"))
    reader = export.PeriodicExportingMetricReader(
        exporter, export_interval_millis=config.metrics_export_interval_s * 1000)
    return sdk.MeterProvider(resource=resource, metric_readers=[reader])


def _otlp_args(config: TelemetryConfig, signal: str) -> dict[str, Any]:
    """The exporter's endpoint (``<otlp_endpoint>/v1/<signal>``; unset: the standard environment
    variables decide) and headers."""
    args: dict[str, Any] = {"headers": dict(config.otlp_headers)}
    if config.otlp_endpoint is not None:
        args["endpoint"] = f"{config.otlp_endpoint.rstrip('/')}/v1/{signal}"
    return args


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise ConfigError(f"telemetry.enabled needs the OpenTelemetry SDK and OTLP exporter: install the "
                          f"{EXTRA!r} extra (pip install 'nemo-gym-ckpt[{EXTRA}]'); {error}",
                          key="telemetry.enabled") from None
