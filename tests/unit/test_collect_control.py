"""The collector as checkpoint controller, in process: the real environment, agent and calculator
apps as participants (``tests.support.rollout_mesh``), a deterministic model that can hold replies.

A run is stopped by a SIGTERM checkpoint while rollouts wait on held model calls; the apps are then
gone (a crash); a rerun on fresh apps restores, fences, continues the checkpointed rollouts as
attempt 1 without repeating a completed model call, skips a row written after the checkpoint, and
ends with the rows of an uninterrupted run. Another run checkpoints on request and goes on.
"""

from __future__ import annotations

import asyncio
import functools
import io
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from model_servers.inference_worker.default_model_data import make_problem
from nemo_gym_ckpt.capture import without_token_arrays
from nemo_gym_ckpt.collect.control import CollectionControl, ControlSettings
from nemo_gym_ckpt.collect.dispatch import Plan, Summary, run_plan
from nemo_gym_ckpt.collect.published import (
    DISPATCH_LOG,
    RunIdentity,
    find_latest,
    input_digest,
    is_checkpoint_id,
    read_dispatched,
)
from nemo_gym_ckpt.collect.rows import JsonlAppender, read_jsonl
from nemo_gym_ckpt.collect.triggers import SIGTERM, SIGUSR1, Triggers
from nemo_gym_ckpt.errors import Unavailable
from tests.support.rollout_mesh import (
    DeterministicModel,
    RolloutMesh,
    calculator_answers,
    calculator_row,
    rollout_mesh,
)

pytestmark = pytest.mark.unit

WAIT_S = 10.0
PROBLEMS = [make_problem(random.Random(700 + seed)) for seed in range(6)]
ROWS = [calculator_row(problem) for problem in PROBLEMS]
HELD = ("0-0", "2-0", "4-0")


def model(hold: tuple[str, ...] = ()) -> DeterministicModel:
    def second_call_of_held(key: str | None, body: dict[str, Any]) -> bool:
        return key in hold and body["input"][-1].get("type") == "function_call_output"

    answers = calculator_answers({p["question"]: p for p in PROBLEMS})
    return DeterministicModel(answers, hold=second_call_of_held)


def plan(mesh: RolloutMesh, output: Path, rows: list[dict[str, Any]] = ROWS) -> Plan:
    return Plan("env", mesh.urls["env"], rows, output, concurrency=8, rollout_timeout_s=WAIT_S * 3)


def control(
    mesh: RolloutMesh, directory: Path, rows: list[dict[str, Any]] = ROWS, **settings: Any
) -> CollectionControl:
    identity = RunIdentity("c" * 64, input_digest(rows), 1)
    return CollectionControl(mesh.coordinator(), ControlSettings(directory, identity, timeout_s=WAIT_S, **settings))


async def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.005)


async def request_when(triggers: Triggers, reason: str, condition: Callable[[], bool]) -> None:
    await until(condition, f"ready for {reason}")
    triggers.request(reason)


async def controlled_run(
    mesh: RolloutMesh, output: Path, directory: Path, triggers: Triggers, rows: list[dict[str, Any]] = ROWS,
    **settings: Any,
) -> tuple[Summary, CollectionControl]:
    ctl = control(mesh, directory, rows, **settings)
    try:
        async with asyncio.timeout(WAIT_S * 3):
            summary = await run_plan(plan(mesh, output, rows), mesh.client, io.StringIO(), control=ctl,
                                     triggers=triggers)
    finally:
        ctl.close()
        await ctl.coordinator.aclose()
    return summary, ctl


async def reference_rows(tmp_path: Path) -> dict[tuple[int, int], dict[str, Any]]:
    async with rollout_mesh("single_agent_turn", tmp_path / "plain", model(), checkpoint=False) as mesh:
        output = tmp_path / "reference.jsonl"
        await run_plan(plan(mesh, output), mesh.client, io.StringIO())
    return keyed(output)


def keyed(output: Path) -> dict[tuple[int, int], dict[str, Any]]:
    rows = list(read_jsonl(output))
    by_key = {(row["_ng_task_index"], row["_ng_rollout_index"]): row for row in rows}
    assert len(by_key) == len(rows), "a rollout has two rows"
    return by_key


def comparable(row: dict[str, Any]) -> Any:
    return without_token_arrays({key: value for key, value in row.items() if key != "_ng_attempt_index"})


def snapshot(directory: Path) -> dict[str, bytes]:
    files = [path for path in directory.rglob("*") if path.is_file()]
    return {str(path.relative_to(directory)): path.read_bytes() for path in files}


