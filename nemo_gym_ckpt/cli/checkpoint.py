"""``nemo-gym-ckpt checkpoint status|prepare|commit|restore|resume|retire|forget --head URL ...``

Drives the coordinator by hand against a running mesh. The control token is read from the
environment (``GYM_CKPT_TOKEN``, or the variable named by ``--token-env``), never from the command
line. Episodes are capture keys: ``r1`` is attempt 0 of rollout ``r1``, ``r1-a2`` attempt 2.
Prints the result as JSON on stdout. Exit status: 0 done, 1 failure (one line on stderr; a prepare
that is not ready counts as one), 2 usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson

from nemo_gym_ckpt.checkpoint.coordinator import Coordinator, StagedResult
from nemo_gym_ckpt.checkpoint.models import CHECKPOINT_ID_PATTERN
from nemo_gym_ckpt.cli.arguments import head_url, seconds
from nemo_gym_ckpt.cli.exit_codes import ExitCode, exit_code_for
from nemo_gym_ckpt.config import TOKEN_ENV
from nemo_gym_ckpt.errors import GymError
from nemo_gym_ckpt.identity import RolloutIdentity, parse_capture_key

__all__ = ["TOKEN_ENV", "configure", "main"]

PROG = "nemo-gym-ckpt checkpoint"


def _checkpoint_id(text: str) -> str:
    if not re.fullmatch(CHECKPOINT_ID_PATTERN, text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a checkpoint id (1-128 of A-Z a-z 0-9 . _ -)")
    return text


def _directory(text: str) -> str:
    """A path as the shell means it: relative to where the command runs, sent absolute."""
    return str(Path(text).absolute())


def _episode(text: str) -> RolloutIdentity:
    try:
        return parse_capture_key(text)
    except GymError as error:
        raise argparse.ArgumentTypeError(error.detail) from None


def configure(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``nemo-gym-ckpt checkpoint``."""
    common = _common_arguments()
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    verbs.add_parser("status", parents=[common], help="every participant's status")
    for verb, text in (("prepare", "close admission and wait until ready"), ("resume", "reopen admission")):
        verbs.add_parser(verb, parents=[common], help=text).add_argument(
            "--id", required=True, type=_checkpoint_id
        )
    for verb, text in (
        ("commit", "write every participant's records"),
        ("restore", "install a checkpoint in fresh servers"),
    ):
        sub = verbs.add_parser(verb, parents=[common], help=text)
        sub.add_argument("--id", required=True, type=_checkpoint_id)
        sub.add_argument(
            "--dir",
            required=True,
            type=_directory,
            help="checkpoint_dir, inside the checkpoint root (relative: to this shell's directory)",
        )
        sub.add_argument(
            "--episode",
            action="append",
            type=_episode,
            required=verb == "restore",
            help="commit: the scope (default all); restore: an attempt that continues (repeatable)",
        )
    retire = verbs.add_parser("retire", parents=[common], help="stop and fence attempts")
    retire.add_argument("--episode", action="append", type=_episode, required=True)
    forget = verbs.add_parser("forget", parents=[common], help="drop the fences of rollouts")
    forget.add_argument("--rollout", action="append", required=True)
    for sub in (retire, forget):
        sub.add_argument("--id", type=_checkpoint_id, help="a fresh id by default")


def _common_arguments() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--head", required=True, type=head_url, help="URL of the mesh's head server")
    common.add_argument("--token-env", default=TOKEN_ENV, help=f"variable holding the token ({TOKEN_ENV})")
    common.add_argument("--timeout-s", type=seconds, default=300.0, help="deadline of the operation (300)")
    common.add_argument(
        "--require-kind",
        action="append",
        default=[],
        metavar="KIND",
        help="fail unless a participant of this kind exists (repeatable)",
    )
    return common


def main(args: argparse.Namespace) -> ExitCode:
    token = os.environ.get(args.token_env, "")
    if not token:
        print(f"{PROG}: set {args.token_env} to the mesh's control_auth_token", file=sys.stderr)
        return ExitCode.USAGE
    return asyncio.run(_run(args, token))


async def _run(args: argparse.Namespace, token: str) -> ExitCode:
    deadline_ts = time.time() + args.timeout_s
    async with Coordinator(args.head, token, required_kinds=args.require_kind) as coordinator:
        try:
            output = await VERBS[args.verb](coordinator, args, deadline_ts)
        except GymError as error:
            result = error.fields.get("result")
            if isinstance(result, StagedResult):
                _print(result.to_json())
            print(f"{PROG} {args.verb}: {error.code}: {error.detail}", file=sys.stderr)
            return exit_code_for(error)
    _print(output)
    if args.verb == "prepare" and not output["prepared"]:
        print(f"{PROG} prepare: not ready at stage {output['not_ready_stage']}", file=sys.stderr)
        return ExitCode.FAILURE
    return ExitCode.OK


def _print(output: Any) -> None:
    sys.stdout.write(orjson.dumps(output, option=orjson.OPT_INDENT_2).decode() + "\n")
    sys.stdout.flush()


Verb = Callable[[Coordinator, argparse.Namespace, float], Awaitable[Any]]


async def _status(c: Coordinator, args: argparse.Namespace, deadline_ts: float) -> Any:
    return await c.status()


async def _prepare(c: Coordinator, args: argparse.Namespace, deadline_ts: float) -> Any:
    return (await c.prepare(args.id, deadline_ts=deadline_ts)).to_json()


async def _commit(c: Coordinator, args: argparse.Namespace, deadline_ts: float) -> Any:
    result = await c.commit(
        args.id, deadline_ts=deadline_ts, checkpoint_dir=args.dir, episode_ids=args.episode
    )
    return result.to_json()


async def _restore(c: Coordinator, args: argparse.Namespace, deadline_ts: float) -> Any:
    result = await c.restore(
        args.id, deadline_ts=deadline_ts, checkpoint_dir=args.dir, episode_ids=args.episode
    )
    return result.to_json()


async def _resume(c: Coordinator, args: argparse.Namespace, deadline_ts: float) -> Any:
    return (await c.resume(args.id, deadline_ts=deadline_ts)).to_json()


async def _retire(c: Coordinator, args: argparse.Namespace, deadline_ts: float) -> Any:
    return (await c.retire(args.episode, deadline_ts=deadline_ts, checkpoint_id=args.id)).to_json()


async def _forget(c: Coordinator, args: argparse.Namespace, deadline_ts: float) -> Any:
    return (await c.forget(args.rollout, deadline_ts=deadline_ts, checkpoint_id=args.id)).to_json()


VERBS: dict[str, Verb] = {
    "status": _status,
    "prepare": _prepare,
    "commit": _commit,
    "restore": _restore,
    "resume": _resume,
    "retire": _retire,
    "forget": _forget,
}
