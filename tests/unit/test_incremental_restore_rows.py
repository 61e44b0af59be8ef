"""A restore from an incremental checkpoint gives the rows a restore from a full one gives.

In process (``tests.support.rollout_mesh``): the real environment, agent and calculator apps, a
deterministic model holding every second call. Three checkpoints of the same state: a full one, an
incremental one on top of it (its records are references into the first one's files), and a full
one again. The first is then pruned; each of the other two is restored in fresh apps and its
rollouts finished: the rows are the same, and the same as an uninterrupted run's.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from model_servers.inference_worker.default_model_data import make_problem
from nemo_gym_ckpt.capture import without_token_arrays
from nemo_gym_ckpt.checkpoint.coordinator import Coordinator
from nemo_gym_ckpt.checkpoint.incremental import REFERENCE_KEY
from nemo_gym_ckpt.identity import RolloutIdentity
from tests.support.rollout_mesh import DeterministicModel, calculator_answers, calculator_row, rollout_mesh

pytestmark = pytest.mark.unit

WAIT_S = 10.0
PROBLEMS = [make_problem(random.Random(700 + seed)) for seed in range(3)]
ROWS = [calculator_row(problem) for problem in PROBLEMS]
EPISODES = [RolloutIdentity(f"{index}-0") for index in range(len(ROWS))]


def model(*, hold_second_calls: bool = False) -> DeterministicModel:
    def second_call(key: str | None, body: dict[str, Any]) -> bool:
        return hold_second_calls and body["input"][-1].get("type") == "function_call_output"

    return DeterministicModel(calculator_answers({p["question"]: p for p in PROBLEMS}), hold=second_call)


async def checkpoint(coordinator: Coordinator, cid: str, directory: Path, *, incremental: bool) -> None:
    deadline = time.time() + WAIT_S
    assert (await coordinator.prepare(cid, deadline_ts=deadline)).prepared
    await coordinator.commit(cid, deadline_ts=deadline, checkpoint_dir=str(directory), episode_ids=EPISODES,
                             incremental=incremental)
    await coordinator.resume(cid, deadline_ts=deadline)


def references(directory: Path) -> int:
    """How many records the spans of a checkpoint stand for."""
    count = 0
    for manifest in directory.glob("gym/*/*/manifest.json"):
        records = manifest.parent / orjson.loads(manifest.read_bytes())["records_file"]
        lines = [orjson.loads(line) for line in records.read_bytes().splitlines()]
        count += sum(line["lines"] for line in lines if REFERENCE_KEY in line)
    return count


async def restored_rows(root: Path, directory: Path, cid: str) -> list[dict[str, Any]]:
    async with rollout_mesh("single_agent_turn", root, model()) as mesh:
        coordinator = mesh.coordinator()
        deadline = time.time() + WAIT_S
        restored = await coordinator.restore(cid, deadline_ts=deadline, checkpoint_dir=str(directory),
                                             episode_ids=EPISODES)
        await coordinator.resume(cid, deadline_ts=deadline)
        await coordinator.aclose()
        assert sorted(e.capture_key for e in restored.continued()) == [f"{e.rollout_id}-a1" for e in EPISODES]
        replies = await asyncio.gather(*(mesh.dispatch(ROWS[n], e.next_attempt()) for n, e in enumerate(EPISODES)))
    assert [reply.status_code for reply in replies] == [200] * len(ROWS)
    return [reply.json() for reply in replies]


async def test_rows_restored_from_an_incremental_checkpoint_equal_those_from_a_full_one(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    held = model(hold_second_calls=True)
    async with rollout_mesh("single_agent_turn", root, held) as mesh:
        for n, episode in enumerate(EPISODES):
            mesh.dispatch(ROWS[n], episode)
        deadline = time.monotonic() + WAIT_S
        while sum(held.holding.values()) < len(ROWS):
            assert time.monotonic() < deadline, "every second call held"
            await asyncio.sleep(0.005)
        coordinator = mesh.coordinator()
        await checkpoint(coordinator, "c1", root / "c1", incremental=False)
        await checkpoint(coordinator, "c2", root / "c2", incremental=True)
        await checkpoint(coordinator, "c3", root / "c3", incremental=False)
        await coordinator.aclose()
    assert references(root / "c2") >= 2 * len(ROWS) and references(root / "c3") == 0  # environment and agent
    shutil.rmtree(root / "c1")  # the incremental checkpoint's base is gone: it must read alone

    from_incremental = await restored_rows(root, root / "c2", "r2")
    from_full = await restored_rows(root, root / "c3", "r3")
    assert from_incremental == from_full
    async with rollout_mesh("single_agent_turn", root / "plain", model(), checkpoint=False) as mesh:
        reference = await asyncio.gather(*(mesh.dispatch(ROWS[n], e) for n, e in enumerate(EPISODES)))
    assert [without_token_arrays(row) for row in from_incremental] == [
        without_token_arrays(reply.json()) for reply in reference]
