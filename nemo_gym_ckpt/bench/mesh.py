"""The one mesh launcher of the benches, and what they read off a running mesh.

``launched_mesh`` starts a config (the quickstart by default) on a free head port with server lines
dropped, ``launched_meshes`` several of them side by side (their process starts overlap);
``mesh_urls`` follows the environment's references to every hop of a rollout; ``CpuMeter`` reads the
CPU seconds of each server process, of the bench itself and of the machine over a window (from
``/proc``); ``PhaseCpu`` the CPU milliseconds of each of them in each phase of one pause
(``/proc/<pid>/task/*/schedstat``: nanoseconds, where ``stat`` counts 10 ms ticks); ``loadavg``
says how loaded the machine was.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_gym_ckpt.collect.tasks import default_input, read_tasks, resolve_input
from nemo_gym_ckpt.config import PROJECT_ROOT, MeshConfig, load_config
from nemo_gym_ckpt.launch.launcher import MeshLauncher, assign_ports

__all__ = [
    "CALL_TIMEOUT_S",
    "MESH_READY_S",
    "QUICKSTART",
    "CpuMeter",
    "MeshUrls",
    "PhaseCpu",
    "checkpoint_root",
    "launched_mesh",
    "launched_meshes",
    "loadavg",
    "mesh_urls",
    "quiet",
    "task_rows",
]

Result = dict[str, Any]

QUICKSTART = PROJECT_ROOT / "configs" / "quickstart.yaml"
CALL_TIMEOUT_S = 600.0
MESH_READY_S = 300.0


@contextmanager
def checkpoint_root(prefix: str) -> Iterator[Path]:
    """A temporary checkpoint root, removed at the end together with what the inference worker
    staged beside it (``<root>.generation-cuts``, its default staging directory)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as directory:
        try:
            yield Path(directory)
        finally:
            shutil.rmtree(f"{directory}.generation-cuts", ignore_errors=True)


