"""The worker processes of a server with ``num_workers: N`` (N > 1), behind its one port.

The server's main process holds the port (``reserve_port``: bound with ``SO_REUSEPORT``, never
listening, so no connection is queued on it; refused, as a single-process server's bind is, when
anything listens on the port already), imports the app's module and forks N workers before
it starts any thread or event loop (``WorkerProcesses.fork``: a worker starts in well under a
second, with nothing to import again); each binds its own listening socket
on the same port with ``SO_REUSEPORT`` (``bind_listener``) and serves it with uvicorn. The kernel
then spreads new connections over the N listeners by a hash of each connection, where one socket
shared by all would let the first worker to wake accept a whole burst of connections (a client's
pool opened at once lands on one worker). ``WorkerProcesses`` is our own small supervisor rather than
uvicorn's ``workers=`` one because the main process must stay an event loop (it runs the
coordinator, ``checkpoint/worker_hub.py``), because uvicorn's would import the app again in
every worker, and because a worker that dies must not be replaced
silently: a fresh worker would hold none of the episodes or sessions of the one that died, so the
whole server stops (the launcher then reports it) instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["BACKLOG", "RUNTIME_PREFIX", "STOP_GRACE_S", "WorkerProcesses", "bind_listener", "reserve_port",
           "runtime_dir"]

logger = logging.getLogger(__name__)
STOP_GRACE_S = 6.0
RUNTIME_PREFIX = "ngc-workers-"
_OWNER = "owner.pid"
POLL_S = 0.2
BACKLOG = 4096
"""The listen queue of every server's socket (uvicorn's own default is 2,048; the kernel caps it at
``net.core.somaxconn``, 4,096 on current kernels). Thousands of rollouts connect at once at a level's
start; a connection the full queue drops is made again by the client's SYN retries, seconds later."""


def runtime_dir() -> Path:
    """A private directory (mode 700) for this server's coordinator socket, naming its owner's pid.

    Directories of owners that are gone (a SIGKILLed server cannot remove its own) are removed first.
    """
    base = Path(tempfile.gettempdir())
    for stale in base.glob(f"{RUNTIME_PREFIX}*"):
        with contextlib.suppress(OSError, ValueError):
            if not _alive(int((stale / _OWNER).read_text())):
                shutil.rmtree(stale, ignore_errors=True)
    directory = Path(tempfile.mkdtemp(prefix=RUNTIME_PREFIX))
    (directory / _OWNER).write_text(str(os.getpid()))
    return directory


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with ``SO_REUSEPORT`` and not listening: the port stays this
    server's (the workers bind it too) while no connection can wait on this socket.

    ``OSError`` (``EADDRINUSE``) if anything listens on the port already, as a single-process server
    gets it: ``SO_REUSEPORT`` alone would let this server's workers share the port with another
    server's ``SO_REUSEPORT`` listeners of the same user (the kernel would split the connections), so
    the port is first probed with a plain bind (``SO_REUSEADDR`` as uvicorn binds, which a listener
    of anyone refuses).
    """
    _refuse_if_listened_on(host, port)
    sock = _reusing(host)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _refuse_if_listened_on(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT left is no owner
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            raise OSError(errno.EADDRINUSE, f"error while attempting to bind on address {(host, port)!r}: "
                          "address already in use") from None


def bind_listener(host: str, port: int) -> socket.socket:
    """One worker's listening socket on ``host:port`` (``SO_REUSEPORT``: the kernel spreads connections)."""
    sock = _reusing(host)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    return sock


def _reusing(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, so asyncio sets TCP_NODELAY on the connections (``head.bind_socket`` says why)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return sock


class WorkerProcesses:
    """N forked worker processes of one instance on one port; stops all when one ends."""

    def __init__(self, instance: str, pids: list[int]) -> None:
        self.instance, self.pids = instance, pids
        self.ended: dict[int, int] = {}

    @classmethod
    def fork(cls, instance: str, count: int, serve: Callable[[], None]) -> WorkerProcesses:
        """Fork ``count`` children that each run ``serve`` and exit. Call it before any event loop
        or thread starts in this process (a child has only the forking thread)."""
        pids = []
        for _ in range(count):
            pid = os.fork()
            if pid == 0:  # the worker
                status = 1
                try:
                    serve()
                    status = 0
                except SystemExit as stopped:  # a config error's status is kept
                    status = stopped.code if isinstance(stopped.code, int) else 1
                finally:
                    os._exit(status)
            pids.append(pid)
        return cls(instance, pids)

    def _reap(self) -> None:
        for pid in self.pids:
            if pid in self.ended:
                continue
            with contextlib.suppress(ChildProcessError):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self.ended[pid] = os.waitstatus_to_exitcode(status)

    @property
    def live(self) -> list[int]:
        self._reap()
        return [pid for pid in self.pids if pid not in self.ended]

    async def wait(self, stop: asyncio.Event) -> int:
        """Until ``stop`` is set (0) or a worker ends by itself (its exit status, at least 1); then
        every worker is stopped."""
        while not stop.is_set() and len(self.live) == len(self.pids):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S):
                    await stop.wait()
        status = 0 if stop.is_set() else max(1, *self.ended.values())
        if status:
            logger.error("%s: worker(s) %s ended; stopping the other workers", self.instance, sorted(self.ended))
        await self.stop()
        return status

    async def stop(self) -> None:
        """SIGTERM every live worker, wait up to ``STOP_GRACE_S``, then SIGKILL what is left."""
        for pid in self.live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S / 4)
        for pid in self.live:
            logger.error("%s: worker %d did not stop; killing it", self.instance, pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        while self.live:
            await asyncio.sleep(POLL_S / 4)
