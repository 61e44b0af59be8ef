"""Processes from config: the mesh behind ``nemo-gym-ckpt run CONFIG... [key=value...]`` (docs/architecture.md).

``MeshLauncher`` is the library API (used by the CLI, the collector and the tests)::

    with MeshLauncher(load_config(paths, overrides)) as mesh:
        mesh.start(ready_timeout_s=60)      # head server + one process per instance, all healthy
        mesh.url_of("policy_model")
        mesh.restart_all()                  # SIGKILL every server, fresh ones on the same ports
    # leaving the block stops everything: SIGTERM, bounded wait, SIGKILL, reap

An instance of NeMo Gym's own servers (``package: nemo_gym``) runs in NeMo Gym's environment: its
``python:`` or ``$NEMO_GYM_PYTHON`` (``nemo_gym_ckpt.launch.child.bridge_command``).

Ports: instances without a port get a free one on their host (probe-bind in the config's
``port_range_low``-``port_range_high``; where the config sets neither, ``$NEMO_GYM_CKPT_PORT_RANGE``
(``LOW-HIGH``) or else 10001-20000; never the head port, another instance's or one of
``disallowed_ports``). Each child is ``python -m nemo_gym_ckpt.cli.serve <instance>`` with the
path of the resolved config (ports filled in; a private JSON file, ``launch/config_file.py``,
removed at stop) in ``NEMO_GYM_CKPT_CONFIG_FILE`` and the launcher's pid in
``NEMO_GYM_CKPT_PARENT_PID``; it runs in its own process group (a terminal's Ctrl-C reaches only
the launcher, which stops the children in order) and exits by itself when the launcher dies.

Readiness: each child process gets a fresh instance token in ``NEMO_GYM_CKPT_INSTANCE_TOKEN``
(``launch/instance_token.py``), which its ``/health`` replies carry in a header. A server is up when
its ``/health`` answers 200 with its name and that token; a reply without the token comes from
another process on the port (another mesh's server of the same name, a stranger): the start fails at
once, naming the port, instead of taking that process for its own.

No orphans: a child's parent-death signal (Linux) fires when the *thread* that forked it ends, so
every child is forked by one spawner thread that lives from ``start`` to ``stop``; callers may use
any thread (``asyncio.to_thread`` included).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import IO

import httpx

from nemo_gym_ckpt.config import NEMO_GYM_PYTHON_ENV, PROJECT_ROOT, MeshConfig, NemoGymServerConfig
from nemo_gym_ckpt.errors import LaunchError, StopRequested
from nemo_gym_ckpt.launch.child import PARENT_ENV, SERVE_MODULE, bridge_command
from nemo_gym_ckpt.launch.config_file import CONFIG_FILE_ENV, ConfigFile
from nemo_gym_ckpt.launch.head import HEAD_NAME, ThreadedServer, create_head_app
from nemo_gym_ckpt.launch.health import POLL_S, HealthReply, probe_health, read_health, wait_for_health
from nemo_gym_ckpt.launch.instance_token import INSTANCE_TOKEN_ENV, new_token

__all__ = [
    "PORT_RANGE",
    "PORT_RANGE_ENV",
    "LaunchError",
    "LineSink",
    "MeshLauncher",
    "StopRequested",
    "assign_ports",
    "find_free_port",
    "probe_health",
    "wait_for_health",
]

logger = logging.getLogger(__name__)

PORT_RANGE = (10001, 20000)
PORT_RANGE_ENV = "NEMO_GYM_CKPT_PORT_RANGE"
"""Where a config sets no port range: the range free ports come from (``LOW-HIGH``), e.g. to keep
meshes started side by side on one host (parallel test workers) out of each other's ports."""
TAIL_LINES = 20
REAP_TIMEOUT_S = 5.0
MAX_LINE_BYTES = 64 * 1024
"""The longest line of a child's output the launcher keeps; the rest of a longer one is dropped."""
CUT_MARKER = f" [line cut at {MAX_LINE_BYTES} bytes, the rest dropped]"

