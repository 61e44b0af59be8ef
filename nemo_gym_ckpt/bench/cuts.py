"""Benchmarks of generation cuts on real server processes; ``nemo-gym-ckpt bench`` calls ``run_all``.

Both run a mesh of the inference worker (embedded default model, CPU) and the policy model with
checkpointing on, once with ``generation_cuts: true`` and once without, and drive it with the
``Coordinator`` and plain chat calls under ``/ng-rollout/<key>/``. The calls are long: a prompt of
digits after which the default model writes up to the end of its 256-token context.

- ``checkpoint_pause(generations)``: that many generations in flight (each past ``MIN_TOKENS``),
  then prepare, commit, resume: the pause (prepare to resume) and the commit alone, median of
  ``repeats``, with cuts against without. Both meshes run at once and their runs alternate (the
  same load for both); with cuts, the steps of each cut are read back too: the worker's route
  (``worker_lock_ms``, ``worker_freeze_ms``, ``worker_stage_ms``, ``worker_total_ms``, and
  ``worker_keep_ms`` of the keep) and the policy model's commit (``policy_cut_request_ms``, the
  round trip; ``policy_settle_ms``, the keep as the commit waits for it).
- ``tokens_after_crash(generations)``: that many generations in flight past ``CRASH_AT_TOKENS``,
  commit, SIGKILL every server, fresh processes, restore, resume, the same calls again as the next
  attempts: the tokens the worker had produced before the checkpoint, how many of them were kept
  (served from staging) and how many were generated again, with cuts against without.

Every figure is measured in the run, against its own baseline; each function returns a dict.
``CutDriver`` is also what the end-to-end test of generation cuts drives its mesh with.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from nemo_gym_ckpt.checkpoint.coordinator import Coordinator
from nemo_gym_ckpt.config import MeshConfig, load_config_dict
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.launch.launcher import MeshLauncher

__all__ = [
    "CRASH_AT_TOKENS",
    "MAX_TOKENS",
    "MIN_TOKENS",
    "PROMPT",
    "TOKEN",
    "CutDriver",
    "checkpoint_pause",
    "cut_mesh",
    "cut_mesh_config",
    "run_all",
    "tokens_after_crash",
]

TOKEN = "cut-bench-token"
PROMPT = "1234567890" * 5  # the default model writes on to the end of its context after this
MAX_TOKENS = 200
MIN_TOKENS = 16
CRASH_AT_TOKENS = 64
CALL_TIMEOUT_S = 300.0
WAIT_S = 120.0
START_TIMEOUT_S = 180.0
TRIES = 5
Result = dict[str, Any]


def cut_mesh(root: Path, *, generation_cuts: bool, worker: dict[str, Any] | None = None) -> MeshConfig:
    """Worker + policy model, checkpointing on under ``root``, cuts on or off."""
    return load_config_dict(cut_mesh_config(root, generation_cuts=generation_cuts, worker=worker))


def cut_mesh_config(
    root: Path, *, generation_cuts: bool, worker: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The raw config of ``cut_mesh`` (what a YAML file of it holds)."""
    return {
        "head_server": {"port": 0},
        "checkpoint": {"enabled": True, "control_auth_token": TOKEN, "root": str(root),
                       "lease_grace_seconds": 120},
        "inference_worker": {"responses_api_models": {"inference_worker": worker or {}}},
        "policy_model": {"responses_api_models": {"policy_model": {
            "worker": {"type": "responses_api_models", "name": "inference_worker"}, "return_token_ids": True,
            "temperature": 1.0, "max_tokens": MAX_TOKENS, "checkpoint_policy": True,
            "generation_cuts": generation_cuts}}},
    }


def _quiet(_: str, __: str) -> None:
    """Drop server log lines."""


