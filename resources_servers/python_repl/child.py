"""The child process of one python_repl session: a persistent interpreter spoken to in JSON lines.

Run as ``python -I -S child.py <max_output_chars> <lifeline fd>``, leading a process group of its own.
Each request line is ``{"code": str, "id": int}``;
each reply line is ``{"output": str, "error": str | null, "id": int}``: what the code printed (stdout
and stderr) and the values of its expression statements, shown as an interactive interpreter shows
them, and the last line of the traceback when it raised, each cut at ``max_output_chars``, and the
request's ``id``. Variables, imports and functions persist between
requests. The protocol runs over private copies of fds 0 and 1: the code's own stdin and stdout
are /dev/null and a buffer, so nothing it does can garble a reply. Standard library only.

The lifeline is the read end of a pipe whose only write end the server holds: it reaches end of
file when the server closes this interpreter or dies, however it dies (a SIGKILL, the OOM killer).
At start the child leaves a watcher in its process group (``WATCHER``, a ``/bin/sh`` that is no
child of this process, so the code never sees it) that then SIGKILLs the whole group: this
interpreter, busy or not, and what its code started. A separate process, not a thread, so that it
acts while the code holds the GIL in a long C call, and so that the code's ``os.fork`` finds a
single-threaded process. If the server died before the watcher started, the pipe is already at end
of file and the group dies at once.
"""

from __future__ import annotations

import ast
import code
import contextlib
import io
import json
import os
import sys
import traceback
from typing import Any

FILENAME = "<session>"
WATCHER = "(trap '' HUP INT QUIT TERM; read -r _ <&3; kill -s KILL 0) &"
"""Run by ``sh -c`` with the lifeline as fd 3: in the background (the shell exits, so the watcher is
no child of the interpreter), deaf to the signals the code may send its group, it waits for end of
file on the lifeline, then SIGKILLs its process group."""


class Console(code.InteractiveInterpreter):
    """An interpreter that also remembers the one-line summary of the last error it showed."""

    def __init__(self) -> None:
        super().__init__({"__name__": "__main__", "__builtins__": __builtins__})
        self.error: str | None = None

    def showtraceback(self) -> None:
        self.error = _summary()
        super().showtraceback()

    def showsyntaxerror(self, filename: str | None = None, **kwargs: Any) -> None:
        self.error = _summary()
        super().showsyntaxerror(filename, **kwargs)


def _summary() -> str:
    kind, value, _ = sys.exc_info()
    return "".join(traceback.format_exception_only(kind, value)).strip().splitlines()[-1]


def run(console: Console, source: str, limit: int) -> dict[str, Any]:
    """Run ``source`` in the console: what it showed (at most ``limit`` characters) and its error."""
    console.error = None
    shown = Capture(limit)
    with contextlib.redirect_stdout(shown), contextlib.redirect_stderr(shown):
        _run_source(console, source)
    error = None if console.error is None else _cut(console.error, limit)
    return {"output": shown.value(), "error": error}


class Capture(io.TextIOBase):
    """A text stream that keeps the first ``limit`` characters written to it and counts the rest."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self._limit = limit
        self._kept: list[str] = []
        self._size = 0  # characters kept
        self._dropped = 0

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        room = self._limit - self._size
        if room > 0:
            self._kept.append(text[:room])
            self._size += min(room, len(text))
        self._dropped += max(0, len(text) - max(room, 0))
        return len(text)

    def value(self) -> str:
        kept = "".join(self._kept)
        return kept + f"\n... ({self._dropped} more characters)" if self._dropped else kept


def _cut(text: str, limit: int) -> str:
    """``text`` cut at ``limit`` characters, with a note of how many were left off."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... ({len(text) - limit} more characters)"


def _run_source(console: Console, source: str) -> None:
    try:
        tree = ast.parse(source, FILENAME, "exec")
        compiled = compile(ast.Interactive(body=tree.body), FILENAME, "single")
    except (SyntaxError, ValueError, OverflowError):  # what ast.parse and compile raise on bad source
        console.showsyntaxerror(FILENAME)
        return
    try:
        console.runcode(compiled)  # shows (and records) any exception of the code but SystemExit
    except SystemExit as stop:
        console.error = f"SystemExit: {stop.code} (ignored: the interpreter keeps running)"


def watch_lifeline(lifeline: int) -> None:
    """Leave ``WATCHER`` running in this process group, then close ``lifeline`` here."""
    actions = [
        (os.POSIX_SPAWN_DUP2, lifeline, 3),
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),  # never the protocol's pipes
        (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
    ]
    shell = os.posix_spawn("/bin/sh", ["sh", "-c", WATCHER], {}, file_actions=actions)
    os.waitpid(shell, 0)  # the shell exits once the watcher runs in the background
    os.close(lifeline)


def main() -> None:
    limit = int(sys.argv[1])
    watch_lifeline(int(sys.argv[2]))  # first: fds 3 and 4 below are then the protocol's, as always
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8")
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    console = Console()
    for line in requests:
        request = json.loads(line)
        reply = {**run(console, request["code"], limit), "id": request["id"]}
        replies.write(json.dumps(reply) + "\n")  # ASCII: any str, a lone surrogate too, can be written
        replies.flush()


if __name__ == "__main__":
    main()