LineSink = Callable[[str, str], None]
"""Receives ``(instance, line)`` for every line a child writes to stdout or stderr (at most
``MAX_LINE_BYTES`` of each, then ``CUT_MARKER``)."""


# ---- ports ---------------------------------------------------------------------------------------


def find_free_port(
    host: str, avoid: Iterable[int] = (), *, rng: random.Random | None = None,
    port_range: tuple[int, int] = PORT_RANGE,
) -> int:
    """A port of ``port_range`` that ``host`` can bind now and that is not in ``avoid``."""
    rng = rng or random.Random()
    avoid = set(avoid)
    for _ in range(200):
        port = rng.randint(*port_range)
        if port not in avoid and _can_bind(host, port):
            return port
    raise LaunchError(f"found no free port on {host} in {port_range[0]}-{port_range[1]}")


def _can_bind(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def assign_ports(mesh: MeshConfig, *, rng: random.Random | None = None, avoid: Iterable[int] = ()) -> MeshConfig:
    """The mesh with every unset (or 0) port, head server included, replaced by a free one.

    Free ports come from the config's ``port_range_low``..``port_range_high`` and are never one of
    its ``disallowed_ports`` nor of ``avoid`` (the ports of meshes assigned but not started yet).
    """
    port_range = _port_range(mesh)
    taken = {inst.settings.port for inst in mesh.instances.values() if inst.settings.port}
    taken |= {mesh.head_server.port, *mesh.ports.disallowed_ports, *avoid}
    head_port = mesh.head_server.port or find_free_port(mesh.head_server.host, taken, rng=rng,
                                                        port_range=port_range)
    taken.add(head_port)
    ports: dict[str, int] = {}
    for inst in mesh.instances.values():
        if not inst.settings.port:
            ports[inst.name] = find_free_port(inst.settings.host, taken, rng=rng, port_range=port_range)
            taken.add(ports[inst.name])
    return mesh.with_ports(ports, head_port=head_port)


def _port_range(mesh: MeshConfig) -> tuple[int, int]:
    """The config's range; where the config sets none, ``$NEMO_GYM_CKPT_PORT_RANGE`` (``LOW-HIGH``) if given."""
    configured = (mesh.ports.port_range_low, mesh.ports.port_range_high)
    text = os.environ.get(PORT_RANGE_ENV)
    if not text or mesh.ports.model_fields_set & {"port_range_low", "port_range_high"}:
        return configured
    low, sep, high = text.partition("-")
    if not (sep and low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high) <= 65535):
        raise LaunchError(f"{PORT_RANGE_ENV}={text!r}: expected LOW-HIGH, two ports in order (1-65535)")
    return int(low), int(high)


# ---- children ------------------------------------------------------------------------------------


def _log_line(name: str, line: str) -> None:
    logger.info("[%s] %s", name, line)