class CutDriver:
    """Chat calls, worker cut status and the coordinator of a started cut mesh."""

    def __init__(self, launcher: MeshLauncher, root: Path) -> None:
        self.launcher = launcher
        self.root = root
        self.http = httpx.AsyncClient(timeout=CALL_TIMEOUT_S, trust_env=False,
                                      limits=httpx.Limits(max_connections=256))
        self._auth = {"authorization": f"Bearer {TOKEN}"}

    async def aclose(self) -> None:
        await self.http.aclose()

    def coordinator(self) -> Coordinator:
        return Coordinator(self.launcher.head_url, TOKEN, required_kinds=("model",))

    async def call(self, episode: RolloutIdentity) -> dict[str, Any]:
        """One long chat call of ``episode``: the assistant message with its token fields."""
        url = f"{self.launcher.url_of('policy_model')}/ng-rollout/{episode.capture_key}/v1/chat/completions"
        messages = [{"role": "user", "content": PROMPT}]
        body = {"model": "policy", "messages": messages, "max_tokens": MAX_TOKENS}
        reply = await self.http.post(url, json=body)
        reply.raise_for_status()
        message: dict[str, Any] = reply.json()["choices"][0]["message"]
        return message

    def start_calls(self, episodes: Sequence[RolloutIdentity]) -> list[asyncio.Task[dict[str, Any]]]:
        return [asyncio.ensure_future(self.call(episode)) for episode in episodes]

    async def worker_status(self) -> dict[str, Any]:
        url = f"{self.launcher.url_of('inference_worker')}/ng-control/v1/generation-cut/status"
        reply = await self.http.get(url, headers=self._auth)
        reply.raise_for_status()
        status: dict[str, Any] = reply.json()
        return status

    async def until_generating(
        self, count: int, min_tokens: int, calls: Sequence[asyncio.Task[Any]] = ()
    ) -> int:
        """Until ``count`` generations run past ``min_tokens`` tokens (bounded); their tokens then.

        ``Missed`` once ``calls`` (if given) have all ended without that being seen."""
        deadline = time.monotonic() + WAIT_S
        while True:
            generations = (await self.worker_status())["live_generations"]
            live = [g["tokens"] for g in generations if not g["finished"]]
            if len([tokens for tokens in live if tokens >= min_tokens]) >= count:
                return sum(live)
            if calls and all(call.done() for call in calls):
                raise Missed(f"the {len(calls)} calls ended before {count} ran past {min_tokens} tokens at once")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} generations never ran past {min_tokens} tokens: {live}")
            await asyncio.sleep(0.005)

    def checkpoint_dir(self, checkpoint_id: str) -> str:
        return str(self.root / checkpoint_id)


async def _settle(tasks: Sequence[asyncio.Task[Any]]) -> list[Any]:
    async with asyncio.timeout(CALL_TIMEOUT_S):
        return list(await asyncio.gather(*tasks, return_exceptions=True))


class Missed(Exception):
    """The calls of a run all ended before they were seen generating together."""


async def _one_pause(driver: CutDriver, generations: int, label: str) -> Result:
    """One pause measurement (tried again, up to ``TRIES`` times, when the calls end before they are
    seen in flight together: on a busy machine the small default model can outrun the polling)."""
    for attempt in range(TRIES):
        try:
            return await _try_pause(driver, generations, f"{label}-t{attempt}")
        except Missed:
            continue
    raise RuntimeError(f"{generations} calls never seen in flight together in {TRIES} tries")


async def _try_pause(driver: CutDriver, generations: int, label: str) -> Result:
    episodes = [RolloutIdentity(f"{label}-{i}") for i in range(generations)]
    tasks = driver.start_calls(episodes)
    try:
        await driver.until_generating(generations, MIN_TOKENS, tasks)
    except Missed:
        await _settle(tasks)
        raise
    async with driver.coordinator() as coordinator:
        began = time.perf_counter()
        await coordinator.prepare(label, deadline_ts=time.time() + 60)
        committing = time.perf_counter()
        committed = await coordinator.commit(label, deadline_ts=time.time() + 60, episode_ids=episodes,
                                             checkpoint_dir=driver.checkpoint_dir(label))
        resuming = time.perf_counter()
        await coordinator.resume(label, deadline_ts=time.time() + 60)
        ended = time.perf_counter()
    outcomes = await _settle(tasks)
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    if failed:
        raise RuntimeError(f"{len(failed)} calls failed around checkpoint {label}: {failed[0]!r}")
    keys = committed.staging_keys().get("policy_model", [])
    return {"pause_ms": 1000 * (ended - began), "commit_ms": 1000 * (resuming - committing),
            "cuts": len(keys)}


async def _phases(driver: CutDriver) -> Result:
    """The latest cut's steps in milliseconds: the worker's (route) and the policy model's (commit)."""
    url = f"{driver.launcher.url_of('policy_model')}/ng-control/v1/checkpoint/status"
    reply = await driver.http.get(url, headers=driver._auth)
    reply.raise_for_status()
    worker = await driver.worker_status()
    policy: Result = reply.json()["extras"].get("generation_cut_ms", {})
    return {**{f"worker_{key}": value for key, value in worker["last_cut_ms"].items()},
            "worker_keep_ms": worker["last_keep_ms"], **{f"policy_{key}": value for key, value in policy.items()}}


