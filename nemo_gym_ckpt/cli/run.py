"""``nemo-gym-ckpt run CONFIG... [key=value...]``: launch a mesh from YAML and block.

Every child's lines go to stdout prefixed with its instance name; Ctrl-C or SIGTERM stop the mesh
(exit 0), a server that exits on its own stops it too (exit 1, naming the server).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

from nemo_gym_ckpt.cli.arguments import seconds
from nemo_gym_ckpt.cli.exit_codes import ExitCode, exit_code_for
from nemo_gym_ckpt.config import load_config
from nemo_gym_ckpt.errors import LaunchError, StopRequested
from nemo_gym_ckpt.launch.launcher import MeshLauncher

__all__ = ["configure", "main", "print_line", "split_items", "stop_on_signals"]

PROG = "nemo-gym-ckpt run"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = "Launch a mesh from YAML and block until Ctrl-C, SIGTERM or a server's exit."
    parser.add_argument("items", nargs="+", metavar="CONFIG|key=value",
                        help="config files (merged in order, later wins), then key=value overrides")
    parser.add_argument("--ready-timeout-s", type=seconds, default=300.0,
                        help="one deadline for every server to answer /health (default: 300)")


def split_items(items: Sequence[str]) -> tuple[list[str], list[str]]:
    """Config paths and ``key=value`` overrides, told apart by the ``=``."""
    overrides = [item for item in items if "=" in item]
    return [item for item in items if "=" not in item], overrides


_OUTPUT_LOCK = threading.Lock()


def print_line(name: str, line: str) -> None:
    """The CLI's sink: every child line on stdout, prefixed with its instance name."""
    with _OUTPUT_LOCK:
        sys.stdout.write(f"[{name}] {line}\n")
        sys.stdout.flush()


@contextmanager
def stop_on_signals(launcher: MeshLauncher) -> Iterator[list[str]]:
    """While inside, SIGINT and SIGTERM ask the launcher to stop instead of raising; yields the names
    of the signals received, in order (``run`` and ``collect`` both start their mesh under it)."""
    received: list[str] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        received.append(signal.Signals(signum).name)
        launcher.request_stop()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def main(args: argparse.Namespace) -> ExitCode:
    paths, overrides = split_items(args.items)
    launcher = MeshLauncher(load_config(paths, overrides), on_line=print_line)
    with stop_on_signals(launcher):
        try:
            launcher.start(ready_timeout_s=args.ready_timeout_s)
        except StopRequested as interrupted:
            print(interrupted, flush=True)
            return ExitCode.OK
        except LaunchError as error:
            print(f"{PROG}: {error}", file=sys.stderr)
            return exit_code_for(error)
        _print_ready(launcher)
        try:
            exited = launcher.wait()
            status = None if exited is None else launcher.returncode(exited)
        finally:
            stopped = launcher.stop()
    return _report_end(launcher, exited, status, stopped)


def _print_ready(launcher: MeshLauncher) -> None:
    print(f"head server: {launcher.head_url}", flush=True)
    for name in launcher.names:
        print(f"  {name}: {launcher.url_of(name)}", flush=True)


def _report_end(launcher: MeshLauncher, exited: str | None, status: int | None, stopped: list[str]) -> ExitCode:
    names = ", ".join(stopped) or "none"
    killed = f" (killed: {', '.join(launcher.killed)})" if launcher.killed else ""
    if exited is None:
        print(f"stopped on request; stopped: {names}{killed}", flush=True)
        return ExitCode.OK
    reason = f"{exited} exited with status {status}"
    print(f"{PROG}: {reason}; stopped: {names}{killed}", file=sys.stderr)
    return ExitCode.FAILURE