def _process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (all its threads) and of its live child processes (the
    workers of a ``num_workers`` server), or None without ``/proc``."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own + sum(_process_cpu_s(child) or 0.0 for child in _children(pid))


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _process_cpu_ns(pid: int) -> int | None:
    """Nanoseconds on a CPU of every thread of ``pid`` and of its live child processes, or None
    without ``/proc`` (a thread that ends while it is read counts no more)."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for thread in threads:
        try:
            total += int(Path(f"/proc/{pid}/task/{thread}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total + sum(_process_cpu_ns(child) or 0 for child in _children(pid))


def _machine_cpu_s() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot, or None without ``/proc``."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except OSError:
        return None
    idle = values[3] + values[4]
    ticks = os.sysconf("SC_CLK_TCK")
    return (sum(values) - idle) / ticks, sum(values) / ticks


class CpuMeter:
    """CPU seconds spent by each server process, this process and the machine over a window."""

    def __init__(self, pids: dict[str, int]) -> None:
        self._pids = pids
        self._began: tuple[float, dict[str, float | None], float, tuple[float, float] | None] | None = None

    def _snapshot(self) -> tuple[float, dict[str, float | None], float, tuple[float, float] | None]:
        servers = {name: _process_cpu_s(pid) for name, pid in self._pids.items()}
        return time.perf_counter(), servers, time.process_time(), _machine_cpu_s()

    def start(self) -> None:
        self._began = self._snapshot()

    def stop(self) -> Result:
        """``cpu_s`` per process (``driver``: this one), busy cores of the mesh and of the machine."""
        assert self._began is not None, "stop() before start()"
        (t0, servers0, own0, machine0), (t1, servers1, own1, machine1) = self._began, self._snapshot()
        cpu = {name: round(end - start, 3) for name, start in servers0.items()
               if start is not None and (end := servers1[name]) is not None}
        cpu["driver"] = round(own1 - own0, 3)
        wall = t1 - t0
        usage: Result = {"cpu_s": cpu, "mesh_busy_cores": round(sum(cpu.values()) / wall, 2),
                         "loadavg_1m": round(os.getloadavg()[0], 2)}
        if machine0 is not None and machine1 is not None:
            usage["machine_busy_cores"] = round((machine1[0] - machine0[0]) / wall, 2)
            usage["machine_cores"] = round((machine1[1] - machine0[1]) / wall, 2)
        return usage


@dataclass(frozen=True)
class MeshUrls:
    environment: str
    agent: str
    policy: str
    worker: str
    resources: str
    served_model: str
    worker_settings: Any


def mesh_urls(mesh: MeshConfig) -> MeshUrls:
    """The quickstart's hops, found by following the environment's references."""
    (environment,) = mesh.of_type("environment_servers")
    agent = mesh.instance(environment.settings.agent_server.name)  # type: ignore[attr-defined]
    policy = mesh.instance(agent.settings.model_server.name)  # type: ignore[attr-defined]
    worker = mesh.instance(policy.settings.worker.name)  # type: ignore[attr-defined]
    resources = mesh.url_of(environment.settings.resources_server)  # type: ignore[attr-defined]
    return MeshUrls(environment.url, agent.url, policy.url, worker.url, resources,
                    worker.settings.served_model_name, worker.settings)  # type: ignore[attr-defined]


def task_rows(mesh: MeshConfig) -> list[dict[str, Any]]:
    (environment,) = mesh.of_type("environment_servers")
    return read_tasks(resolve_input(default_input(mesh, environment.name)), None)


def quiet(_: str, __: str) -> None:
    """Drop server log lines during measurements."""


@contextmanager
def launched_mesh(overrides: Sequence[str] = (), config: Path = QUICKSTART) -> Iterator[MeshLauncher]:
    """The mesh of ``config`` (with ``overrides``, on a free head port) started and ready, server lines dropped."""
    mesh = load_config([config], ["head_server.port=0", *overrides])
    with MeshLauncher(mesh, on_line=quiet) as launcher:
        launcher.start(ready_timeout_s=MESH_READY_S)
        yield launcher


@contextmanager
def launched_meshes(
    overrides: Mapping[str, Sequence[str]], config: Path = QUICKSTART
) -> Iterator[dict[str, MeshLauncher]]:
    """One mesh of ``config`` per entry of ``overrides`` (its name: that mesh's overrides), all started at
    once, each from a thread of its own, and ready; server lines dropped. Their ports are picked here,
    one mesh after another, so that no two meshes pick the same free port before either binds it."""
    launchers: dict[str, MeshLauncher] = {}
    taken: set[int] = set()
    for name, extra in overrides.items():
        mesh = assign_ports(load_config([config], ["head_server.port=0", *extra]), avoid=taken)
        ports = [mesh.head_server.port, *(instance.settings.port for instance in mesh.instances.values())]
        taken.update(port for port in ports if port is not None)
        launchers[name] = MeshLauncher(mesh, on_line=quiet)
    with ExitStack() as stack:
        for launcher in launchers.values():
            stack.enter_context(launcher)  # each one stopped on the way out, started or not
        with ThreadPoolExecutor(max(len(launchers), 1), thread_name_prefix="bench-mesh-start") as pool:
            starts = [pool.submit(launcher.start, ready_timeout_s=MESH_READY_S) for launcher in launchers.values()]
        for start in starts:  # every start has ended (MESH_READY_S bounds each): the first failure, if any
            start.result()
        yield launchers


def loadavg() -> list[float]:
    """The machine's load averages (1, 5, 15 minutes), rounded."""
    return [round(value, 2) for value in os.getloadavg()]


class PhaseCpu:
    """CPU milliseconds of each server process and of this one (``driver``) between marks: one mark
    before a pause, one after each of its phases. Each mark reads a few files per thread (about a
    millisecond for a mesh); ``marks_ms`` says how long the marks inside the pause took."""

    def __init__(self, pids: dict[str, int]) -> None:
        self._pids = pids
        self._marks: list[tuple[float, dict[str, int | None]]] = []

    def mark(self) -> None:
        began = time.perf_counter()
        readings = {name: _process_cpu_ns(pid) for name, pid in self._pids.items()}
        readings["driver"] = time.process_time_ns()
        self._marks.append((time.perf_counter() - began, readings))

    def phases(self, names: Sequence[str]) -> Result:
        """``{phase: {process: ms}}`` for the phases between consecutive marks, and ``marks_ms``."""
        if len(self._marks) != len(names) + 1:
            raise ValueError(f"{len(names)} phases need {len(names) + 1} marks, got {len(self._marks)}")
        phases: Result = {}
        for name, (_, before), (_, after) in zip(names, self._marks[:-1], self._marks[1:], strict=True):
            phases[name] = {process: round((end - start) / 1e6, 1) for process, start in before.items()
                            if start is not None and (end := after.get(process)) is not None}
        phases["marks_ms"] = round(1000 * sum(took for took, _ in self._marks[1:-1]), 2)
        return phases
