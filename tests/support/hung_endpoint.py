"""An endpoint on 127.0.0.1 that accepts every connection and never reads or answers (a hung peer)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["hung_endpoint"]

ACCEPT_POLL_S = 0.1


@contextmanager
def hung_endpoint() -> Iterator[str]:
    """Its ``http://127.0.0.1:<port>`` URL; every connection it accepted is closed on exit."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    listener.settimeout(ACCEPT_POLL_S)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, name="hung-endpoint", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()
        for connection in held:
            connection.close()