async def _pauses(root: Path, generations: Sequence[int], repeats: int) -> dict[str, Result]:
    """Both meshes up at once; for each count the runs alternate, off then on then on then off..."""
    rows: dict[str, Result] = {"without_cuts": {}, "with_cuts": {}}
    with contextlib.ExitStack() as stack:
        launchers = {cuts: stack.enter_context(MeshLauncher(cut_mesh(root / f"cuts-{int(cuts)}",
                                                                     generation_cuts=cuts), on_line=_quiet))
                     for cuts in (False, True)}
        for launcher in launchers.values():
            await asyncio.to_thread(launcher.start, START_TIMEOUT_S)
        drivers = {cuts: CutDriver(launcher, root / f"cuts-{int(cuts)}") for cuts, launcher in launchers.items()}
        try:
            for count in generations:
                runs: dict[bool, list[Result]] = {False: [], True: []}
                for n in range(repeats):
                    for cuts in ((False, True) if n % 2 == 0 else (True, False)):
                        run = await _one_pause(drivers[cuts], count, f"p{int(cuts)}-{count}-{n}")
                        if cuts:
                            run.update(await _phases(drivers[cuts]))
                        runs[cuts].append(run)
                for cuts, name in ((False, "without_cuts"), (True, "with_cuts")):
                    keys = sorted({key for run in runs[cuts] for key in run})
                    rows[name][str(count)] = {
                        key: round(statistics.median(run[key] for run in runs[cuts] if run.get(key) is not None), 2)
                        for key in keys if any(run.get(key) is not None for run in runs[cuts])}
        finally:
            for driver in drivers.values():
                await driver.aclose()
    return rows


def checkpoint_pause(generations: Sequence[int] = (8, 64), repeats: int = 3) -> Result:
    """The checkpoint pause with long generations in flight, with cuts against without (interleaved)."""
    with tempfile.TemporaryDirectory(prefix="cut-bench-") as tmp:
        rows = asyncio.run(_pauses(Path(tmp), generations, repeats))
    without, with_cuts = rows["without_cuts"], rows["with_cuts"]
    ratios = {count: with_cuts[count]["pause_ms"] / max(without[count]["pause_ms"], 1e-9)
              for count in without}
    return {"max_tokens": MAX_TOKENS, "in_flight_past_tokens": MIN_TOKENS, "repeats": repeats,
            "without_cuts": without, "with_cuts": with_cuts, "pause_with_over_without": ratios}


async def _crash(root: Path, generation_cuts: bool, generations: int) -> Result:
    episodes = [RolloutIdentity(f"crash-{i}") for i in range(generations)]
    with MeshLauncher(cut_mesh(root, generation_cuts=generation_cuts), on_line=_quiet) as launcher:
        await asyncio.to_thread(launcher.start, START_TIMEOUT_S)
        driver = CutDriver(launcher, root)
        try:
            return await _crash_run(driver, launcher, episodes)
        finally:
            await driver.aclose()


async def _crash_run(driver: CutDriver, launcher: MeshLauncher, episodes: list[RolloutIdentity]) -> Result:
    tasks = driver.start_calls(episodes)
    before = await driver.until_generating(len(episodes), CRASH_AT_TOKENS)
    async with driver.coordinator() as coordinator:
        await coordinator.prepare("crash", deadline_ts=time.time() + 60)
        committed = await coordinator.commit("crash", deadline_ts=time.time() + 60, episode_ids=episodes,
                                             checkpoint_dir=driver.checkpoint_dir("crash"))
    await asyncio.to_thread(launcher.restart_all, START_TIMEOUT_S)
    await _settle(tasks)  # they all failed with the servers
    async with driver.coordinator() as coordinator:
        await coordinator.restore("crash", deadline_ts=time.time() + 60,
                                  checkpoint_dir=driver.checkpoint_dir("crash"), episode_ids=episodes)
        await coordinator.resume("crash", deadline_ts=time.time() + 60)
    messages = await _settle(driver.start_calls([episode.next_attempt() for episode in episodes]))
    status = await driver.worker_status()
    final = sum(len(message["generation_token_ids"]) for message in messages)
    kept = status["tokens_from_staging"]
    return {"generations": len(episodes), "cuts": len(committed.staging_keys().get("policy_model", [])),
            "tokens_before_checkpoint": before, "tokens_kept": kept,
            "tokens_generated_after_restore": status["tokens_generated"], "final_tokens": final,
            "tokens_generated_again": max(before - kept, 0)}


def tokens_after_crash(generations: int = 8) -> Result:
    """Tokens generated again after a crash mid-generation, with cuts against without."""
    with tempfile.TemporaryDirectory(prefix="cut-bench-") as tmp:
        without = asyncio.run(_crash(Path(tmp) / "off", False, generations))
        with_cuts = asyncio.run(_crash(Path(tmp) / "on", True, generations))
    return {"crash_after_tokens": CRASH_AT_TOKENS, "without_cuts": without, "with_cuts": with_cuts}


def run_all(quick: bool = False) -> Result:
    """Both benchmarks (one repeat and fewer generations with ``quick``)."""
    return {
        "pause": checkpoint_pause((8, 64) if not quick else (8,), repeats=1 if quick else 3),
        "crash": tokens_after_crash(8),
    }
