"""Every check a continuation passes before it starts: each mismatch is 422 invalid_checkpoint_state.

One prefix is cut for real (4 tokens of call ``mc_a`` of rollout r1, lineage ``(mc_p, 1)``, policy
version 3), then a continuation that differs in exactly one thing is sent; nothing may reach the
engine and nothing may be served from staging.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from model_servers.inference_worker.staging import batch_content
from model_servers.inference_worker.tests.conftest import WorkerClient
from model_servers.inference_worker.tests.cut_helpers import (
    AUTH,
    GatedEngine,
    batch_of,
    complete_under,
    model_call,
    staged_line,
    status,
)
from model_servers.inference_worker.tests.scripted_engine import ScriptedEngine
from model_servers.inference_worker.tests.test_generation_cuts import BODY, continuation_of, cut_after

pytestmark = pytest.mark.unit


@dataclass
class Case:
    """A continuation request: where it is sent from and its body (the valid one to start with)."""

    root: Path
    receipt: dict[str, Any]
    capture_key: str = "r1-a1"
    engine_version: int = 3

    def __post_init__(self) -> None:
        self.body: dict[str, Any] = {**BODY, "model_call": model_call("mc_n", "mc_p", 1),
                                     "continuation": continuation_of(self.receipt)}

    @property
    def key(self) -> str:
        key: str = self.receipt["staging_keys"][0]
        return key

    @property
    def file(self) -> Path:
        """The batch file that holds the prefix."""
        return batch_of(self.root, self.key)

    def ref(self, **changes: Any) -> None:
        self.body["continuation"] = {**self.body["continuation"], **changes}


def tampered(case: Case) -> None:
    content = case.file.read_bytes()
    assert content.count(b'"attempt":0') == 1
    case.file.write_bytes(content.replace(b'"attempt":0', b'"attempt":7'))


def truncated(case: Case) -> None:
    case.file.write_bytes(case.file.read_bytes()[:-2])


def rekeyed_tokens(case: Case) -> None:
    """Tokens changed and the file re-keyed to its new digest: only the prefix digest can tell."""
    data = orjson.loads(staged_line(case.root, case.key))
    data["token_ids"][0] += 1
    content = orjson.dumps(data)
    new_key = f"mc_a.{hashlib.sha256(content).hexdigest()}"
    (case.root / f"cut-{'e' * 32}.jsonl").write_bytes(batch_content([new_key], [content]))
    case.ref(staging_keys=[new_key])


def missing(case: Case) -> None:
    case.file.unlink()


def wrong_digest(case: Case) -> None:
    case.ref(prefix_digest="f" * 64)


def wrong_source(case: Case) -> None:
    case.ref(source_call_id="mc_other")


def wrong_parent(case: Case) -> None:
    case.body["model_call"] = model_call("mc_n", "mc_elsewhere", 1)


def wrong_previous_length(case: Case) -> None:
    case.body["model_call"] = model_call("mc_n", "mc_p", 2)


def newer_policy(case: Case) -> None:
    case.engine_version = 2


def wrong_count(case: Case) -> None:
    case.ref(prefix_token_count=5)


def other_prompt(case: Case) -> None:
    case.body["prompt"] = [*BODY["prompt"], 40]


def other_seed(case: Case) -> None:
    case.body["seed"] = 6


def same_attempt(case: Case) -> None:
    case.capture_key = "r1"


def other_rollout(case: Case) -> None:
    case.capture_key = "r2-a1"


def wrong_limit(case: Case) -> None:
    case.ref(effective_output_limit=7)


MISMATCHES: list[tuple[Callable[[Case], None], str]] = [
    (tampered, "does not match its key's digest"),
    (truncated, "does not match its key's digest"),
    (rekeyed_tokens, "prefix digest"),
    (wrong_digest, "prefix digest"),
    (wrong_source, "source call"),
    (wrong_parent, "lineage"),
    (wrong_previous_length, "lineage"),
    (newer_policy, "newer than the engine's 2"),
    (wrong_count, "token counts disagree"),
    (other_prompt, "is not the staged prompt"),
    (other_seed, "sampling settings differ"),
    (same_attempt, "a later attempt of it must continue"),
    (other_rollout, "a later attempt of it must continue"),
    (wrong_limit, "effective_output_limit"),
]


async def send(worker_client: WorkerClient, root: Path, mutate: Callable[[Case], None] | None) -> Any:
    engine = GatedEngine(ScriptedEngine.from_text("abcdefghijkl"))
    async with worker_client(engine, checkpoint=True, staging_dir=str(root), policy_version=3) as http:
        case = Case(root, await cut_after(http, engine, 4))
        if mutate is not None:
            mutate(case)
        await http.post("/ng-control/v1/policy-version", json={"policy_version": case.engine_version},
                        headers=AUTH)
        admitted = len(engine.admitted)
        reply = await complete_under(http, case.capture_key, case.body)
        served = (await status(http))["tokens_from_staging"]
    return reply, len(engine.admitted) - admitted, served


async def test_the_valid_continuation_passes(worker_client: WorkerClient, tmp_path: Path) -> None:
    reply, admitted, served = await send(worker_client, tmp_path, None)
    assert reply.status_code == 200 and admitted == 1 and served == 4


@pytest.mark.parametrize(("mutate", "says"), MISMATCHES, ids=[m.__name__ for m, _ in MISMATCHES])
async def test_a_mismatch_is_invalid_checkpoint_state(
    worker_client: WorkerClient, tmp_path: Path, mutate: Callable[[Case], None], says: str
) -> None:
    reply, admitted, served = await send(worker_client, tmp_path, mutate)
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    assert error["code"] == "invalid_checkpoint_state" and says in error["detail"]
    assert admitted == 0 and served == 0


async def test_a_prefix_that_is_not_there_is_generated_afresh_and_counted(
    worker_client: WorkerClient, tmp_path: Path
) -> None:
    reply, admitted, served = await send(worker_client, tmp_path, missing)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["text"] == "abcdefghij" and choice["prompt_token_ids"] == BODY["prompt"]  # from the start
    assert admitted == 1 and served == 0


async def test_a_continuation_needs_its_model_call(worker_client: WorkerClient, tmp_path: Path) -> None:
    def without_call(case: Case) -> None:
        del case.body["model_call"]

    reply, admitted, _ = await send(worker_client, tmp_path, without_call)
    assert reply.status_code == 400 and "model_call" in reply.json()["error"]["detail"] and admitted == 0
