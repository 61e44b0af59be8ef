"""``nemo-gym-ckpt demo``: checkpoint the quickstart mesh mid-collection, kill it, restore, compare.

    nemo-gym-ckpt demo [--json PATH] [--rollouts N] [--concurrency C] [--workdir DIR] [--no-generation-cuts]

``nemo_gym_ckpt.demo.run`` says what the demo does. Exit status 0 only when the restored run is
identical to the reference.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

from nemo_gym_ckpt.cli.arguments import seconds
from nemo_gym_ckpt.cli.exit_codes import ExitCode, exit_code_for
from nemo_gym_ckpt.demo.run import DEFAULT_CONFIG, proof_table, run_demo
from nemo_gym_ckpt.errors import CommandError

__all__ = ["configure", "main"]

PROG = "nemo-gym-ckpt demo"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = "Checkpoint the quickstart mesh while rollouts run, SIGKILL it, restore, compare."
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the numbers here as JSON")
    parser.add_argument("--rollouts", type=int, default=32, help="task rows to collect (default 32)")
    parser.add_argument("--concurrency", type=int, default=8, help="rollouts in flight (default 8)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the mesh (default: quickstart)")
    parser.add_argument("--workdir", type=Path, help="keep the files here (default: a temporary directory)")
    parser.add_argument("--ready-timeout-s", type=seconds, default=180.0, help="deadline for a mesh to start")
    parser.add_argument("--generation-cuts", action=argparse.BooleanOptionalAction, default=True,
                        help="cut the generations in flight at the checkpoint (default: on)")

def _write_json(path: Path, metrics: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(metrics, option=orjson.OPT_INDENT_2) + b"\n")

def main(args: argparse.Namespace) -> ExitCode:
    if args.rollouts < 4 or args.concurrency < 1:
        print(f"{PROG}: --rollouts must be >= 4 and --concurrency >= 1", file=sys.stderr)
        return ExitCode.USAGE
    print(f"demo: {args.rollouts} rollouts on {args.config.name}, a reference run, then a run that is "
          "checkpointed, killed and restored (about a minute on a laptop CPU)", file=sys.stderr)
    with _workdir(args.workdir) as workdir:
        try:
            result = run_demo(args, workdir)
        except (CommandError, RuntimeError, ValueError) as error:
            print(f"{PROG}: {error}", file=sys.stderr)
            return exit_code_for(error)
        print(proof_table(result.metrics))
        if args.json is not None:
            _write_json(args.json, result.metrics)
            print(f"wrote {args.json}")
    if not result.metrics["identical_to_reference"]:
        print(f"{PROG}: the restored run differs from the reference: "
              f"{', '.join(result.metrics['differing_rollouts'][:10])}", file=sys.stderr)
        return ExitCode.FAILURE
    return ExitCode.OK

@contextmanager
def _workdir(given: Path | None) -> Iterator[Path]:
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    with tempfile.TemporaryDirectory(prefix="nemo-gym-ckpt-demo-") as name:
        yield Path(name)
