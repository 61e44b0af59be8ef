"""The ``prepare_latency`` and ``checkpoint_overhead`` suites of ``nemo-gym-ckpt bench``.

Both run the quickstart mesh (``configs/quickstart.yaml``, real processes) with the same rollouts as
``rollout_bench``: ``POST {environment}/ng-rollout/<id>/run`` with the quickstart's task rows.

``prepare_latency(levels, checkpoints)``: one mesh with checkpointing on. At each level, that many
rollouts are kept in flight (a closed loop: a rollout that ends is replaced at once; level 0 is an
idle mesh) and the ``Coordinator`` takes ``checkpoints`` checkpoints one after another, each
prepare, commit (every live episode in scope) and resume, with a pause between them so that the
rollouts move on. Per level: prepare, commit and resume p50/p99, the time of each prepare stage
(environment, model, agent, resources) next to the round trip of a ``/status`` call to the same
server just before (how long any control call waits for a busy server's event loop), what was in
flight when prepare began (the environment's live episodes and the steps they were in, the policy
model's calls), the records committed, and the rollouts that finished while the checkpoints were
taken (their rate and latency; none may fail).
Before each checkpoint the rollouts finished since the last one are forgotten, as the collector
does (timed apart: ``forget_before_each``).

``checkpoint_overhead(rounds, batch, concurrency)``: three meshes launched once (side by side) and kept up:
``off_a`` and ``off_b`` (checkpointing off) and ``on`` (enabled, never checkpointed). Each round
runs the same batch of task rows at the same concurrency on each of them, one mesh after another,
the order rotated every round. Per round: the rate of ``on`` over the mean of the two off meshes,
and ``off_b`` over ``off_a`` (the noise floor: two meshes that differ in nothing); the same two
ratios for the mesh's CPU per rollout (every server process and the driver, from ``/proc``), which
other work on the machine disturbs much less than it disturbs rates, and for the participants' CPU
alone (the four servers that run checkpoint code: not the inference worker, which spends most of
the CPU and none of it on checkpoints). Reported: the median of the
per-round ratios with their min and max; the pooled rates (all rollouts over all batch time: with
rounds a multiple of 6, every mesh ran in every position of the order equally often); and CPU ms
per rollout of every server process of each mesh (where an enabled-idle cost shows). After each
batch on ``on`` its rollouts are forgotten, as the collector does: that CPU is counted, its time is not.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemo_gym_ckpt.bench.mesh import (
    CALL_TIMEOUT_S,
    CpuMeter,
    checkpoint_root,
    launched_mesh,
    launched_meshes,
    loadavg,
    mesh_urls,
    task_rows,
)
from nemo_gym_ckpt.bench.stats import percentile, quantiles_ms
from nemo_gym_ckpt.checkpoint.coordinator import Coordinator, Outcome, ParticipantRef
from nemo_gym_ckpt.checkpoint.router import CONTROL_PREFIX
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config_overrides import quote_override_value
from nemo_gym_ckpt.errors import GymError
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.launch.launcher import MeshLauncher

__all__ = ["LEVELS", "TOKEN", "checkpoint_overhead", "enabled_overrides", "prepare_latency"]

Result = dict[str, Any]
TOKEN = "bench-checkpoint-token"
LEVELS = (0, 32, 256)
QUICK_LEVELS = (0, 8)
IN_FLIGHT_WAIT_S = 120.0
CHECKPOINT_DEADLINE_S = 120.0
MESHES = ("off_a", "on", "off_b")
NOT_PARTICIPANTS = frozenset({"inference_worker", "driver"})


def enabled_overrides(root: Path | str) -> list[str]:
    """Config overrides that turn checkpointing on, with checkpoints under ``root``."""
    return ["checkpoint.enabled=true", f"checkpoint.control_auth_token={TOKEN}",
            f"checkpoint.root={quote_override_value(str(root))}"]


# ---- rollouts kept in flight ------------------------------------------------------------------------


class _InFlight:
    """``level`` rollouts in flight on the environment at ``url``: each one that ends is replaced."""

    def __init__(self, client: MeshClient, url: str, tasks: list[dict[str, Any]], level: int, label: str) -> None:
        self.client, self.url, self.tasks, self.level, self.label = client, url, tasks, level, label
        self.ends: list[tuple[float, float]] = []  # (when it ended, how long it took)
        self.failures: list[str] = []
        self.finished: list[str] = []
        self._stopping = False
        self._seen: set[int] = set()
        self.warm = asyncio.Event()
        self._workers: list[asyncio.Task[None]] = []
        if level == 0:
            self.warm.set()

    def start(self) -> None:
        self._workers = [asyncio.create_task(self._worker(n)) for n in range(self.level)]

    async def stop(self) -> None:
        self._stopping = True
        await asyncio.gather(*self._workers)

    async def _worker(self, worker_id: int) -> None:
        n = 0
        while not self._stopping:
            task = self.tasks[(worker_id + n * self.level) % len(self.tasks)]
            identity = RolloutIdentity(f"{self.label}-{worker_id}-{n}")
            started = time.perf_counter()
            try:
                await self.client.post_json(f"{self.url}/run", task, identity=identity, timeout_s=CALL_TIMEOUT_S)
            except GymError as error:
                self.failures.append(f"{error.code}: {error.detail}")
            else:
                ended = time.perf_counter()
                self.ends.append((ended, ended - started))
            self.finished.append(identity.rollout_id)
            self._seen.add(worker_id)
            if len(self._seen) == self.level:
                self.warm.set()
            n += 1


# ---- prepare latency ----------------------------------------------------------------------------------


class _TimedCoordinator(Coordinator):
    """A coordinator that times each fan-out: one prepare stage, the commit, one resume stage."""

    def __init__(self, head_url: str, token: str, *, client: MeshClient) -> None:
        super().__init__(head_url, token, client=client)
        self.fan_outs: list[tuple[str, str, float]] = []

    async def forget_finished(self, rollout_ids: list[str]) -> float:
        """Forget finished rollouts, as the collector does every few seconds; ms taken."""
        if not rollout_ids:
            return 0.0
        started = time.perf_counter()
        await self.forget(rollout_ids, deadline_ts=time.time() + CHECKPOINT_DEADLINE_S)
        return 1000 * (time.perf_counter() - started)

    async def _fan_out(
        self, participants: list[ParticipantRef], op: str, body: dict[str, Any], deadline_ts: float
    ) -> list[Outcome]:
        started = time.perf_counter()
        try:
            return await super()._fan_out(participants, op, body, deadline_ts)
        finally:
            kinds = "+".join(sorted({participant.kind for participant in participants}))
            self.fan_outs.append((op, kinds, 1000 * (time.perf_counter() - started)))


async def _extras(client: MeshClient, url: str) -> dict[str, Any]:
    status = await client.get_json(f"{url}{CONTROL_PREFIX}/status", headers={"authorization": f"Bearer {TOKEN}"},
                                   rollout_prefix=False)
    extras = status.get("extras", {}) if isinstance(status, dict) else {}
    return {key: value for key, value in extras.items() if isinstance(value, int | float)}


async def _one_checkpoint(
    coordinator: _TimedCoordinator, client: MeshClient, watched: dict[str, str], root: Path, cid: str
) -> Result:
    before, status_ms = {}, {}
    for name, url in watched.items():  # a control call's round trip right now: how busy each server is
        started = time.perf_counter()
        before[name] = await _extras(client, url)
        status_ms[name] = 1000 * (time.perf_counter() - started)
    coordinator.fan_outs.clear()
    deadline = time.time() + CHECKPOINT_DEADLINE_S
    began = time.perf_counter()
    try:
        prepared = await coordinator.prepare(cid, deadline_ts=deadline)
        prepared_at = time.perf_counter()
        if not prepared.prepared:
            raise RuntimeError(f"checkpoint {cid} was not prepared by its deadline: {prepared.to_json()}")
        committed = await coordinator.commit(cid, deadline_ts=deadline, checkpoint_dir=str(root / cid))
        committed_at = time.perf_counter()
    except (GymError, RuntimeError):
        await coordinator.resume(cid, deadline_ts=time.time() + CHECKPOINT_DEADLINE_S)  # never leave it paused
        raise
    await coordinator.resume(cid, deadline_ts=deadline)
    resumed_at = time.perf_counter()
    stages = {kinds: round(ms, 2) for op, kinds, ms in coordinator.fan_outs if op == "prepare"}
    counts = {name: reply["report"]["counts"] for name, reply in prepared.replies().items()}
    return {"prepare": 1000 * (prepared_at - began), "commit": 1000 * (committed_at - prepared_at),
            "resume": 1000 * (resumed_at - committed_at), "stages": stages, "before": before, "status_ms": status_ms,
            "counts_when_ready": counts,
            "records": {name: m["record_count"] for name, m in committed.manifests().items()}}


def _summarise_level(level: int, samples: list[Result], load: _InFlight, window: tuple[float, float]) -> Result:
    def p50_of(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
        keys = {(name, key) for row in rows for name, values in row.items() for key in values}
        out: dict[str, dict[str, float]] = {}
        for name, key in sorted(keys):
            out.setdefault(name, {})[key] = statistics.median(row.get(name, {}).get(key, 0) for row in rows)
        return out

    stage_names = list(samples[0]["stages"]) if samples else []
    latencies = [latency for ended, latency in load.ends if window[0] <= ended < window[1]]
    elapsed_s = window[1] - window[0]
    return {
        "in_flight": level,
        "checkpoints": len(samples),
        **{op: quantiles_ms([s[op] for s in samples]) for op in ("prepare", "commit", "resume")},
        "forget_before_each": {**quantiles_ms([s["forget"] for s in samples]),
                               "rollouts_p50": statistics.median(s["forgotten"] for s in samples)},
        "prepare_stage_p50_ms": {stage: round(statistics.median(s["stages"].get(stage, 0.0) for s in samples), 2)
                                 for stage in stage_names},
        "prepare_stage_max_ms": {stage: round(max(s["stages"].get(stage, 0.0) for s in samples), 2)
                                 for stage in stage_names},
        "status_call_p50_ms": {name: round(statistics.median(s["status_ms"][name] for s in samples), 2)
                               for name in (samples[0]["status_ms"] if samples else {})},
        "status_call_max_ms": {name: round(max(s["status_ms"][name] for s in samples), 2)
                               for name in (samples[0]["status_ms"] if samples else {})},
        "status_before_prepare_p50": p50_of([s["before"] for s in samples]),
        "counts_when_ready_p50": p50_of([s["counts_when_ready"] for s in samples]),
        "records_committed_p50": {name: statistics.median(s["records"][name] for s in samples)
                                  for name in (samples[0]["records"] if samples else {})},
        "rollouts_finished": len(latencies),
        "rollouts_per_s": round(len(latencies) / elapsed_s, 2) if elapsed_s > 0 else 0.0,
        "rollout_p50_ms": round(1000 * percentile(latencies, 0.5), 1),
        "rollout_p99_ms": round(1000 * percentile(latencies, 0.99), 1),
        "failed": len(load.failures),
        **({"first_failure": load.failures[0]} if load.failures else {}),
        "loadavg": loadavg(),
    }


async def _levels(
    launcher: MeshLauncher, root: Path, levels: Sequence[int], checkpoints: int, gap_s: float
) -> list[Result]:
    urls = mesh_urls(launcher.mesh)
    tasks = task_rows(launcher.mesh)
    watched = {"environment": urls.environment, "model": urls.policy, "agent": urls.agent, "resources": urls.resources}
    rows = []
    async with MeshClient(max_connections=2 * max(*levels, 16)) as client:
        coordinator = _TimedCoordinator(launcher.head_url, TOKEN, client=client)
        await coordinator.discover()
        for level in levels:
            load = _InFlight(client, urls.environment, tasks, level, f"l{level}")
            load.start()
            try:
                async with asyncio.timeout(IN_FLIGHT_WAIT_S):
                    await load.warm.wait()
                began = time.perf_counter()
                samples = []
                for n in range(checkpoints):
                    await asyncio.sleep(gap_s)
                    finished, load.finished = load.finished, []
                    forget_ms = await coordinator.forget_finished(finished)
                    sample = await _one_checkpoint(coordinator, client, watched, root, f"l{level}-c{n}")
                    samples.append({**sample, "forget": forget_ms, "forgotten": len(finished)})
                window = (began, time.perf_counter())
            finally:
                await load.stop()
            rows.append(_summarise_level(level, samples, load, window))
    return rows


def prepare_latency(
    *, levels: Sequence[int] = LEVELS, checkpoints: int = 10, gap_s: float = 0.5, quick: bool = False
) -> Result:
    """Prepare, commit and resume latency with each level of rollouts in flight (quickstart mesh)."""
    if quick:
        levels, checkpoints, gap_s = QUICK_LEVELS, 2, 0.2
    with checkpoint_root("ngc-bench-prepare-") as root, launched_mesh(enabled_overrides(root)) as launcher:
        load_at_start = loadavg()
        rows = asyncio.run(_levels(launcher, root, levels, checkpoints, gap_s))
    return {"config": "configs/quickstart.yaml", "checkpoints_per_level": checkpoints, "gap_s": gap_s,
            "cpus": os.cpu_count(), "loadavg_at_start": load_at_start, "levels": rows}


# ---- enabled but idle against off ---------------------------------------------------------------------


async def _batch(client: MeshClient, url: str, tasks: list[dict[str, Any]], concurrency: int, label: str) -> Result:
    """Run every row of ``tasks`` with at most ``concurrency`` in flight; rate and failures."""
    queue = list(enumerate(tasks))
    queue.reverse()
    latencies: list[float] = []
    failures: list[str] = []

    async def worker() -> None:
        while queue:
            index, task = queue.pop()
            started = time.perf_counter()
            try:
                await client.post_json(f"{url}/run", task, identity=RolloutIdentity(f"{label}-{index}"),
                                       timeout_s=CALL_TIMEOUT_S)
            except GymError as error:
                failures.append(f"{error.code}: {error.detail}")
            else:
                latencies.append(time.perf_counter() - started)

    began = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(worker())
    elapsed = time.perf_counter() - began
    return {"rollouts": len(latencies), "elapsed_s": elapsed, "rate": len(latencies) / elapsed,
            "failed": len(failures), **({"first_failure": failures[0]} if failures else {})}


def _ratio_stats(values: list[float]) -> Result:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4), "values": [round(v, 4) for v in values]}


async def _overhead_rounds(
    launchers: dict[str, MeshLauncher], rounds: int, batch: int, concurrency: int
) -> Result:
    urls = {name: mesh_urls(launcher.mesh).environment for name, launcher in launchers.items()}
    rows = task_rows(launchers["on"].mesh)
    tasks = [rows[n % len(rows)] for n in range(batch)]
    meters = {name: CpuMeter(launcher.pids) for name, launcher in launchers.items()}
    cpu: dict[str, list[Result]] = {name: [] for name in launchers}
    rates: dict[str, list[float]] = {name: [] for name in launchers}
    pooled: dict[str, list[float]] = {name: [0.0, 0.0] for name in launchers}  # rollouts, seconds
    failed = 0
    async with MeshClient(max_connections=4 * concurrency) as client:
        coordinator = _TimedCoordinator(launchers["on"].head_url, TOKEN, client=client)
        for name, url in urls.items():  # warm-up: connections, first-call paths, the worker's prefix pool
            await _batch(client, url, tasks[: max(concurrency, batch // 2)], concurrency, f"warm-{name}")
        for round_ in range(rounds):
            order = MESHES[round_ % 3:] + MESHES[: round_ % 3]
            if round_ % 2:
                order = tuple(reversed(order))
            for name in order:
                meters[name].start()
                point = await _batch(client, urls[name], tasks, concurrency, f"r{round_}-{name}")
                if name == "on":  # what the collector does with finished rollouts: CPU counted, not time
                    await coordinator.forget_finished([f"r{round_}-{name}-{n}" for n in range(batch)])
                usage = meters[name].stop()
                failed += point["failed"]
                rates[name].append(point["rate"])
                pooled[name][0] += point["rollouts"]
                pooled[name][1] += point["elapsed_s"]
                count = max(point["rollouts"], 1)
                cpu[name].append({proc: 1000 * s / count for proc, s in usage["cpu_s"].items()})
    on_over_off = [on / ((a + b) / 2) for on, a, b in zip(rates["on"], rates["off_a"], rates["off_b"], strict=True)]
    off_over_off = [b / a for a, b in zip(rates["off_a"], rates["off_b"], strict=True)]
    totals = {name: [sum(row.values()) for row in rows_] for name, rows_ in cpu.items()}
    cpu_on_over_off = [on / ((a + b) / 2) for on, a, b in zip(totals["on"], totals["off_a"], totals["off_b"],
                                                              strict=True)]
    cpu_off_over_off = [b / a for a, b in zip(totals["off_a"], totals["off_b"], strict=True)]
    # the participants alone: the worker (most of the CPU, and most of its noise) runs no checkpoint code
    servers = {name: [sum(v for proc, v in row.items() if proc not in NOT_PARTICIPANTS) for row in rows_]
               for name, rows_ in cpu.items()}
    part_on_over_off = [on / ((a + b) / 2) for on, a, b in zip(servers["on"], servers["off_a"], servers["off_b"],
                                                               strict=True)]
    part_off_over_off = [b / a for a, b in zip(servers["off_a"], servers["off_b"], strict=True)]
    cpu_p50 = {name: {proc: round(statistics.median(row[proc] for row in rows_), 2) for proc in rows_[0]}
               for name, rows_ in cpu.items()}
    return {
        "on_over_off": _ratio_stats(on_over_off),
        "off_b_over_off_a": _ratio_stats(off_over_off),
        "cpu_per_rollout_on_over_off": _ratio_stats(cpu_on_over_off),
        "cpu_per_rollout_off_b_over_off_a": _ratio_stats(cpu_off_over_off),
        "pooled_rollouts_per_s": {name: round(n / max(t, 1e-9), 2) for name, (n, t) in pooled.items()},
        "participants_cpu_per_rollout_on_over_off": _ratio_stats(part_on_over_off),
        "participants_cpu_per_rollout_off_b_over_off_a": _ratio_stats(part_off_over_off),
        "participants_cpu_ms_per_rollout_mean": {name: round(statistics.fmean(values), 2)
                                                 for name, values in servers.items()},
        "rollouts_per_s_p50": {name: round(statistics.median(values), 2) for name, values in rates.items()},
        "cpu_ms_per_rollout_p50": cpu_p50,
        "cpu_ms_per_rollout_total_p50": {name: round(sum(v for k, v in procs.items()), 1)
                                         for name, procs in cpu_p50.items()},
        "failed": failed,
    }


def checkpoint_overhead(*, rounds: int = 18, batch: int = 48, concurrency: int = 8, quick: bool = False) -> Result:
    """Rollouts/s with checkpointing enabled but idle over the same mesh with it off, interleaved."""
    if quick:
        rounds, batch, concurrency = 2, 8, 4
    with checkpoint_root("ngc-bench-overhead-") as directory, launched_meshes(
        {name: enabled_overrides(directory) if name == "on" else [] for name in MESHES}
    ) as launchers:
        load_at_start = loadavg()
        result = asyncio.run(_overhead_rounds(launchers, rounds, batch, concurrency))
    return {"config": "configs/quickstart.yaml", "rounds": rounds, "batch": batch, "concurrency": concurrency,
            "cpus": os.cpu_count(), "loadavg_at_start": load_at_start, "loadavg_at_end": loadavg(), **result}