async def test_sigterm_checkpoints_and_stops_and_a_rerun_continues_to_the_uninterrupted_rows(
    tmp_path: Path,
) -> None:
    reference = await reference_rows(tmp_path)
    root, output = tmp_path / "checkpoints", tmp_path / "rollouts.jsonl"
    directory = root / "collection"
    held = model(hold=HELD)
    triggers = Triggers()
    async with rollout_mesh("single_agent_turn", root, held) as mesh:
        waiting = asyncio.create_task(request_when(
            triggers, SIGTERM, lambda: sum(held.holding.values()) == 3 and len(keyed(output)) == 3))
        first, _ = await controlled_run(mesh, output, directory, triggers)
        await waiting
    # the crash: every app is gone
    assert first.stopped_by == SIGTERM and first.stop_checkpointed and first.finished == 3
    latest = find_latest(directory)
    assert latest is not None and (directory / "LATEST").read_text().strip() == latest.checkpoint_id
    assert latest.continued == sorted(HELD) and latest.restarted == [] and latest.rows_done == 3
    assert set(latest.manifests) == {"env", "agent"}  # the calculator of this mesh is a plain server
    assert read_dispatched(directory) == {f"{task}-0": 0 for task in range(6)}
    # the crash fell after 2-0 wrote its row and before the next checkpoint
    with JsonlAppender(output) as appender:
        appender.append(reference[(2, 0)])
    restored_from = snapshot(directory / latest.checkpoint_id)

    fresh = model()
    async with rollout_mesh("single_agent_turn", root, fresh) as mesh:
        second, ctl = await controlled_run(mesh, output, directory, Triggers())
        env_status = await mesh.status("env")
    assert second.stopped_by is None and second.skipped == 4
    assert second.finished == 2 and second.continued == 2
    assert [e.capture_key for e in ctl.restored.continued] == ["0-0-a1", "4-0-a1"]
    assert sorted(e.capture_key for e in ctl.restored.fenced) == ["0-0", "4-0"]
    # the held second calls, made again: no completed model call is made twice
    assert sorted(str(key) for key in fresh.capture_keys()) == ["0-0-a1", "4-0-a1"]
    rows = keyed(output)
    assert {key: comparable(row) for key, row in rows.items()} == {
        key: comparable(row) for key, row in reference.items()}
    assert {key: row["_ng_attempt_index"] for key, row in rows.items() if row["_ng_attempt_index"]} == {
        (0, 0): 1, (4, 0): 1}
    assert read_dispatched(directory) == {**{f"{task}-0": 0 for task in range(6)}, "0-0": 1, "4-0": 1}
    assert snapshot(directory / latest.checkpoint_id) == restored_from  # never modified
    assert env_status["retired_rollouts"] == 0 and env_status["extras"]["episodes"] == 0  # forgotten


async def test_a_rerun_with_nothing_left_restores_nothing(tmp_path: Path) -> None:
    root, output = tmp_path / "checkpoints", tmp_path / "rollouts.jsonl"
    async with rollout_mesh("single_agent_turn", root, model()) as mesh:
        summary, ctl = await controlled_run(mesh, output, root / "collection", Triggers())
        again, ctl = await controlled_run(mesh, output, root / "collection", Triggers())
    assert summary.finished == 6 and again.skipped == 6 and again.finished == 0
    assert ctl.restored.source is None
    assert (root / "collection" / DISPATCH_LOG).read_bytes().count(b"\n") == 6


async def test_sigusr1_checkpoints_and_goes_on_keeping_the_two_newest(tmp_path: Path) -> None:
    reference = await reference_rows(tmp_path)
    root, output = tmp_path / "checkpoints", tmp_path / "rollouts.jsonl"
    directory = root / "collection"
    rows = [*ROWS, {"responses_create_params": {"input": 5}}]  # the last one fails validation
    held = model(hold=HELD)
    triggers = Triggers()
    published: list[str] = []

    def published_at_least(count: int) -> bool:
        latest = find_latest(directory)
        if latest is not None and latest.checkpoint_id not in published:
            published.append(latest.checkpoint_id)
        return len(published) >= count

    async def three_checkpoints_then_release() -> None:
        for count in range(1, 4):
            await request_when(triggers, SIGUSR1, lambda: sum(held.holding.values()) == 3)
            await until(functools.partial(published_at_least, count), f"checkpoint {count} published")
        held.release()

    async with rollout_mesh("single_agent_turn", root, held) as mesh:
        driver = asyncio.create_task(three_checkpoints_then_release())
        summary, _ = await controlled_run(mesh, output, directory, triggers, rows)
        await driver
        env_status = await mesh.status("env")
    assert summary.stopped_by is None and summary.finished == 6 and summary.failed == 1
    assert len(summary.checkpoints) == 3
    assert all(p.manifest.continued == sorted(HELD) and p.pause_ms > 0 for p in summary.checkpoints)
    kept = sorted(p.name for p in directory.iterdir() if is_checkpoint_id(p.name))
    assert kept == sorted(published[-2:])  # the oldest deleted, after the newest was published
    assert {key: comparable(row) for key, row in keyed(output).items()} == {
        k: comparable(r) for k, r in reference.items()}
    assert all(row["_ng_attempt_index"] == 0 for row in keyed(output).values())
    assert env_status["retired_rollouts"] == 1  # the failed attempt was retired (and not forgotten)