@dataclass
class _Child:
    """One server process, its log reader and the last lines it wrote."""

    name: str
    proc: subprocess.Popen[bytes]
    token: str
    """The instance token this process was given (its ``/health`` replies carry it)."""
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    reader: threading.Thread | None = None
    started_at: float = field(default_factory=time.time)

    def start_reader(self, sink: LineSink) -> None:
        stream = self.proc.stdout
        assert stream is not None
        self.reader = threading.Thread(
            target=self._read, args=(stream, sink), name=f"log-{self.name}", daemon=True
        )
        self.reader.start()

    def _read(self, stream: IO[bytes], sink: LineSink) -> None:
        with stream:
            for line in _bounded_lines(stream):
                self.tail.append(line)
                sink(self.name, line)

    def signal(self, sig: int) -> bool:
        """Signal the child's process group while the child lives; whether it was alive."""
        if self.proc.poll() is not None:
            return False
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def sweep(self) -> None:
        """SIGKILL whatever is left in the reaped child's process group (processes it started).

        While a member lives the group id cannot be reused; once the group is empty this finds
        nothing (ESRCH), short of the pid being reused in the moment since the reap.
        """
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def reap(self, timeout_s: float) -> bool:
        """Wait for the exit (bounded) and for the log reader; whether the child is gone."""
        try:
            self.proc.wait(timeout=max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            return False
        if self.reader is not None:
            self.reader.join(1.0)
        return True

    def exit_error(self, when: str) -> LaunchError:
        last = self.tail[-1] if self.tail else "(no output)"
        error = LaunchError(f"{self.name} exited with status {self.proc.returncode} {when}: {last}")
        error.add_note(f"last lines of {self.name}:\n" + "\n".join(self.tail))
        return error


def _bounded_lines(stream: IO[bytes]) -> Iterator[str]:
    """The lines of ``stream``, each cut at ``MAX_LINE_BYTES`` (marked with ``CUT_MARKER``) as soon as
    that much of it has come; the rest of a cut line is read and dropped, never held."""
    dropping = False
    while chunk := stream.readline(MAX_LINE_BYTES + 1):
        ends = chunk.endswith(b"\n")
        if dropping:
            dropping = not ends
            continue
        text = chunk[:MAX_LINE_BYTES].decode(errors="replace").rstrip("\r\n")
        dropping = len(chunk) > MAX_LINE_BYTES and not ends  # shorter without a newline: the output's end
        yield text + CUT_MARKER if dropping else text


# ---- the launcher --------------------------------------------------------------------------------


class MeshLauncher:
    """A head server in this process and one child process per server instance of ``mesh``."""

    def __init__(
        self,
        mesh: MeshConfig,
        *,
        on_line: LineSink = _log_line,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
        stop_grace_s: float = 5.0,
    ) -> None:
        self.config = mesh
        self.on_line = on_line
        self.python = python
        self.env = dict(os.environ if env is None else env)
        self.stop_grace_s = stop_grace_s
        self._resolved: MeshConfig | None = None
        self._head: ThreadedServer | None = None
        self._children: dict[str, _Child] = {}
        self._spawner: ThreadPoolExecutor | None = None
        self._stop_requested = False
        self._config_file = ConfigFile()
        self.killed: list[str] = []
        """The servers the last ``stop`` had to SIGKILL."""

    # -- what tests and callers read --

    @property
    def mesh(self) -> MeshConfig:
        """The resolved config (every port assigned) once started."""
        if self._resolved is None:
            raise LaunchError("the mesh is not started")
        return self._resolved

    @property
    def head_url(self) -> str:
        return self.mesh.head_url

    @property
    def names(self) -> list[str]:
        return list(self.config.instances)

    def url_of(self, name: str) -> str:
        return self.mesh.url_of(name)

    @property
    def pids(self) -> dict[str, int]:
        """The pid of every server process started and not yet stopped."""
        return {name: child.proc.pid for name, child in self._children.items()}

    def _processes(self) -> dict[str, tuple[int, float]]:
        """Each running child's pid and start time (the head's ``/server_instances``)."""
        return {name: (child.proc.pid, child.started_at) for name, child in dict(self._children).items()}

    def pid_of(self, name: str) -> int:
        return self._child(name).proc.pid

    def returncode(self, name: str) -> int | None:
        """The child's exit status, or None while it runs."""
        return self._child(name).proc.poll()

    def _child(self, name: str) -> _Child:
        try:
            return self._children[name]
        except KeyError:
            raise LaunchError(f"no running server process named {name!r}") from None

    # -- lifecycle --

    def start(self, ready_timeout_s: float = 120.0) -> None:
        """Assign ports, start the head server and every child, and wait until all are healthy.

        One deadline covers every server. If a child exits first, or the deadline passes, everything
        started is stopped again and ``LaunchError`` (``StopRequested`` after ``request_stop``) says why.
        """
        if self._resolved is not None:
            raise LaunchError("the mesh is already started")
        started = time.monotonic()
        self._resolved = assign_ports(self.config)
        try:
            self._start_head()
            self._spawn(self.names)
            self._wait_ready(self.names, started + ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        logger.info("mesh of %d servers ready in %.1f s; head server at %s",
                    len(self.names), time.monotonic() - started, self.head_url)

    def _start_head(self) -> None:
        head = self.mesh.head_server
        app = create_head_app(self.mesh, processes=self._processes)
        server = ThreadedServer(app, head.host, head.port, name=HEAD_NAME)
        try:
            server.start()
        except OSError as error:
            where = f"{head.host}:{head.port}"
            raise LaunchError(f"head server cannot listen on {where}: {error.strerror}") from None
        self._head = server

    def _child_env(self) -> dict[str, str]:
        env = dict(self.env)
        env[CONFIG_FILE_ENV] = str(self._config_file.write(self.mesh.raw))
        env[PARENT_ENV] = str(os.getpid())
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _spawn(self, names: Iterable[str]) -> None:
        env = self._child_env()
        if self._spawner is None:
            self._spawner = ThreadPoolExecutor(1, thread_name_prefix="mesh-spawner")
        for name in names:
            token = new_token()  # fresh for each process: a leftover of an earlier one is a stranger too
            proc = self._spawner.submit(
                subprocess.Popen,
                self._command(name),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                env={**env, INSTANCE_TOKEN_ENV: token}, process_group=0,
            ).result()
            child = self._children[name] = _Child(name, proc, token)
            child.start_reader(self.on_line)
            logger.debug("started %s (pid %d) at %s", name, proc.pid, self.url_of(name))

    def _command(self, name: str) -> list[str]:
        """The command line of one server: ours, or NeMo Gym's own in its environment's Python."""
        instance = self.mesh.instance(name)
        settings = instance.settings
        if not isinstance(settings, NemoGymServerConfig):
            return [self.python, "-m", SERVE_MODULE, name]
        python = settings.python or self.env.get(NEMO_GYM_PYTHON_ENV)
        if not python:
            raise LaunchError(f"{name} is NeMo Gym's {instance.implementation}: set its python: or "
                              f"{NEMO_GYM_PYTHON_ENV} to the interpreter of a NeMo Gym environment "
                              f"(scripts/nemo_gym_env.sh builds one)")
        return bridge_command(python, PROJECT_ROOT, name)

    def _wait_ready(self, names: Iterable[str], deadline: float) -> None:
        pending = set(names)
        with httpx.Client(trust_env=False, timeout=1.0) as http:
            while pending:
                self._check_running("before it was healthy")
                if self._stop_requested:
                    raise StopRequested("stopped on request before the mesh was ready")
                pending = {name for name in pending if not self._is_up(http, name)}
                if pending and time.monotonic() > deadline:
                    raise LaunchError(f"not healthy before the deadline: {', '.join(sorted(pending))}")
                if pending:
                    time.sleep(POLL_S)

    def _is_up(self, http: httpx.Client, name: str) -> bool:
        """Whether the process started for ``name`` answers healthy; ``LaunchError`` when another does."""
        url = self.url_of(name)
        reply = read_health(http, url)
        if reply is None:
            return False
        if not reply.from_process(self._children[name].token):
            raise self._port_held_elsewhere(name, url, reply)
        return reply.healthy_as(name)

    def _port_held_elsewhere(self, name: str, url: str, reply: HealthReply) -> LaunchError:
        port = self.mesh.instance(name).settings.port
        return LaunchError(
            f"{name}: another process answers {url}/health ({reply.describe()}, not the process "
            f"this launch started for {name}): port {port} is taken, by another mesh or server; "
            f"stop that one or give {name} another port"
        )

    def _check_running(self, when: str) -> None:
        for child in self._children.values():
            if child.proc.poll() is not None:
                child.reap(REAP_TIMEOUT_S)
                raise child.exit_error(when)

    @property
    def stop_requested(self) -> bool:
        """Whether ``request_stop`` was called (by a signal handler) since the last ``stop``."""
        return self._stop_requested

    def request_stop(self) -> None:
        """Make ``wait`` return and ``start`` give up (safe to call from a signal handler)."""
        self._stop_requested = True

    def wait(self, poll_s: float = 0.2) -> str | None:
        """Block until ``request_stop`` (returns None) or until a child exits (returns its name)."""
        while not self._stop_requested:
            for child in self._children.values():
                if child.proc.poll() is not None:
                    return child.name
            time.sleep(poll_s)
        return None

    def exited(self) -> str | None:
        """One line naming the first server process that has exited (None while every one runs)."""
        for child in self._children.values():
            if child.proc.poll() is not None:
                return f"{child.name} exited with status {child.proc.returncode}"
        return None

    def kill(self, name: str, sig: int = signal.SIGKILL) -> bool:
        """Send ``sig`` to one server's process group (no reaping); whether it was running."""
        return self._child(name).signal(sig)

    def kill_all(self, sig: int = signal.SIGKILL, timeout_s: float = REAP_TIMEOUT_S) -> list[str]:
        """Send ``sig`` to every running server and reap them all; the names that were running."""
        running = [child for child in self._children.values() if child.signal(sig)]
        deadline = time.monotonic() + timeout_s
        children = self._children.values()
        stuck = [child.name for child in children if not child.reap(deadline - time.monotonic())]
        if stuck:
            name = signal.Signals(sig).name
            raise LaunchError(f"still running {timeout_s:g} s after {name}: {', '.join(stuck)}")
        for child in children:
            child.sweep()
        return [child.name for child in running]

    def restart_all(self, ready_timeout_s: float = 120.0) -> None:
        """SIGKILL every server process and start fresh ones on the same ports, all healthy."""
        self.kill_all(signal.SIGKILL)
        self.restart(*self.names, ready_timeout_s=ready_timeout_s)

    def restart(self, *names: str, ready_timeout_s: float = 120.0) -> None:
        """Start fresh processes for servers that have exited (see ``kill``), and wait for them."""
        alive = [name for name in names if self.returncode(name) is None]
        if alive:
            raise LaunchError(f"cannot restart running servers: {', '.join(alive)}")
        for name in names:
            self._child(name).reap(REAP_TIMEOUT_S)
        self._spawn(names)
        self._wait_ready(names, time.monotonic() + ready_timeout_s)

    def stop(self) -> list[str]:
        """Stop every child (SIGTERM, bounded wait, SIGKILL, reap) and the head server.

        Returns the names of the servers that were still running; those that needed SIGKILL are
        logged and left in ``killed``.
        """
        if self._head is not None:
            self._head.begin_stop()  # the head server shuts down while the children do
        running = [child for child in self._children.values() if child.signal(signal.SIGTERM)]
        deadline = time.monotonic() + self.stop_grace_s
        killed = [child for child in running if not child.reap(deadline - time.monotonic())]
        for child in killed:
            child.signal(signal.SIGKILL)
        for child in self._children.values():
            if not child.reap(REAP_TIMEOUT_S):
                logger.error("%s (pid %d) survived SIGKILL", child.name, child.proc.pid)
            child.sweep()
        self.killed = [child.name for child in killed]
        if killed:
            logger.warning("killed after %g s without exit: %s", self.stop_grace_s, ", ".join(self.killed))
        self._children.clear()
        if self._spawner is not None:
            self._spawner.shutdown()
            self._spawner = None
        if self._head is not None:
            self._head.stop()
            self._head = None
        self._config_file.remove()
        self._resolved = None
        self._stop_requested = False
        return [child.name for child in running]

    def __enter__(self) -> MeshLauncher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
