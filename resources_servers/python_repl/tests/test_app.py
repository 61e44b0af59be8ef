"""python_repl over httpx.ASGITransport (its lifespan entered): a real child interpreter per session."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any

import httpx
import pytest

from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext
from resources_servers.python_repl.app import PythonRepl
from resources_servers.python_repl.interpreter import Interpreter

pytestmark = pytest.mark.unit

COOKIE = "ng_session_py"
EMPTY_RESPONSE: dict[str, Any] = {"output": []}


@dataclass
class Repl:
    server: PythonRepl
    http: httpx.AsyncClient

    async def seed(self) -> dict[str, str]:
        reply = await self.http.post("/seed_session", json={})
        assert reply.status_code == 200, reply.text
        return {"cookie": f"{COOKIE}={reply.cookies[COOKIE]}"}

    async def run(self, cookie: dict[str, str], code: str) -> dict[str, Any]:
        reply = await self.http.post("/run_python", json={"code": code}, headers=cookie)
        assert reply.status_code == 200, reply.text
        body: dict[str, Any] = reply.json()
        return body

    async def run_within(self, cookie: dict[str, str], code: str, timeout_s: float) -> dict[str, Any]:
        """``run`` under a call timeout of ``timeout_s``; the session's interpreter started before,
        under the default one (the call that starts it waits for the child's start too: 0.05 to 1.1 s
        measured on a loaded 2-core machine)."""
        assert self.server.interpreters, "start the session's interpreter first"
        settings = self.server.settings
        default, settings.call_timeout_s = settings.call_timeout_s, timeout_s
        try:
            return await self.run(cookie, code)
        finally:
            settings.call_timeout_s = default


@asynccontextmanager
async def repl(**settings: Any) -> AsyncIterator[Repl]:
    mesh = load_config_dict({"py": {"resources_servers": {"python_repl": settings}}})
    ctx: ServerContext[Any] = ServerContext("py", mesh.instance("py").settings, mesh)
    server = PythonRepl(ctx)
    app = server.build_app()
    jar = CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://py", cookies=jar) as http:
                yield Repl(server, http)
    finally:
        await ctx.aclose()


@pytest.fixture
def start() -> Callable[..., AbstractAsyncContextManager[Repl]]:
    return repl


async def test_state_persists_within_a_session_and_not_across(start: Callable[..., Any]) -> None:
    async with start() as py:
        first, second = await py.seed(), await py.seed()
        assert await py.run(first, "x = 6") == {"output": "", "error": None}
        assert await py.run(first, "def twice(n):\n    return 2 * n\nprint('ready')\ntwice(x) + 30") == {
            "output": "ready\n42\n",
            "error": None,
        }
        missing = await py.run(second, "x")
        assert missing["error"] == "NameError: name 'x' is not defined"
        assert len(py.server.interpreters) == 2


async def test_errors_are_answers_and_the_interpreter_survives_them(start: Callable[..., Any]) -> None:
    async with start() as py:
        cookie = await py.seed()
        await py.run(cookie, "kept = 'yes'")
        assert (await py.run(cookie, "1 / 0"))["error"] == "ZeroDivisionError: division by zero"
        assert (await py.run(cookie, "def f(:"))["error"] == "SyntaxError: invalid syntax"
        stopped = await py.run(cookie, "raise SystemExit(3)")
        assert stopped["error"] == "SystemExit: 3 (ignored: the interpreter keeps running)"
        assert (await py.run(cookie, "input()"))["error"] == "EOFError: EOF when reading a line"
        assert await py.run(cookie, "import os; n = os.write(1, b'noise'); kept") == {
            "output": "'yes'\n",
            "error": None,
        }


async def test_a_call_past_its_timeout_loses_the_interpreter(start: Callable[..., Any]) -> None:
    async with start() as py:
        cookie = await py.seed()
        await py.run(cookie, "kept = 1")
        (old,) = py.server.interpreters.values()
        lost = await py.run_within(cookie, "while True: pass", 0.5)
        assert lost["error"].startswith("InterpreterLost: the interpreter exited or ran past 0.5 s")
        assert not old.alive and py.server.interpreters == {}
        assert (await py.run(cookie, "kept"))["error"] == "NameError: name 'kept' is not defined"


FORGE_THEN_SLEEP = (  # a thread answers this call (with its id), then the interpreter reads no request
    "import json, os, sys, threading, time\n"
    "frame = sys._getframe()\n"
    "while 'request' not in frame.f_locals:\n"
    "    frame = frame.f_back\n"
    "reply = json.dumps({'output': 'forged', 'error': None, 'id': frame.f_locals['request']['id']})\n"
    "threading.Thread(target=lambda: (time.sleep(0.2), os.write(4, reply.encode() + b'\\n'))).start()\n"
    "time.sleep(3600)"
)


async def test_sending_a_request_is_under_the_call_timeout_too(start: Callable[..., Any]) -> None:
    async with start() as py:
        cookie = await py.seed()
        assert await py.run(cookie, FORGE_THEN_SLEEP) == {"output": "forged", "error": None}
        big = "#" + "\u00e9" * 99_000  # about 600 KB once JSON-escaped: more than the pipe holds
        lost = await asyncio.wait_for(py.run_within(cookie, big, 1.0), 15)
        assert lost["error"].startswith("InterpreterLost: the interpreter exited or ran past 1.0 s")
        assert py.server.interpreters == {}


async def test_an_interpreter_that_exits_is_replaced(start: Callable[..., Any]) -> None:
    async with start() as py:
        cookie = await py.seed()
        assert (await py.run(cookie, "import os; os._exit(0)"))["error"].startswith("InterpreterLost")
        assert await py.run(cookie, "1 + 1") == {"output": "2\n", "error": None}


async def test_output_is_bounded(start: Callable[..., Any]) -> None:
    async with start(max_output_chars=10) as py:
        cookie = await py.seed()
        reply = await py.run(cookie, "print('a' * 25)")
        assert reply["output"] == "a" * 10 + "\n... (16 more characters)"


def _peak_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
async def test_output_past_the_bound_is_dropped_as_it_is_written(start: Callable[..., Any]) -> None:
    async with start(max_output_chars=10) as py:
        cookie = await py.seed()
        await py.run(cookie, "line = 'x' * 1_000_000")
        (interpreter,) = py.server.interpreters.values()
        before = _peak_kib(interpreter.pid)
        reply = await py.run(cookie, "for _ in range(100):\n    print(line)")  # 100 MB printed
        assert reply == {"output": "x" * 10 + "\n... (100000090 more characters)", "error": None}
        assert _peak_kib(interpreter.pid) - before < 30_000  # KiB: not the 100 MB it printed


async def test_the_error_is_bounded_too_and_the_next_call_gets_its_own_reply(start: Callable[..., Any]) -> None:
    async with start(max_output_chars=10) as py:
        cookie = await py.seed()
        await py.run(cookie, "kept = 41")
        reply = await py.run(cookie, "raise ValueError('y' * 5_000_000)")  # a reply line over READ_LIMIT
        assert reply["error"] == "ValueError\n... (5000002 more characters)"
        assert await py.run(cookie, "kept + 1") == {"output": "42\n", "error": None}


@pytest.mark.parametrize(
    "garble",
    [
        "b'not json\\n'",  # not JSON
        "b'[1, 2]\\n'",  # not an object
        "b'{\"output\": \"forged\", \"error\": null}\\n'",  # not the reply to this call
        "b'x' * (5 << 20)",  # longer than READ_LIMIT
    ],
)
async def test_a_garbled_reply_loses_the_interpreter_never_a_500_or_a_stale_reply(
    start: Callable[..., Any], garble: str
) -> None:
    async with start() as py:
        cookie = await py.seed()
        await py.run(cookie, "kept = 1")
        (old,) = py.server.interpreters.values()
        lost = await py.run(cookie, f"import os; n = os.write(4, {garble}); 'real'")  # fd 4: the replies
        assert lost["error"].startswith("InterpreterLost: the interpreter broke the reply protocol")
        assert not old.alive and py.server.interpreters == {}
        assert await py.run(cookie, "'second'") == {"output": "'second'\n", "error": None}
        assert (await py.run(cookie, "kept"))["error"] == "NameError: name 'kept' is not defined"


async def test_lone_surrogates_are_shown_escaped_and_the_interpreter_survives(start: Callable[..., Any]) -> None:
    async with start() as py:
        cookie = await py.seed()
        await py.run(cookie, "kept = 41")
        assert await py.run(cookie, "print(chr(0xd800))") == {"output": "\\ud800\n", "error": None}
        assert (await py.run(cookie, "raise ValueError(chr(0xdfff))"))["error"] == "ValueError: \\udfff"
        assert await py.run(cookie, "kept + 1") == {"output": "42\n", "error": None}


async def test_verify_runs_the_check_in_the_session(start: Callable[..., Any]) -> None:
    async with start() as py:
        cookie = await py.seed()
        await py.run(cookie, "def square(n):\n    return n * n")
        row = {"check": "assert square(3) == 9", "response": EMPTY_RESPONSE}
        passed = await py.http.post("/verify", json=row, headers=cookie)
        assert passed.json() == {**row, "reward": 1.0, "check_error": None}
        row = {"check": "assert square(3) == 10, 'wrong'", "response": EMPTY_RESPONSE}
        failed = (await py.http.post("/verify", json=row, headers=cookie)).json()
        assert (failed["reward"], failed["check_error"]) == (0.0, "AssertionError: wrong")


async def test_closing_a_session_kills_its_interpreter(start: Callable[..., Any]) -> None:
    async with start() as py:
        cookie = await py.seed()
        await py.run(cookie, "1")
        (interpreter,) = py.server.interpreters.values()
        assert (await py.http.post("/close_session", headers=cookie)).status_code == 200
        assert not interpreter.alive and py.server.interpreters == {}
        reply = await py.http.post("/run_python", json={"code": "1"}, headers=cookie)
        assert reply.status_code == 400 and "unknown session" in reply.json()["error"]["detail"]


SPAWN = "import subprocess, sys\np = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"


async def _gone(pid: int) -> bool:
    """Whether ``pid`` exits (or is only a zombie) within a few seconds."""
    for _ in range(100):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
async def test_processes_the_code_started_die_with_the_interpreter(start: Callable[..., Any]) -> None:
    async with start() as py:
        closed, timed_out, shut_down = await py.seed(), await py.seed(), await py.seed()
        first = int((await py.run(closed, SPAWN + "p.pid"))["output"])
        assert (await py.http.post("/close_session", headers=closed)).status_code == 200
        assert await _gone(first)
        second = int((await py.run(timed_out, SPAWN + "p.pid"))["output"])
        assert (await py.run_within(timed_out, "while True: pass", 2.0))["error"].startswith("InterpreterLost")
        assert await _gone(second)
        third = int((await py.run(shut_down, SPAWN + "p.pid"))["output"])
    assert await _gone(third)


async def test_shutdown_kills_every_interpreter(start: Callable[..., Any]) -> None:
    interpreters: list[Interpreter] = []
    async with start() as py:
        for _ in range(2):
            await py.run(await py.seed(), "1")
        interpreters = list(py.server.interpreters.values())
        assert all(interpreter.alive for interpreter in interpreters)
    assert interpreters and not any(interpreter.alive for interpreter in interpreters)


async def test_live_interpreters_are_bounded(start: Callable[..., Any]) -> None:
    async with start(max_interpreters=1) as py:
        await py.run(await py.seed(), "1")
        reply = await py.http.post("/run_python", json={"code": "1"}, headers=await py.seed())
        assert reply.status_code == 400 and "max_interpreters" in reply.json()["error"]["detail"]


async def test_seed_declares_restart_only(start: Callable[..., Any]) -> None:
    async with start() as py:
        reply = await py.http.post("/seed_session", json={})
        assert reply.headers["x-ng-checkpoint-restart"] == "1"
        assert reply.headers["x-ng-checkpoint-verify"] == "wait"
        assert (PythonRepl.checkpoint_mode, PythonRepl.checkpoint_verify) == ("restart_only", "wait")


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        ({}, "code: Field required"),
        ({"code": 1}, "code: Input should be a valid string"),
        ({"code": "1", "x": 1}, "x"),
    ],
)
async def test_bad_arguments_are_400(start: Callable[..., Any], body: dict[str, Any], detail: str) -> None:
    async with start() as py:
        reply = await py.http.post("/run_python", json=body, headers=await py.seed())
        assert (reply.status_code, reply.json()["error"]["code"]) == (400, "invalid_request")
        assert detail in reply.json()["error"]["detail"]
        assert py.server.interpreters == {}


async def test_tool_definition(start: Callable[..., Any]) -> None:
    async with start() as py:
        (definition,) = (await py.http.get("/tools")).json()
        assert definition["name"] == "run_python" and definition["parameters"]["required"] == ["code"]