async def test_the_timer_checkpoints_every_s_while_rollouts_run(tmp_path: Path) -> None:
    root, output = tmp_path / "checkpoints", tmp_path / "rollouts.jsonl"
    directory = root / "collection"
    held = model(hold=HELD)

    async def release_after_two() -> None:
        await until(lambda: len(list(directory.glob("ckpt-*/collection.json"))) >= 2, "two timed checkpoints")
        held.release()

    async with rollout_mesh("single_agent_turn", root, held) as mesh:
        releasing = asyncio.create_task(release_after_two())
        summary, _ = await controlled_run(mesh, output, directory, Triggers(every_s=0.05))
        await releasing
    assert summary.finished == 6 and len(summary.checkpoints) >= 2
    assert all(set(p.manifest.continued) <= set(HELD) for p in summary.checkpoints)


def test_triggers_answer_stop_then_sigterm_then_others_then_the_timer() -> None:
    now = [0.0]
    triggers = Triggers(every_s=5.0, clock=lambda: now[0])

    async def drain() -> list[str | None]:
        return [await triggers.next(0.0) for _ in range(3)]

    assert asyncio.run(drain()) == [None, None, None]
    now[0] = 5.0
    triggers.request(SIGUSR1)
    triggers.request(SIGTERM)
    triggers.request(SIGUSR1)
    assert asyncio.run(drain()) == [SIGTERM, SIGUSR1, "timer"]
    triggers.started()
    triggers.close()
    assert asyncio.run(drain()) == ["stop", "stop", "stop"]
    with pytest.raises(ValueError, match="every_s"):
        Triggers(every_s=0)


async def sigterm_checkpoint(root: Path, output: Path, directory: Path) -> None:
    """A first run stopped by a SIGTERM checkpoint with the HELD rollouts in flight (then a crash)."""
    held, triggers = model(hold=HELD), Triggers()
    async with rollout_mesh("single_agent_turn", root, held) as mesh:
        waiting = asyncio.create_task(request_when(
            triggers, SIGTERM, lambda: sum(held.holding.values()) == 3 and len(keyed(output)) == 3))
        await controlled_run(mesh, output, directory, triggers)
        await waiting


async def test_a_failed_fencing_after_a_restore_still_resumes_the_mesh(tmp_path: Path) -> None:
    root, output = tmp_path / "checkpoints", tmp_path / "rollouts.jsonl"
    directory = root / "collection"
    await sigterm_checkpoint(root, output, directory)
    async with rollout_mesh("single_agent_turn", root, model()) as mesh:
        ctl = control(mesh, directory)

        async def failing_retire(*args: Any, **kwargs: Any) -> Any:
            raise Unavailable("retire on agent: timed out")

        ctl.coordinator.retire = failing_retire  # type: ignore[method-assign]
        try:
            with pytest.raises(Unavailable, match="retire on agent"):
                await ctl.begin([f"{task}-0" for task in (0, 2, 4)])
            phases = {name: (await mesh.status(name))["phase"] for name in ("env", "agent")}
        finally:
            ctl.close()
            await ctl.coordinator.aclose()
    assert phases == {"env": "idle", "agent": "idle"}  # resumed, not left restored


def damage_records(checkpoint: Path, kind: str = "agent") -> None:
    """Replace one participant's records file of ``checkpoint`` by garbage (its own directory entry
    only: an earlier checkpoint's records hard-linked there stay intact)."""
    manifest_path = next((checkpoint / "gym" / kind).rglob("manifest.json"))
    records = manifest_path.with_name(orjson.loads(manifest_path.read_bytes())["records_file"])
    records.unlink()
    records.write_bytes(b"garbage\n")  # invalid_checkpoint_state: sha256 and count do not match


