"""``nemo-gym-ckpt bench``: run the benchmark suites (``nemo_gym_ckpt.bench.suites``)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from nemo_gym_ckpt.bench.suites import SUITES, run_suites
from nemo_gym_ckpt.cli.arguments import seconds
from nemo_gym_ckpt.cli.exit_codes import ExitCode

__all__ = ["configure", "main"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = "Run the benchmark suite; writes results.json, results.md and PNG plots."
    parser.add_argument("--only", nargs="+", choices=sorted(SUITES), help="run only these suites")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    parser.add_argument("--duration-s", type=seconds, default=5.0, help="seconds per measured point")
    parser.add_argument("--quick", action="store_true", help="smallest sizes (--duration-s 1): a smoke test")


def main(args: argparse.Namespace) -> ExitCode:
    logging.basicConfig(level=logging.WARNING)
    duration_s = 1.0 if args.quick else args.duration_s
    print(run_suites(args.only or list(SUITES), duration_s, args.out))
    return ExitCode.OK
