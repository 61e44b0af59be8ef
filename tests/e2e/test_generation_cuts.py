"""Generation cuts end to end: real processes, a checkpoint mid-generation, SIGKILL, restore.

Inference worker (embedded default model, CPU, KV cache) + policy model with ``generation_cuts``,
each its own process, driven by the ``Coordinator`` and direct model calls under
``/ng-rollout/<key>/`` (``cut_bench.CutDriver``). Eight rollouts each make one long call (a prompt
after which the model writes 200 tokens, sampled with the derived seed):

1. the uninterrupted run: the eight calls to their end; then retire and forget the rollouts;
2. the same eight calls again; once each has produced ``CUT_AFTER`` tokens: prepare and commit
   (the commit cuts every generation in flight); SIGKILL every server; fresh processes;
3. restore, resume, and the eight calls again as the next attempts.

The continued calls answer exactly the tokens of the uninterrupted run, every token produced
before the checkpoint is served from staging (kept) and none is generated again.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from nemo_gym_ckpt.bench.cuts import MAX_TOKENS, CutDriver, cut_mesh_config
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.launch.launcher import MeshLauncher

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(420),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the launcher's process groups"),
]

ROLLOUTS = 8
CUT_AFTER = 48
DEADLINE_S = 60.0


def cut_records(root: Path, checkpoint_id: str) -> dict[str, dict[str, Any]]:
    """The model's records of a committed checkpoint, by rollout id."""
    directory = root / checkpoint_id / "gym" / "model" / "policy_model"
    manifest = orjson.loads((directory / "manifest.json").read_bytes())
    lines = (directory / manifest["records_file"]).read_bytes().splitlines()
    return {record["episode_id"]["rollout_id"]: record for record in map(orjson.loads, lines)}


async def reference_run(driver: CutDriver, episodes: list[RolloutIdentity]) -> list[dict[str, Any]]:
    """The uninterrupted calls; then the rollouts are retired and forgotten, to be run again."""
    messages = await asyncio.gather(*driver.start_calls(episodes))
    async with driver.coordinator() as coordinator:
        await coordinator.retire(episodes, deadline_ts=time.time() + DEADLINE_S)
        await coordinator.forget([e.rollout_id for e in episodes], deadline_ts=time.time() + DEADLINE_S)
    return list(messages)


async def checkpoint_mid_generation(driver: CutDriver, episodes: list[RolloutIdentity]) -> dict[str, Any]:
    """The calls again, committed once each is past ``CUT_AFTER`` tokens; the commit's outcome."""
    calls = driver.start_calls(episodes)
    before = await driver.until_generating(len(episodes), CUT_AFTER)
    async with driver.coordinator() as coordinator:
        prepared = await coordinator.prepare("mid", deadline_ts=time.time() + DEADLINE_S)
        assert prepared.prepared, prepared.to_json()
        directory = driver.checkpoint_dir("mid")
        committed = await coordinator.commit("mid", deadline_ts=time.time() + DEADLINE_S,
                                             episode_ids=episodes, checkpoint_dir=directory)
    return {"calls": calls, "before": before, "keys": committed.staging_keys()["policy_model"]}


async def continue_after_crash(
    driver: CutDriver, launcher: MeshLauncher, episodes: list[RolloutIdentity], calls: list[asyncio.Task[Any]]
) -> list[dict[str, Any]]:
    await asyncio.to_thread(launcher.restart_all, 180.0)  # SIGKILL every server, start fresh ones
    lost = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(outcome, Exception) for outcome in lost), "a call finished through the crash"
    async with driver.coordinator() as coordinator:
        directory = driver.checkpoint_dir("mid")
        restored = await coordinator.restore("mid", deadline_ts=time.time() + DEADLINE_S,
                                             episode_ids=episodes, checkpoint_dir=directory)
        assert sorted(restored.restored()) == sorted(e.next_attempt().capture_key for e in episodes)
        await coordinator.resume("mid", deadline_ts=time.time() + DEADLINE_S)
    return list(await asyncio.gather(*driver.start_calls([e.next_attempt() for e in episodes])))


async def test_continued_generations_keep_every_token_cut_before_the_crash(
    tmp_path: Path, launch_mesh: Callable[..., MeshLauncher]
) -> None:
    root = tmp_path / "checkpoints"
    config = tmp_path / "mesh.yaml"
    config.write_text(yaml.safe_dump(cut_mesh_config(root, generation_cuts=True)))
    launcher = launch_mesh(str(config), ready_timeout_s=180.0)
    driver = CutDriver(launcher, root)
    episodes = [RolloutIdentity(f"long-{n}") for n in range(ROLLOUTS)]
    try:
        reference = await reference_run(driver, episodes)
        cut = await checkpoint_mid_generation(driver, episodes)
        continued = await continue_after_crash(driver, launcher, episodes, cut["calls"])
        counters = await driver.worker_status()
    finally:
        await driver.aclose()
    records = cut_records(root, "mid")
    prefixes = [records[e.rollout_id]["cut"]["prefix_token_count"] for e in episodes]
    assert all(records[e.rollout_id]["cut"]["cut_kind"] == "active_prefix" for e in episodes)
    assert sorted(cut["keys"]) == sorted(records[e.rollout_id]["cut"]["staging_keys"][0] for e in episodes)
    lengths = [len(message["generation_token_ids"]) for message in continued]
    for uninterrupted, again, prefix, length in zip(reference, continued, prefixes, lengths, strict=True):
        assert again["generation_token_ids"] == uninterrupted["generation_token_ids"]
        assert CUT_AFTER <= prefix < length <= MAX_TOKENS
        assert again["generation_log_probs"] == pytest.approx(uninterrupted["generation_log_probs"], abs=1e-4)
    kept, generated = counters["tokens_from_staging"], counters["tokens_generated"]
    regenerated = generated - sum(length - prefix for prefix, length in zip(prefixes, lengths, strict=True))
    assert kept == sum(prefixes) >= cut["before"] > 0  # every token produced before the checkpoint is kept
    assert regenerated == 0, f"{regenerated} tokens produced before the checkpoint were generated again"
