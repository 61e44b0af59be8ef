"""The launcher with real server processes: start, list, restart, fail fast, stop, and no orphans."""

from __future__ import annotations

import errno
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from nemo_gym_ckpt.config import load_config
from nemo_gym_ckpt.launch.head import ThreadedServer
from nemo_gym_ckpt.launch.instance_token import new_token
from nemo_gym_ckpt.launch.launcher import (
    LaunchError,
    MeshLauncher,
    StopRequested,
    _Child,
    assign_ports,
    find_free_port,
    wait_for_health,
)
from nemo_gym_ckpt.launch.workers import bind_listener, reserve_port
from nemo_gym_ckpt.server import create_app

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find orphans"),
]

FIXTURES = Path(__file__).parents[1] / "fixtures"
TWO = "two_string_match.yaml"
ORPHAN_DEADLINE_S = 10.0
DYING_START_READY_S = 60.0
"""The ready deadline of a start whose server dies: the start ends at the death, long before it (the
death takes a server process's start, imports and bind: 4 to 6 s at a load of 4 on 2 cores)."""

Launch = Callable[..., MeshLauncher]


# ---- helpers -------------------------------------------------------------------------------------


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.05)


def still_alive_for(duration_s: float, mesh: MeshLauncher) -> None:
    """Every server keeps running for ``duration_s`` (a bounded check for an exit that must not come)."""
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        exited = {name: mesh.returncode(name) for name in mesh.names if mesh.returncode(name) is not None}
        assert not exited, f"servers exited: {exited}"
        time.sleep(0.05)


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first), None if there is no such pid."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rsplit(")", 1)[1].split()


def is_gone(pid: int) -> bool:
    """No such process, or only its zombie (whoever inherited it may never reap it)."""
    fields = _stat_fields(pid)
    return fields is None or fields[0] in ("Z", "X")


