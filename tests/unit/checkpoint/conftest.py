"""Fixtures of the checkpoint unit tests: a fake clock, the in-process minimal participant, and
OpenTelemetry SDK providers with in-memory exporters (passed in, never installed globally)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from nemo_gym_ckpt.checkpoint.fileops import FileOps
from nemo_gym_ckpt.checkpoint.telemetry import Telemetry
from nemo_gym_ckpt.config import CheckpointConfig
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.conformance import ParticipantUnderTest
from nemo_gym_ckpt.testing.minimal import MinimalHooks, MinimalServer, create_minimal_server

TOKEN = "test-token-1234"
FAKE_CLOCK_START = 1_700_000_000.0
GRACE_S = 600.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start=FAKE_CLOCK_START)


@pytest.fixture
def config(root: Path) -> CheckpointConfig:
    return CheckpointConfig(enabled=True, control_auth_token=TOKEN, root=root, lease_grace_seconds=GRACE_S)


@dataclass
class Otel:
    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader
    telemetry: Telemetry

    def span_names(self) -> list[str]:
        return [span.name for span in self.spans.get_finished_spans()]

    def points(self, metric: str) -> list[Any]:
        data = self.metrics.get_metrics_data()
        found = []
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for item in scope.metrics:
                    if item.name == metric:
                        found.extend(item.data.data_points)
        return found


@pytest.fixture
def otel() -> Iterator[Otel]:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    telemetry = Telemetry(
        "resources", "sessions", tracer_provider=tracer_provider, meter_provider=meter_provider
    )
    yield Otel(spans, reader, telemetry)
    tracer_provider.shutdown()
    meter_provider.shutdown()


ServerFactory = Callable[..., MinimalServer]


@pytest.fixture
def make_server(config: CheckpointConfig, clock: FakeClock) -> Iterator[ServerFactory]:
    servers: list[MinimalServer] = []

    def make(
        *,
        file_ops: FileOps | None = None,
        telemetry: Telemetry | None = None,
        kind: str = "resources",
        name: str = "sessions",
    ) -> MinimalServer:
        server = create_minimal_server(
            name, config, kind=kind, clock=clock, file_ops=file_ops, telemetry=telemetry
        )
        servers.append(server)
        return server

    yield make


@pytest.fixture
async def make_participant(
    make_server: ServerFactory, root: Path, clock: FakeClock
) -> AsyncIterator[Callable[[], AbstractAsyncContextManager[ParticipantUnderTest]]]:
    opened: list[MinimalServer] = []

    @asynccontextmanager
    async def make() -> AsyncIterator[ParticipantUnderTest]:
        server = make_server()
        opened.append(server)
        transport = httpx.ASGITransport(server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://minimal") as client:
            yield ParticipantUnderTest(
                client, TOKEN, root, now=clock.now, advance_clock=clock.advance, data=MinimalHooks()
            )

    yield make
    for server in opened:
        assert server.participant is not None
        await server.participant.aclose()


@asynccontextmanager
async def client_of(server: MinimalServer) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(server.app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://minimal", headers={"authorization": f"Bearer {TOKEN}"}
    ) as client:
        yield client


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Yield to the loop until ``condition`` holds: a wait with a deadline, never a sleep."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0)
