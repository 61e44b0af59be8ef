"""The collector's checkpoint keeps the restored attempts it has not dispatched yet.

After a restore, the continued rollouts wait in the collector's queue as attempt N+1 while the
servers hold their restored state. A checkpoint taken before their ``/run`` is sent (the collector
dispatches at bounded concurrency; a timer or SIGUSR1 can fire at once) must keep them in its
scope: a commit that leaves a restored episode out deletes it (docs/protocol.md section 6), and after
the next crash those rollouts would start over, making again every model call they had made.
Found by the random fault sequences (``tests/e2e/test_fault_sequences.py``): a restore, then a
checkpoint before any dispatch, published ``continued: []``.

In process (``tests.support.rollout_mesh``): the real environment, agent and calculator apps, a
deterministic model that holds every second call.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from model_servers.inference_worker.default_model_data import make_problem
from nemo_gym_ckpt.capture import without_token_arrays
from nemo_gym_ckpt.collect.control import CollectionControl, ControlSettings
from nemo_gym_ckpt.collect.published import RunIdentity, input_digest
from nemo_gym_ckpt.identity import RolloutIdentity
from tests.support.rollout_mesh import (
    DeterministicModel,
    RolloutMesh,
    calculator_answers,
    calculator_row,
    rollout_mesh,
)

pytestmark = pytest.mark.unit

WAIT_S = 10.0
PROBLEMS = [make_problem(random.Random(900 + seed)) for seed in range(4)]
ROWS = [calculator_row(problem) for problem in PROBLEMS]
ROLLOUTS = [f"{index}-0" for index in range(len(ROWS))]


def model(*, hold_second_calls: bool = False) -> DeterministicModel:
    def second_call(key: str | None, body: dict[str, Any]) -> bool:
        return hold_second_calls and body["input"][-1].get("type") == "function_call_output"

    return DeterministicModel(calculator_answers({p["question"]: p for p in PROBLEMS}), hold=second_call)


def control(mesh: RolloutMesh, directory: Path) -> CollectionControl:
    identity = RunIdentity("c" * 64, input_digest(ROWS), 1)
    return CollectionControl(mesh.coordinator(), ControlSettings(directory, identity, timeout_s=WAIT_S))


async def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.005)


def keys(episodes: list[RolloutIdentity]) -> list[str]:
    return sorted(episode.capture_key for episode in episodes)


def row_of(episode: RolloutIdentity) -> dict[str, Any]:
    return ROWS[int(episode.rollout_id.split("-")[0])]


async def test_a_checkpoint_before_the_restored_attempts_are_sent_keeps_them(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    directory = root / "collection"
    held = model(hold_second_calls=True)
    async with rollout_mesh("single_agent_turn", root, held) as mesh:  # each waits on its second call
        ctl = control(mesh, directory)
        sent = await ctl.begin(ROLLOUTS)
        for episode in sent:
            ctl.dispatching(episode)
            mesh.dispatch(row_of(episode), episode)
        await until(lambda: sum(held.holding.values()) == len(ROWS), "every second call held")
        first = await ctl.checkpoint(lambda: list(sent), lambda: 0)
        ctl.close()
        await ctl.coordinator.aclose()
    assert first is not None and first.manifest.continued == keys(sent)

    async with rollout_mesh("single_agent_turn", root, model()) as mesh:  # fresh apps after the crash
        ctl = control(mesh, directory)
        waiting = await ctl.begin(ROLLOUTS)
        assert keys(waiting) == sorted(f"{rid}-a1" for rid in ROLLOUTS)
        second = await ctl.checkpoint(list, lambda: 0)  # before any of them is sent
        ctl.close()
        await ctl.coordinator.aclose()
    assert second is not None and second.manifest.continued == keys(waiting), "restored state dropped"

    fresh = model()
    async with rollout_mesh("single_agent_turn", root, fresh) as mesh:  # and a second crash
        ctl = control(mesh, directory)
        last = await ctl.begin(ROLLOUTS)
        assert keys(last) == sorted(f"{rid}-a2" for rid in ROLLOUTS)
        for episode in last:
            ctl.dispatching(episode)
        replies = await asyncio.gather(*(mesh.dispatch(row_of(episode), episode) for episode in last))
        ctl.close()
        await ctl.coordinator.aclose()
    assert [reply.status_code for reply in replies] == [200] * len(ROWS)
    assert sorted(str(key) for key in fresh.capture_keys()) == keys(last)  # only the held second calls
    async with rollout_mesh("single_agent_turn", root / "plain", model(), checkpoint=False) as mesh:
        reference = await asyncio.gather(*(mesh.dispatch(row_of(e), e) for e in map(RolloutIdentity, ROLLOUTS)))
    by_rollout = {episode.rollout_id: reply.json() for episode, reply in zip(last, replies, strict=True)}
    for rid, expected in zip(ROLLOUTS, reference, strict=True):
        assert without_token_arrays(by_rollout[rid]) == without_token_arrays(expected.json())
