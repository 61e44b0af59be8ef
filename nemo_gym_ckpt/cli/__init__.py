"""The ``nemo-gym-ckpt`` command (docs/architecture.md, "Commands").

Each subcommand is a module of this package, imported only when that subcommand runs; the module
declares ``configure(parser)`` (its arguments) and ``main(args) -> ExitCode``. ``exit_codes`` holds
the codes and the one map from exceptions to them. ``serve`` is the entry point of one server
process (the launcher starts it; it is not a subcommand).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

from nemo_gym_ckpt.cli.exit_codes import exit_code_for
from nemo_gym_ckpt.errors import ConfigError

__all__ = ["COMMANDS", "Command", "build_parser", "main"]

PROG = "nemo-gym-ckpt"


@dataclass(frozen=True)
class Command:
    module: str
    summary: str


COMMANDS = {
    "run": Command("nemo_gym_ckpt.cli.run", "launch a mesh from YAML and block"),
    "collect": Command("nemo_gym_ckpt.cli.collect", "collect rollouts with checkpointing"),
    "checkpoint": Command("nemo_gym_ckpt.cli.checkpoint", "drive the checkpoint coordinator by hand"),
    "bench": Command("nemo_gym_ckpt.cli.bench", "run the benchmark suite"),
    "demo": Command("nemo_gym_ckpt.cli.demo", "checkpoint, kill and restore the quickstart mesh on CPU"),
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


def _load(name: str) -> ModuleType:
    return importlib.import_module(COMMANDS[name].module)


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
    parser = argparse.ArgumentParser(prog=f"{PROG} {top.command}")
    module.configure(parser)
    args = parser.parse_args(top.args)
    try:
        return int(module.main(args))
    except ConfigError as error:
        return _fail(f"config error: {error}", exit_code_for(error))
