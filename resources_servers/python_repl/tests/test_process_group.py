"""The interpreter's process group dies with its server, and ``close`` kills no group but its own."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from resources_servers.python_repl.interpreter import CHILD, Interpreter

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

ROOT = Path(__file__).resolve().parents[3]
SPAWN = "import subprocess, sys\np = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\np.pid"
SERVER = """\
import asyncio, sys
sys.path.insert(0, sys.argv[1])
from resources_servers.python_repl.interpreter import Interpreter
async def main():
    interpreter = await Interpreter.start(1000)
    child = (await interpreter.run(sys.argv[2], 30))["output"].strip()
    print(interpreter.pid, child, flush=True)
    await interpreter.run(sys.argv[3], 600)  # busy, as in a long tool call
asyncio.run(main())
"""
"""A server of one interpreter: it prints the interpreter's pid and its code's child's, then runs a long call."""


def _state(pid: int) -> str:
    """The process's state letter (``Z``: a zombie), or ``gone``."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


def _group(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError, IndexError):
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    members.append(int(entry))
    return members


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether ``pid`` exits (or is only a zombie) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while _state(pid) not in ("gone", "Z"):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _wait_for(path: Path, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {within_s} s"
        time.sleep(0.05)


@contextlib.contextmanager
def _killed_at_exit(pids: list[int]) -> Iterator[None]:
    """SIGKILL what a failed test leaked."""
    try:
        yield
    finally:
        for pid in pids:
            if _state(pid) not in ("gone", "Z"):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("kill", ["its process group (MeshLauncher.kill_all)", "itself alone (the OOM killer)"])
def test_a_sigkilled_server_takes_its_busy_interpreter_and_what_it_started_along(
    tmp_path: Path, kill: str
) -> None:
    busy = tmp_path / "busy"
    code = f"open({str(busy)!r}, 'w').close()\nimport time\ntime.sleep(300)"
    leaked: list[int] = []
    with _killed_at_exit(leaked):
        with subprocess.Popen([sys.executable, "-c", SERVER, str(ROOT), SPAWN, code],
                              stdout=subprocess.PIPE, text=True, process_group=0) as server:
            try:
                assert server.stdout is not None
                leaked += map(int, server.stdout.readline().split())
                _wait_for(busy)
            finally:
                if kill.startswith("its process group"):
                    os.killpg(server.pid, signal.SIGKILL)
                else:
                    server.kill()
        interpreter, child = leaked
        assert (_gone(interpreter), _gone(child)) == (True, True)


def test_an_interpreter_whose_server_died_before_it_started_kills_itself() -> None:
    lifeline, held = os.pipe()
    os.close(held)  # the server is gone: the lifeline is at end of file from the start
    with subprocess.Popen([sys.executable, "-I", "-S", str(CHILD), "100", str(lifeline)], pass_fds=(lifeline,),
                          stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True) as orphan:
        os.close(lifeline)
        try:
            assert orphan.wait(timeout=10) == -signal.SIGKILL  # stdin stays open: no exit of its own
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(orphan.pid, signal.SIGKILL)


async def test_close_kills_what_the_code_of_a_dead_interpreter_started_and_leaves_nothing() -> None:
    interpreter = await Interpreter.start(100)
    reply = await interpreter.run(SPAWN, 30)
    assert reply is not None
    child = int(reply["output"])
    with _killed_at_exit([child]):
        os.kill(interpreter.pid, signal.SIGKILL)  # dies while idle; its code's child lives on
        deadline = time.monotonic() + 5
        while interpreter.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not interpreter.alive and _state(child) not in ("gone", "Z")
        await interpreter.close()
        assert _gone(child) and _group(interpreter.pid) == []


PID_REUSE = """\
import asyncio, json, os, signal, subprocess, sys
sys.path.insert(0, sys.argv[1])
from resources_servers.python_repl.interpreter import Interpreter
def group(pgid):
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[2]) == pgid: found.append(int(entry))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return found
async def main():
    dead = await Interpreter.start(100)
    await dead.run(sys.argv[2], 30)
    os.kill(dead.pid, signal.SIGKILL)  # dies while idle
    await asyncio.sleep(0.5)
    for pid in group(dead.pid):  # empty its group (this process is pid 1 here: it reaps orphans)
        if pid != dead.pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    with open("/proc/sys/kernel/ns_last_pid", "w") as last:  # the next pid is the dead one's, if free
        last.write(str(dead.pid - 1))
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)  # another group leader
    await dead.close()
    await asyncio.sleep(0.2)
    print(json.dumps({"reused": other.pid == dead.pid, "other": other.poll()}))
    other.kill()
    other.wait()
asyncio.run(main())
"""
"""Run in a pid namespace of its own, where ``ns_last_pid`` stands for the wrap-around of ``pid_max``."""


def _private_pid_namespace() -> list[str] | None:
    """An ``unshare`` prefix that gives a pid namespace whose ``ns_last_pid`` may be set, or None."""
    unshare = ["unshare", "--pid", "--fork", "--mount", "--mount-proc"]
    probe = ["sh", "-c", "echo 1 > /proc/sys/kernel/ns_last_pid"]
    for prefix in (unshare, [unshare[0], "--user", "--map-root-user", *unshare[1:]]):
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            if subprocess.run([*prefix, *probe], capture_output=True, timeout=10).returncode == 0:
                return prefix
    return None


def test_close_never_kills_a_group_that_took_a_dead_interpreters_pid() -> None:
    prefix = _private_pid_namespace()
    if prefix is None:
        pytest.skip("unshare cannot make a pid namespace here")
    run = subprocess.run([*prefix, sys.executable, "-c", PID_REUSE, str(ROOT), SPAWN],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    outcome = json.loads(run.stdout)
    assert outcome["other"] is None, outcome  # still running after close: not SIGKILLed