@pytest.mark.parametrize("seen_by", ["files check", "participants"])
async def test_a_checkpoint_refused_as_unusable_is_kept_and_its_rollouts_start_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, seen_by: str,
) -> None:
    reference = await reference_rows(tmp_path)
    root, output = tmp_path / "checkpoints", tmp_path / "rollouts.jsonl"
    directory = root / "collection"
    await sigterm_checkpoint(root, output, directory)
    latest = find_latest(directory)
    assert latest is not None
    damage_records(directory / latest.checkpoint_id)
    # by the participants: the files are not read first when the mesh's record bound is not known
    # (``--head`` without ``--config``), as for a refusal only an adapter's install can see
    settings = {"max_record_bytes": None} if seen_by == "participants" else {}
    async with rollout_mesh("single_agent_turn", root, model()) as mesh:
        summary, ctl = await controlled_run(mesh, output, directory, Triggers(), **settings)
        phases = {name: (await mesh.status(name))["phase"] for name in ("env", "agent")}
    assert summary.stopped_by is None and summary.finished == 3 and summary.continued == 0
    assert ctl.restored.refused == [latest.checkpoint_id] and ctl.restored.continued == []
    assert ctl.restored.restarted == sorted(HELD)
    assert f"checkpoint {latest.checkpoint_id} refused as unusable (invalid_checkpoint_state" in caplog.text
    assert (directory / latest.checkpoint_id / "collection.json").is_file()  # never deleted
    assert phases == {"env": "idle", "agent": "idle"}
    rows = keyed(output)
    assert {key: comparable(row) for key, row in rows.items()} == {
        key: comparable(row) for key, row in reference.items()}
    # refused by the files check, nothing was sent: each starts over as the attempt after attempt 0;
    # refused by the participants, the undo retired the next attempts: each starts over above them
    attempt = 1 if seen_by == "files check" else 2
    assert {key: row["_ng_attempt_index"] for key, row in rows.items() if row["_ng_attempt_index"]} == {
        (0, 0): attempt, (2, 0): attempt, (4, 0): attempt}


async def test_a_damaged_newest_checkpoint_falls_back_to_the_older_one_and_its_rollouts_continue(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    reference = await reference_rows(tmp_path)
    root, output = tmp_path / "checkpoints", tmp_path / "rollouts.jsonl"
    directory = root / "collection"
    held, triggers = model(hold=HELD), Triggers()
    published: list[str] = []

    def newly_published() -> bool:
        latest = find_latest(directory)
        if latest is not None and latest.checkpoint_id not in published:
            published.append(latest.checkpoint_id)
        return bool(published)

    async def checkpoint_then_stop() -> None:  # two checkpoints of the same three held rollouts
        await request_when(triggers, SIGUSR1, lambda: sum(held.holding.values()) == 3 and len(keyed(output)) == 3)
        await until(newly_published, "the first checkpoint published")
        triggers.request(SIGTERM)

    async with rollout_mesh("single_agent_turn", root, held) as mesh:
        driver = asyncio.create_task(checkpoint_then_stop())
        first, _ = await controlled_run(mesh, output, directory, triggers)
        await driver
    assert first.stop_checkpointed and len(first.checkpoints) == 2
    older, newest = (p.manifest for p in first.checkpoints)
    assert older.continued == newest.continued == sorted(HELD)
    damage_records(directory / newest.checkpoint_id)  # LATEST's checkpoint: the agent would refuse it

    fresh = model()
    async with rollout_mesh("single_agent_turn", root, fresh) as mesh:
        second, ctl = await controlled_run(mesh, output, directory, Triggers())
    assert ctl.restored.refused == [newest.checkpoint_id]
    assert ctl.restored.source is not None and ctl.restored.source.checkpoint_id == older.checkpoint_id
    assert second.finished == 3 and second.continued == 3 and ctl.restored.restarted == []
    assert sorted(e.capture_key for e in ctl.restored.continued) == ["0-0-a1", "2-0-a1", "4-0-a1"]
    # continued from the older checkpoint: only the held second calls are made, none started over
    assert sorted(str(key) for key in fresh.capture_keys()) == ["0-0-a1", "2-0-a1", "4-0-a1"]
    rows = keyed(output)
    assert {key: comparable(row) for key, row in rows.items()} == {
        key: comparable(row) for key, row in reference.items()}
    assert {key: row["_ng_attempt_index"] for key, row in rows.items() if row["_ng_attempt_index"]} == {
        (0, 0): 1, (2, 0): 1, (4, 0): 1}
    assert f"checkpoint {newest.checkpoint_id} refused as unusable (invalid_checkpoint_state" in caplog.text
