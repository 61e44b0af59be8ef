"""The ``nemo-gym-ckpt`` command (ARCHITECTURE.md section 6).

Each subcommand lives in its own module, imported only when that subcommand runs; the module
declares ``configure(parser)`` (its arguments) and ``main(args) -> int`` (its exit status). Exit
statuses: 0 done, 1 failure with a one-line reason, 2 usage or config error, 75 checkpointed and
stopped on request.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

from nemo_gym_ckpt.errors import ConfigError

__all__ = ["COMMANDS", "EXIT_CONFIG", "EXIT_FAILURE", "Command", "build_parser", "main"]

PROG = "nemo-gym-ckpt"
EXIT_FAILURE = 1
EXIT_CONFIG = 2


@dataclass(frozen=True)
class Command:
    module: str
    summary: str


COMMANDS = {
    "run": Command("nemo_gym_ckpt.launch.launcher", "launch a mesh from YAML and block"),
    "collect": Command("nemo_gym_ckpt.cli.collect", "collect rollouts with checkpointing"),
    "checkpoint": Command("nemo_gym_ckpt.cli.checkpoint", "drive the checkpoint coordinator by hand"),
    "bench": Command("nemo_gym_ckpt.bench.suites", "run the benchmark suite"),
    "demo": Command("nemo_gym_ckpt.demo.run", "checkpoint, kill and restore the quickstart mesh on CPU"),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: a command name, then that command's own arguments."""
    lines = "\n".join(f"  {name:<12}{command.summary}" for name, command in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="A NeMo Gym style mesh where every server is a checkpoint participant.",
        epilog=f"commands:\n{lines}\n\n'{PROG} COMMAND --help' describes one command.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("command", choices=list(COMMANDS), metavar="COMMAND")
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def _load(name: str) -> ModuleType | None:
    """The command's module, or None if nobody has written it yet."""
    module_name = COMMANDS[name].module
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and (module_name == error.name or module_name.startswith(error.name + ".")):
            return None
        raise


def _configure_logging(level: str) -> None:
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S")
    if level != "DEBUG":
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise


def _fail(message: str, status: int) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, dispatch and map ``ConfigError`` to one line and status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    top_parser = build_parser()
    if not argv:
        top_parser.error("a COMMAND is required")
    top = top_parser.parse_args(argv)
    _configure_logging(top.log_level)
    module = _load(top.command)
    if module is None:
        return _fail(f"'{top.command}' is not available yet", EXIT_FAILURE)
    if not (callable(getattr(module, "configure", None)) and callable(getattr(module, "main", None))):
        return _fail(f"{module.__name__} does not declare configure(parser) and main(args)", EXIT_FAILURE)
    parser = argparse.ArgumentParser(prog=f"{PROG} {top.command}")
    module.configure(parser)
    args = parser.parse_args(top.args)
    try:
        return int(module.main(args))
    except ConfigError as error:
        return _fail(f"config error: {error}", EXIT_CONFIG)