def child_pids(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        fields = _stat_fields(int(entry.name)) if entry.name.isdigit() else None
        if fields is not None and int(fields[1]) == parent and fields[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return sorted(found)


def get_json(url: str) -> object:
    with httpx.Client(trust_env=False, timeout=5.0) as http:
        response = http.get(url)
        response.raise_for_status()
        return response.json()


class CliRun:
    """``nemo-gym-ckpt run ...`` as a real process, its stdout lines collected by a thread."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nemo_gym_ckpt", "run", *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.stdout: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.children: list[int] = []

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def line_starting(self, prefix: str, timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                missing = f"no line starting {prefix!r} within {timeout_s:g} s"
                raise AssertionError(f"{missing}: {self.stdout}") from None
            self.stdout.append(line)
            if line.startswith(prefix):
                return line

    def wait_ready(self, timeout_s: float = 30.0) -> str:
        head_url = self.line_starting("head server: ", timeout_s).removeprefix("head server: ")
        self.children = child_pids(self.proc.pid)
        return head_url

    def finish(self, timeout_s: float = ORPHAN_DEADLINE_S) -> tuple[int, str]:
        status = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout_s)
        while not self.lines.empty():
            self.stdout.append(self.lines.get())
        assert self.proc.stderr is not None
        return status, self.proc.stderr.read()

    def cleanup(self) -> None:
        children = self.children or child_pids(self.proc.pid)  # a run no test waited on: its servers too
        for pid in [self.proc.pid, *children]:
            if not is_gone(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


STOPPED_RUNS = ("SIGTERM", "SIGINT", "SIGKILL", "one_server_dies")
"""The tests that stop a ``run`` of the two-server config, each its own run."""
RUNS_READY_S = 60.0
"""How long each of those runs may take to say its head server (all of them start at once)."""


@pytest.fixture(scope="module")
def two_server_runs() -> Iterator[dict[str, CliRun]]:
    """A ``run`` of the two-server config for each of ``STOPPED_RUNS``, all started at once (their
    process starts overlap), on ports picked here, one run after another, so that no two runs pick the
    same free port before either binds it."""
    taken: set[int] = set()
    runs: dict[str, CliRun] = {}
    try:
        for key in STOPPED_RUNS:
            placed = assign_ports(load_config([FIXTURES / TWO], ["head_server.port=0"]), avoid=taken)
            ports = {"head_server.port": placed.head_server.port,
                     **{f"{name}.resources_servers.string_match.port": placed.instances[name].settings.port
                        for name in ("sm", "sm_loose")}}
            taken.update(port for port in ports.values() if port is not None)
            runs[key] = CliRun(str(FIXTURES / TWO), *(f"{key_}={port}" for key_, port in ports.items()))
        yield runs
    finally:
        for run in runs.values():
            run.cleanup()


# ---- the library API -----------------------------------------------------------------------------


def test_mesh_starts_lists_its_servers_and_stops(launch_mesh: Launch) -> None:
    mesh = launch_mesh(TWO)
    listing = get_json(f"{mesh.head_url}/servers")
    assert listing == [
        {"name": name, "type": "resources_servers", "implementation": "string_match", "url": url}
        for name, url in (("sm", mesh.url_of("sm")), ("sm_loose", mesh.url_of("sm_loose")))
    ]
    for name in mesh.names:
        assert get_json(f"{mesh.url_of(name)}/health") == {"status": "ok", "name": name}
    pids = mesh.pids
    assert sorted(mesh.stop()) == ["sm", "sm_loose"]
    assert mesh.killed == []
    assert all(is_gone(pid) for pid in pids.values())


def test_restart_all_gives_fresh_processes_on_the_same_ports(launch_mesh: Launch) -> None:
    mesh = launch_mesh(TWO)
    urls = {name: mesh.url_of(name) for name in mesh.names}
    before = mesh.pids
    worker = threading.Thread(target=mesh.restart_all, kwargs={"ready_timeout_s": 20.0})
    worker.start()  # a thread that ends: the new servers must outlive it (parent-death signal)
    worker.join(30.0)
    assert not worker.is_alive()
    after = mesh.pids
    still_alive_for(1.5, mesh)
    assert set(after) == set(before) and not set(after.values()) & set(before.values())
    assert all(is_gone(pid) for pid in before.values())
    assert {name: mesh.url_of(name) for name in mesh.names} == urls
    for name, url in urls.items():
        wait_for_health(url, timeout_s=1.0, name=name)


def test_one_killed_server_can_be_restarted(launch_mesh: Launch) -> None:
    mesh = launch_mesh("string_match.yaml")
    url = mesh.url_of("sm")
    assert mesh.exited() is None
    assert mesh.kill("sm")
    wait_until(lambda: mesh.returncode("sm") == -signal.SIGKILL, 5.0, "sm reaped after SIGKILL")
    assert mesh.exited() == f"sm exited with status {-signal.SIGKILL}"  # what a collection stops on
    mesh.restart("sm", ready_timeout_s=20.0)
    assert mesh.exited() is None
    assert mesh.url_of("sm") == url
    wait_for_health(url, timeout_s=1.0, name="sm")
    with pytest.raises(LaunchError, match="cannot restart running servers: sm"):
        mesh.restart("sm")


def test_a_server_that_dies_while_starting_fails_the_start_fast_with_its_log() -> None:
    lines: list[tuple[str, str]] = []
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", find_free_port("127.0.0.1")))
        port = blocker.getsockname()[1]
        mesh = load_config([FIXTURES / TWO],
                           ["head_server.port=0", f"sm.resources_servers.string_match.port={port}"])
        launcher = MeshLauncher(mesh, on_line=lambda name, line: lines.append((name, line)))
        started = time.monotonic()
        with pytest.raises(LaunchError) as caught:
            launcher.start(ready_timeout_s=DYING_START_READY_S)
        elapsed = time.monotonic() - started
    message = str(caught.value)
    expected = r"sm exited with status [1-9]\d* before it was healthy: .*address already in use"
    assert re.fullmatch(expected, message), message
    assert any("last lines of sm" in note for note in caught.value.__notes__)
    assert any(name == "sm" and "address already in use" in line for name, line in lines)
    assert elapsed < DYING_START_READY_S, "must not wait for the whole deadline"
    assert launcher.pids == {}
    servers = [pid for pid in child_pids(os.getpid()) if "nemo_gym_ckpt.cli.serve" in _cmdline(pid)]
    assert servers == [], "the other server must be stopped too"


def reuseport_listener() -> socket.socket:
    """A listener with ``SO_REUSEPORT`` on a free port of 127.0.0.1, as another multi-worker server's
    worker of this user holds its port (a plain bind cannot share it, a ``SO_REUSEPORT`` one could)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", find_free_port("127.0.0.1")))
    sock.listen()
    return sock


def test_a_multi_worker_server_refuses_a_port_another_reuseport_listener_holds() -> None:
    with reuseport_listener() as other:
        port = other.getsockname()[1]
        with pytest.raises(OSError, match="address already in use") as caught:
            reserve_port("127.0.0.1", port).close()
        assert caught.value.errno == errno.EADDRINUSE
    reserved = reserve_port("127.0.0.1", port)  # free again: its own workers still share the port
    with reserved, bind_listener("127.0.0.1", port), bind_listener("127.0.0.1", port):
        pass


def test_a_multi_worker_server_on_a_taken_port_fails_the_start_like_a_single_process_one() -> None:
    lines: list[tuple[str, str]] = []
    with reuseport_listener() as other:
        port = other.getsockname()[1]
        mesh = load_config([FIXTURES / "string_match.yaml"], [
            "head_server.port=0", f"sm.resources_servers.string_match.port={port}",
            "sm.resources_servers.string_match.num_workers=2"])
        launcher = MeshLauncher(mesh, on_line=lambda name, line: lines.append((name, line)))
        try:
            with pytest.raises(LaunchError) as caught:
                launcher.start(ready_timeout_s=60.0)
        finally:
            launcher.stop()
    message = str(caught.value)
    expected = r"sm exited with status [1-9]\d* before it was healthy: .*address already in use"
    assert re.fullmatch(expected, message), message
    assert any(name == "sm" and "address already in use" in line for name, line in lines)
    assert launcher.pids == {}


def sm_on(port: int) -> MeshLauncher:
    """A launcher of the one-server config with ``sm`` on ``port``."""
    return MeshLauncher(load_config([FIXTURES / "string_match.yaml"],
                                    ["head_server.port=0", f"sm.resources_servers.string_match.port={port}"]))


def taken_port_message(url: str, port: int) -> str:
    """What a start says when another process named sm answers on sm's port."""
    return (rf"sm: another process answers {re.escape(url)}/health \(status 200 naming itself 'sm', not the "
            rf"process this launch started for sm\): port {port} is taken, by another mesh or server; "
            r"stop that one or give sm another port")


def test_a_second_mesh_on_the_same_port_fails_instead_of_taking_the_first_ones_server(
    launch_mesh: Launch,
) -> None:
    first = launch_mesh("string_match.yaml")
    url, pid = first.url_of("sm"), first.pid_of("sm")
    port = first.mesh.instance("sm").settings.port
    assert port is not None
    second = sm_on(port)
    with pytest.raises(LaunchError) as caught:  # the old probe took the first mesh's sm for its own
        second.start(ready_timeout_s=60.0)
    assert re.fullmatch(taken_port_message(url, port), str(caught.value)), caught.value
    assert second.pids == {}
    assert first.pid_of("sm") == pid and first.returncode("sm") is None
    wait_for_health(url, timeout_s=1.0, name="sm")


def test_a_stranger_named_like_the_server_on_its_port_fails_the_start() -> None:
    with ThreadedServer(create_app("sm"), "127.0.0.1", 0) as stranger:
        launcher = sm_on(stranger.port)
        with pytest.raises(LaunchError) as caught:
            launcher.start(ready_timeout_s=60.0)
        assert re.fullmatch(taken_port_message(stranger.url, stranger.port), str(caught.value)), caught.value
        assert launcher.pids == {}


def test_a_restart_does_not_take_a_stranger_on_the_freed_port_for_its_server(launch_mesh: Launch) -> None:
    mesh = launch_mesh("string_match.yaml")
    url = mesh.url_of("sm")
    port = mesh.mesh.instance("sm").settings.port
    assert port is not None and mesh.kill("sm")
    wait_until(lambda: mesh.returncode("sm") is not None, 5.0, "sm reaped after SIGKILL")
    with ThreadedServer(create_app("sm"), "127.0.0.1", port), pytest.raises(LaunchError) as caught:
        mesh.restart("sm", ready_timeout_s=60.0)
    assert re.fullmatch(taken_port_message(url, port), str(caught.value)), caught.value


def test_a_stop_requested_before_the_servers_are_up_ends_the_start() -> None:
    launcher = MeshLauncher(load_config([FIXTURES / "string_match.yaml"], ["head_server.port=0"]))
    launcher.request_stop()  # what the run command's SIGINT/SIGTERM handler does
    assert launcher.stop_requested
    with pytest.raises(StopRequested, match="before the mesh was ready"):
        launcher.start(ready_timeout_s=30.0)
    assert launcher.pids == {} and not launcher.stop_requested
    assert not [pid for pid in child_pids(os.getpid()) if "nemo_gym_ckpt.cli.serve" in _cmdline(pid)]


def head_answers(head_url: str) -> bool:
    try:
        get_json(f"{head_url}/servers")
    except httpx.TransportError:
        return False
    return True


def test_stop_kills_a_server_that_does_not_exit_on_sigterm(launch_mesh: Launch) -> None:
    mesh = launch_mesh("string_match.yaml", stop_grace_s=2.0)
    pid, head_url = mesh.pid_of("sm"), mesh.head_url
    assert mesh.kill("sm", signal.SIGSTOP)  # a stopped process leaves SIGTERM pending
    started = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        stopping = pool.submit(mesh.stop)
        # the head server shuts down while the launcher waits for its servers, not after them
        wait_until(lambda: not head_answers(head_url), 1.5, "the head server stopped answering")
        assert not stopping.done()  # sm is still within its grace
        assert stopping.result(timeout=10) == ["sm"]
    assert mesh.killed == ["sm"]
    assert is_gone(pid)
    assert time.monotonic() - started < 6.0


# ---- the `run` command ---------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_run_leaves_no_orphans_whatever_stops_it(sig: signal.Signals, two_server_runs: dict[str, CliRun]) -> None:
    run = two_server_runs[sig.name]
    head_url = run.wait_ready(RUNS_READY_S)
    assert [entry["name"] for entry in get_json(f"{head_url}/servers")] == ["sm", "sm_loose"]
    assert len(run.children) == 2, run.children
    run.proc.send_signal(sig)
    status, stderr = run.finish()
    wait_until(lambda: all(is_gone(pid) for pid in run.children), ORPHAN_DEADLINE_S, "servers exited")
    if sig == signal.SIGKILL:
        assert status == -signal.SIGKILL
    else:
        assert status == 0, stderr
        assert run.stdout[-1] in ("stopped on request; stopped: sm, sm_loose",
                                  "stopped on request; stopped: sm_loose, sm"), run.stdout


def test_run_stops_everything_when_one_server_dies(two_server_runs: dict[str, CliRun]) -> None:
    run = two_server_runs["one_server_dies"]
    head_url = run.wait_ready(RUNS_READY_S)
    urls = {entry["name"]: entry["url"] for entry in get_json(f"{head_url}/servers")}
    assert set(urls) == {"sm", "sm_loose"}
    victim = next(pid for pid in run.children if _instance_of(pid) == "sm")
    os.kill(victim, signal.SIGKILL)
    status, stderr = run.finish()
    assert status == 1
    assert stderr.strip().splitlines()[-1] == "nemo-gym-ckpt run: sm exited with status -9; stopped: sm_loose"
    wait_until(lambda: all(is_gone(pid) for pid in run.children), ORPHAN_DEADLINE_S, "servers exited")


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().rstrip("\0").split("\0")


def _instance_of(pid: int) -> str:
    """The instance a server process runs (the last argument of ``python -m nemo_gym_ckpt.cli.serve``)."""
    return _cmdline(pid)[-1]


def test_what_a_server_started_is_swept_when_it_exits() -> None:
    code = ("import subprocess, sys\n"
            "sleeper = [sys.executable, '-c', 'import time; time.sleep(60)']\n"
            "print(subprocess.Popen(sleeper, stdout=subprocess.DEVNULL).pid, flush=True)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, process_group=0)
    lines: list[str] = []
    child = _Child("leader", proc, new_token())
    child.start_reader(lambda _, line: lines.append(line))
    assert child.reap(10.0) and proc.returncode == 0
    grandchild = int(lines[0])
    assert not is_gone(grandchild)
    child.sweep()
    wait_until(lambda: is_gone(grandchild), 5.0, "the leftover process was killed")


# ---- the server process's own guards (serve.py) ----------------------------------------------------


def test_an_orphan_that_ignores_sigterm_kills_itself() -> None:
    code = ("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "from nemo_gym_ckpt.launch.child import exit_orphaned; exit_orphaned(grace_s=0.2)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert "parent process is gone" in done.stderr and "killing myself" in done.stderr


def test_a_server_process_without_a_config_exits_2_with_one_line() -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("NEMO_GYM_CKPT_")}
    done = subprocess.run([sys.executable, "-m", "nemo_gym_ckpt.cli.serve", "sm"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "NEMO_GYM_CKPT_CONFIG_FILE is not set" in done.stderr


def test_a_server_process_whose_config_file_is_gone_exits_2_with_one_line(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("NEMO_GYM_CKPT_")}
    gone = tmp_path / "mesh.json"
    done = subprocess.run([sys.executable, "-m", "nemo_gym_ckpt.cli.serve", "sm"],
                          env={**env, "NEMO_GYM_CKPT_CONFIG_FILE": str(gone)},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and f"cannot read the mesh config {gone}" in done.stderr


# ---- the config handed to the servers ------------------------------------------------------------


def test_a_config_longer_than_one_environment_string_starts(launch_mesh: Launch) -> None:
    """Linux caps one environment string at 128 KiB: a config passed in one failed every start (E2BIG)."""
    prompt = "x" * (200 << 10)
    mesh = launch_mesh("string_match.yaml", overrides=[f"sm.resources_servers.string_match.description={prompt}"])
    wait_for_health(mesh.url_of("sm"), timeout_s=1.0, name="sm")
    handed = list(Path(tempfile.gettempdir()).glob(f"ngc-mesh-config-{os.getpid()}-*/mesh.json"))
    assert len(handed) == 1 and oct(handed[0].stat().st_mode & 0o777) == "0o600"
    assert prompt in handed[0].read_text()
    mesh.stop()
    assert not handed[0].parent.exists()
