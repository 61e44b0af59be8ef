"""An OTLP endpoint on 127.0.0.1 that answers, but a byte at a time: one export still ends at its
deadline (``EXPORT_TIMEOUT_S``, retries included), failed, and a prompt endpoint still gets it.

``requests`` bounds each socket read only, so an endpoint that sent a header line (or a byte of its
body) every 0.2 s held one export for ever: the exporter now sends through
``otlp_http.DeadlineSession``. The bound each case is waited for is ten times ``EXPORT_TIMEOUT_S``.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult

from nemo_gym_ckpt.checkpoint.otlp import EXPORT_TIMEOUT_S, _otlp_args
from nemo_gym_ckpt.config import TelemetryConfig

pytestmark = pytest.mark.sockets

EXPORT_BOUND_S = 10 * EXPORT_TIMEOUT_S
DRIP_S = 0.2
ACCEPT_POLL_S = 0.1


def _read_request(connection: socket.socket) -> bytes:
    """One request's head and body (its ``content-length``), as the endpoint received it."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = connection.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = connection.recv(65536)
        if not chunk:
            break
        body += chunk
    return head


def _answer(kind: str, connection: socket.socket, stop: threading.Event, heads: list[bytes]) -> None:
    try:
        heads.append(_read_request(connection))
        if kind == "prompt":
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            return
        if kind == "dripping_head":
            connection.sendall(b"HTTP/1.1 200 OK\r\n")
        else:  # dripping_body
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        while not stop.wait(DRIP_S):
            connection.sendall(b"X-Drip: b\r\n" if kind == "dripping_head" else b"x")
    except OSError:  # the exporter shut the connection: what a deadline does
        pass


@contextmanager
def otlp_endpoint(kind: str) -> Iterator[tuple[str, list[bytes]]]:
    """``(URL, request heads received)`` of an endpoint that answers each request as ``kind`` says."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    listener.settimeout(ACCEPT_POLL_S)
    stop = threading.Event()
    heads: list[bytes] = []
    connections: list[socket.socket] = []
    threads: list[threading.Thread] = []

    def accept() -> None:
        while not stop.is_set():
            try:
                connection = listener.accept()[0]
            except TimeoutError:
                continue
            connections.append(connection)
            thread = threading.Thread(target=_answer, args=(kind, connection, stop, heads), daemon=True)
            threads.append(thread)
            thread.start()

    acceptor = threading.Thread(target=accept, name="otlp-endpoint", daemon=True)
    acceptor.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", heads
    finally:
        stop.set()
        for thread in [acceptor, *threads]:
            thread.join(timeout=5)
        listener.close()
        for connection in connections:
            connection.close()


def _export_one_span(endpoint: str) -> list[Any]:
    """What one export of one span returned (nothing if it had not returned after ``EXPORT_BOUND_S``)."""
    exporter = OTLPSpanExporter(**_otlp_args(TelemetryConfig(enabled=True, otlp_endpoint=endpoint), "traces"))
    span = TracerProvider(shutdown_on_exit=False).get_tracer("test").start_span("s")
    span.end()
    returned: list[Any] = []
    thread = threading.Thread(target=lambda: returned.append(exporter.export([span])), daemon=True)
    thread.start()
    thread.join(EXPORT_BOUND_S)
    exporter.shutdown()
    return returned


@pytest.mark.parametrize("kind", ["dripping_head", "dripping_body"])
def test_an_endpoint_that_drips_its_reply_fails_the_export_at_its_deadline(kind: str) -> None:
    with otlp_endpoint(kind) as (url, heads):
        returned = _export_one_span(url)
    assert returned == [SpanExportResult.FAILURE], f"the export had not ended after {EXPORT_BOUND_S} s"
    assert heads and heads[0].startswith(b"POST /v1/traces HTTP/1.1")


def test_a_prompt_endpoint_gets_the_export() -> None:
    with otlp_endpoint("prompt") as (url, heads):
        returned = _export_one_span(url)
    assert returned == [SpanExportResult.SUCCESS]
    assert len(heads) == 1 and heads[0].startswith(b"POST /v1/traces HTTP/1.1")
