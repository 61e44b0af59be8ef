"""The worker processes of a server with ``num_workers: N`` (N > 1), behind its one port.

The server's main process holds the port (``reserve_port``: bound with ``SO_REUSEPORT``, never
listening, so no connection is queued on it) and starts N processes of the serve entry
(``python -m nemo_gym_ckpt.cli.serve <instance> --worker``); each binds its own listening socket
on the same port with ``SO_REUSEPORT`` (``bind_listener``) and serves it with uvicorn. The kernel
then spreads new connections over the N listeners by a hash of each connection, where one socket
shared by all would let the first worker to wake accept a whole burst of connections (a client's
pool opened at once lands on one worker). ``WorkerProcesses`` is our own small supervisor rather than
uvicorn's ``workers=`` one because the main process must stay an event loop (it runs the
coordinator, ``checkpoint/worker_hub.py``) and because a worker that dies must not be replaced
silently: a fresh worker would hold none of the episodes or sessions of the one that died, so the
whole server stops (the launcher then reports it) instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping

__all__ = ["BACKLOG", "STOP_GRACE_S", "WorkerProcesses", "bind_listener", "reserve_port"]

logger = logging.getLogger(__name__)
STOP_GRACE_S = 8.0
BACKLOG = 2048


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with ``SO_REUSEPORT`` and not listening: the port stays this
    server's (the workers bind it too) while no connection can wait on this socket."""
    sock = _reusing(host)
    sock.bind((host, port))
    return sock


def bind_listener(host: str, port: int) -> socket.socket:
    """One worker's listening socket on ``host:port`` (``SO_REUSEPORT``: the kernel spreads connections)."""
    sock = _reusing(host)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    return sock


def _reusing(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return sock


class WorkerProcesses:
    """N worker processes of one instance on one port; stops all when one ends."""

    def __init__(self, instance: str, count: int, env: Mapping[str, str]) -> None:
        self.instance, self.count, self.env = instance, count, dict(env)
        self.processes: list[asyncio.subprocess.Process] = []

    async def start(self, module: str) -> None:
        env = {**os.environ, **self.env}
        for _ in range(self.count):
            process = await asyncio.create_subprocess_exec(sys.executable, "-m", module, self.instance, "--worker",
                                                           env=env)
            self.processes.append(process)

    async def wait(self, stop: asyncio.Event) -> int:
        """Until ``stop`` is set (0) or a worker ends by itself (1); then every worker is stopped."""
        waits = [asyncio.ensure_future(process.wait()) for process in self.processes]
        stopping = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({*waits, stopping}, return_when=asyncio.FIRST_COMPLETED)
        status = 0 if stopping in done else 1
        if status:
            ended = [process.pid for process in self.processes if process.returncode is not None]
            logger.error("%s: worker %s ended; stopping the other workers", self.instance, ended)
        stopping.cancel()
        await self.stop()
        for task in waits:
            task.cancel()
        return status

    async def stop(self) -> None:
        """SIGTERM every live worker, wait up to ``STOP_GRACE_S``, then SIGKILL what is left."""
        live = [process for process in self.processes if process.returncode is None]
        for process in live:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(STOP_GRACE_S):
                await asyncio.gather(*(process.wait() for process in live))
        except TimeoutError:
            for process in live:
                if process.returncode is None:
                    logger.error("%s: worker %d did not stop; killing it", self.instance, process.pid)
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
            await asyncio.gather(*(process.wait() for process in live))
