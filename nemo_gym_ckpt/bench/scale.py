"""The ``scale`` suite of ``nemo-gym-ckpt bench``: checkpoints with thousands of rollouts in flight.

One quickstart mesh with checkpointing on. At each level (256, 1,024, 2,048, 4,096 and 10,000
rollouts in flight) a closed-loop driver keeps that many ``/run`` calls going: one asyncio loop in
this process, one task per rollout slot, a rollout that ends replaced at once, a refusal up front
(429 ``capacity_exceeded``) sent again after its ``Retry-After``. The driver's own CPU is reported
(``driver`` in ``cpu_ms_per_rollout``) to show it is not the bottleneck. The coordinator has its own
connection pool and its own event loop, in a thread of its own (``_ControlThread``; since stop 42),
so no control call waits behind the driver's rollouts or for a turn of the driver's loop.

Once the environment holds its rollouts (or 60 s passed) and 10 s more went by (the burst of starts
over), ``pairs`` pairs of checkpoints are taken,
each a **full** one (``incremental: false``) and, ``gap_s`` later, an **incremental** one whose base
is that full one: full against incremental side by side, under the same load. Per checkpoint: the
pause (prepare to resume) and its parts, and the bytes written (files of its directory that are no
hard link of a file of an earlier checkpoint). Before each checkpoint the rollouts finished since
the last one are forgotten, as the collector does. Per level: the fsync'd sequential write floor of
the full checkpoint's size (the median of ``FLOOR_SAMPLES`` writes), measured in the same run right
after the mesh is stopped (quiet), and again while the level's rollouts still run (loaded: no
checkpoint open, the write in a thread of the driver's process), and each participant's full
commit written through the store by all at once with nothing else running (``floors.py``,
``writes_at_once``: what the writes reach with the cores to themselves), and the commit's write
speed over each; rollouts/s and CPU ms per rollout of every process;
the peak memory (``VmHWM``) of every server; the worker's generation-hold counts
(``generation_hold``: holds, releases, expiries, milliseconds held). With ``phase_cpu`` each pause
also reads the CPU of every process after each of its phases (``PhaseCpu``), and each level reports
the median split (``pause_cpu_ms_p50``): which process worked, and whether the two cores were busy.

Then every server gets SIGKILL, fresh processes restore from the last full checkpoint (timed; not at
2,048, the level kept for the commit's write speed, nor in ``quick`` form: process starts take a
minute here), get SIGKILL again, and fresh processes restore from the last incremental one (timed):
restore time, full against incremental. Those processes (resumed, the restored attempts forgotten)
carry the next level.
At the last level, the restore from the incremental checkpoint is the crash test: every rollout that
had started either finished before the crash or is dispatched again (its next attempt, continuing
where the restore put it, or afresh when nothing was checkpointed for it), and each must finish
exactly once; a rollout refused up front never started and is counted apart.

``variants`` is the hook for comparing mesh shapes in the same run (``{"1 worker": [...overrides]}``;
servers with several workers add ``"2 workers"``): each variant's CPU per rollout and rollouts/s at
``variant_level`` in flight.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from nemo_gym_ckpt.bench.checkpoints import TOKEN, enabled_overrides
from nemo_gym_ckpt.bench.floors import median_floor, median_writes_at_once
from nemo_gym_ckpt.bench.mesh import (
    CALL_TIMEOUT_S,
    MESH_READY_S,
    CpuMeter,
    PhaseCpu,
    checkpoint_root,
    launched_mesh,
    loadavg,
    mesh_urls,
    task_rows,
)
from nemo_gym_ckpt.bench.stats import quantiles_ms, significant
from nemo_gym_ckpt.checkpoint.collector_pause import PROCESS_COLLECTOR
from nemo_gym_ckpt.checkpoint.collector_schedule import PROCESS_FULL_COLLECTIONS
from nemo_gym_ckpt.checkpoint.coordinator import Coordinator, Outcome, ParticipantRef
from nemo_gym_ckpt.checkpoint.hold_wire import HOLD_ROUTE
from nemo_gym_ckpt.checkpoint.router import CONTROL_PREFIX
from nemo_gym_ckpt.client import EncodedJson, MeshClient
from nemo_gym_ckpt.config import DEFAULT_FULL_COLLECTION_INTERVAL_SECONDS
from nemo_gym_ckpt.errors import GymError, Overloaded
from nemo_gym_ckpt.identity import RolloutIdentity, parse_capture_key
from nemo_gym_ckpt.launch.launcher import MeshLauncher

__all__ = [
    "LEVELS",
    "PAIRS",
    "QUICK_LEVELS",
    "WORKER_VARIANTS",
    "plot_scale",
    "scale",
]

Result = dict[str, Any]
T = TypeVar("T")
LEVELS = (256, 1024, 2048, 4096, 10_000)
PAIRS = 5
"""Pairs of checkpoints per level: the medians the issue's acceptance reads are over 5 full (and 5
incremental) checkpoints; with 3 the median was one checkpoint, and the pause ratio moved between runs
by more than its margin (docs/benchmarks.md, stop 40)."""
QUICK_LEVELS = (6,)
QUICK_GAP_S = 0.5
"""The gap between checkpoints in ``quick`` form (the smoke test's: 6 rollouts move on within it)."""
DEADLINE_S = 300.0
WARM_S = 60.0
SETTLE_S = 10.0
"""Once the environment holds its rollouts, the level runs this long before its first checkpoint: the
burst of starts is over, and the checkpoints see the level's steady state (not in ``quick`` form)."""
FINISH_S = 1200.0
OVERRIDES = ["single_agent_turn.environment_servers.single_agent_turn.overload_retry_after_s=10",
             "policy_model.responses_api_models.policy_model.hold_generation_in_checkpoints=true"]
"""Past the environment's capacity, a refused slot asks again every 10 s (not every second); the worker
takes no decode step while a checkpoint is open (docs/benchmarks.md, "The generation hold")."""
FAILED_SLOT_PAUSE_S = 1.0
"""A slot whose rollout failed waits this long before its next one: a failure that comes back at once
must not spin the driver's loop (its checkpoints and every other slot wait for that loop)."""
KEPT_FAILURES = 100
"""Failures kept as text (the first ones); all of them are counted."""
PHASES = ("prepare", "commit", "resume")
"""The phases of a pause, in order (``phase_cpu``: the CPU of each process in each)."""
CONTROL_SWITCH_S = 0.001
"""The interpreter's switch interval in this process while the suite runs (5 ms by default): the
coordinator's thread gets the interpreter's lock within this long of asking for it while the driver's
thread is busy."""
_SAMPLE_KEYS = ("id", "started_at", "pause_ms", "prepare_ms", "commit_ms", "bytes_written", "calls_ms",
                "longest_write")
"""What each checkpoint of a level reports in the row's ``checkpoints``, in the order taken."""


@dataclass
class _Driver:
    """``level`` rollout slots in one loop; each slot runs rollouts back to back (or ``fixed`` ones once)."""

    client: MeshClient
    url: str
    tasks: list[dict[str, Any]]
    label: str
    level: int
    fixed: list[RolloutIdentity] | None = None
    stopping: bool = False
    finished: Counter[str] = field(default_factory=Counter)
    finished_at: dict[str, float] = field(default_factory=dict)
    ends: list[float] = field(default_factory=list)
    in_flight: dict[str, RolloutIdentity] = field(default_factory=dict)
    waiting: set[str] = field(default_factory=set)  # refused up front, waiting to be sent again
    refusals: int = 0
    failures: list[str] = field(default_factory=list)  # the first KEPT_FAILURES, as text
    failed: int = 0
    lost: list[RolloutIdentity] = field(default_factory=list)  # in flight when the mesh was killed
    _workers: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        count = len(self.fixed) if self.fixed is not None else self.level
        self._workers = [asyncio.create_task(self._slot(n)) for n in range(count)]

    async def join(self, timeout_s: float) -> None:
        if self._workers:
            await asyncio.wait(self._workers, timeout=timeout_s)
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)

    def task_of(self, rollout_id: str) -> dict[str, Any]:
        return self.tasks[hash(rollout_id) % len(self.tasks)]

    async def _slot(self, slot: int) -> None:
        if self.fixed is not None:
            await self._one(self.fixed[slot])
            return
        n = 0
        while not self.stopping:
            if not await self._one(RolloutIdentity(f"{self.label}-{slot}-{n}")):
                await asyncio.sleep(FAILED_SLOT_PAUSE_S)
            n += 1

    async def _one(self, identity: RolloutIdentity) -> bool:
        """Run one rollout until it finishes (True) or fails or is lost to a kill (False)."""
        key = identity.rollout_id
        while True:
            self.in_flight[key] = identity
            try:
                await self.client.post_json(f"{self.url}/run", self.task_of(key), identity=identity,
                                            timeout_s=CALL_TIMEOUT_S)
            except Overloaded as refused:
                self.in_flight.pop(key, None)
                self.refusals += 1
                if self.stopping:
                    return False
                self.waiting.add(key)
                await asyncio.sleep(refused.retry_after_s)
                self.waiting.discard(key)
                continue
            except GymError as error:
                self.in_flight.pop(key, None)
                if self.stopping:
                    self.lost.append(identity)
                else:
                    self.failed += 1
                    if len(self.failures) < KEPT_FAILURES:
                        self.failures.append(f"{key}: {error.code}: {error.detail}"[:300])
                return False
            self.in_flight.pop(key, None)
            self.finished[key] += 1
            self.finished_at[key] = time.perf_counter()
            self.ends.append(time.perf_counter())
            return True


def _written_bytes(directory: Path, seen: set[tuple[int, int]]) -> dict[str, int]:
    """Bytes per participant of the files under ``directory`` not seen before (not hard links of
    an earlier checkpoint's files); adds them to ``seen``."""
    written: dict[str, int] = {}
    for path in sorted(directory.rglob("*")):
        if not path.is_file():
            continue
        stat = path.stat()
        participant = path.parent.name
        inode = (stat.st_dev, stat.st_ino)
        if inode not in seen:
            seen.add(inode)
            written[participant] = written.get(participant, 0) + stat.st_size
    return written


def _write_speed(writes: dict[str, Any]) -> float:
    """MB/s of the participants' own writes of one commit, run side by side: their bytes over the
    longest write (first byte to the manifest's link and the directory's fsync, in each one's thread)."""
    longest_ms = max((write["write_ms"] for write in writes.values()), default=0.0)
    return sum(write["bytes"] for write in writes.values()) / max(longest_ms, 1e-6) / 1e3


def _longest_write(writes: dict[str, Any]) -> dict[str, Any]:
    """The participant whose write the commit's write speed was read over: its name, ms, CPU ms, the ms
    in its fsyncs, bytes."""
    if not writes:
        return {}
    name = max(writes, key=lambda participant: writes[participant]["write_ms"])
    return {"participant": name, **{key: writes[name][key] for key in ("write_ms", "write_cpu_ms", "sync_ms",
                                                                       "bytes")}}


def _no_mark() -> None:
    return None


def _phase_cpu_p50(samples: list[Result]) -> Result:
    """Per phase of the pause: each process's CPU ms (p50 over checkpoints), their sum, and the busy
    cores (the sum over the phase's wall time; 2 here means both cores worked for the pause)."""
    result: Result = {}
    for phase in PHASES:
        per = [s["cpu_ms"][phase] for s in samples]
        totals = [sum(p.values()) for p in per]
        walls = [s[f"{phase}_ms"] for s in samples]
        result[phase] = {
            **{name: round(statistics.median(p.get(name, 0.0) for p in per), 1) for name in per[0]},
            "total": round(statistics.median(totals), 1),
            "busy_cores": round(statistics.median(t / max(w, 1e-6) for t, w in zip(totals, walls, strict=True)), 2),
        }
    result["marks_ms"] = round(statistics.median(s["cpu_ms"]["marks_ms"] for s in samples), 2)
    return result


def _per_participant_p50(samples: list[Result], key: str) -> dict[str, float]:
    """The median of one ``last_commit`` figure, per participant, over checkpoints."""
    names = {name for sample in samples for name in sample["writes"]}
    return {name: round(statistics.median(s["writes"][name][key] for s in samples if name in s["writes"]), 1)
            for name in sorted(names)}


def _floor_size(samples: list[Result]) -> int:
    """The size the floor is measured at: the median bytes of the level's full checkpoints."""
    return int(statistics.median(s["bytes_written"] for s in samples if not s["incremental"]))


def _peak_memory_mb(pids: dict[str, int]) -> dict[str, float]:
    peaks = {}
    for name, pid in pids.items():
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peaks[name] = round(int(line.split()[1]) / 1024, 1)
        except OSError:
            continue
    return peaks


class _ControlThread:
    """The coordinator's event loop, in a thread of its own: a checkpoint's control calls never wait
    for a turn of the driver's loop, as a trainer's controller does not run in its rollout collector's
    loop. At 10,000 in flight the driver's thousands of refused slots asking again held its loop for
    100-1,900 ms at a time, and a prepare that its participants served in 5 ms took seconds to come
    back (docs/benchmarks.md, stop 42)."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-control", daemon=True)
        self._thread.start()

    async def run(self, call: Coroutine[Any, Any, T]) -> T:
        """``call`` run on the control loop; its result here (cancelled there if this is)."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call, self._loop))

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10.0)
        if not self._thread.is_alive():
            self._loop.close()


class _TimedCoordinator(Coordinator):
    """A coordinator (with its own pool) that times each participant's reply to each call."""

    def __init__(self, head_url: str) -> None:
        super().__init__(head_url, TOKEN, required_kinds=("model",))
        self.calls: list[tuple[str, str, float]] = []

    async def _call(self, participant: ParticipantRef, op: str, body: EncodedJson, deadline_ts: float) -> Outcome:
        began = time.perf_counter()
        try:
            return await super()._call(participant, op, body, deadline_ts)
        finally:
            self.calls.append((op, participant.kind, 1000 * (time.perf_counter() - began)))


class _Bench:
    def __init__(
        self, launcher: MeshLauncher, root: Path, pairs: int, gap_s: float, quick: bool = False,
        phase_cpu: bool = False,
    ) -> None:
        self.launcher, self.root, self.pairs, self.gap_s, self.quick = launcher, root, pairs, gap_s, quick
        self.phase_cpu = phase_cpu
        self.urls = mesh_urls(launcher.mesh)
        self.tasks = task_rows(launcher.mesh)
        self.seen: set[tuple[int, int]] = set()
        self.control = _ControlThread()  # the level's checkpoints (and forgets) run there

    def coordinator(self) -> _TimedCoordinator:
        return _TimedCoordinator(self.launcher.head_url)

    async def episodes_live(self, client: MeshClient) -> int:
        status = await client.get_json(f"{self.urls.environment}{CONTROL_PREFIX}/status", rollout_prefix=False,
                                       headers={"authorization": f"Bearer {TOKEN}"})
        return int(status.get("extras", {}).get("episodes", 0))

    async def generation_hold(self, client: MeshClient) -> Result:
        """The worker's hold counts (``hold_generation_in_checkpoints``; all zero when it is off)."""
        status: Result = await client.get_json(f"{self.urls.worker}{HOLD_ROUTE}", rollout_prefix=False,
                                               headers={"authorization": f"Bearer {TOKEN}"})
        return status

    async def checkpoint(
        self, coordinator: _TimedCoordinator, cid: str, incremental: bool, in_flight: list[RolloutIdentity]
    ) -> Result:
        """Prepare, commit (the rollouts in flight, less restarts: the collector's scope), resume."""
        deadline = time.time() + DEADLINE_S
        directory = self.root / cid
        coordinator.calls.clear()
        cpu = PhaseCpu(self.launcher.pids) if self.phase_cpu else None
        mark = cpu.mark if cpu is not None else _no_mark
        PROCESS_COLLECTOR.hold(self)  # the driver's own full collections (4,096 tasks) stay out of the pause
        mark()
        began, started_at = time.perf_counter(), time.time()
        try:
            prepared = await coordinator.prepare(cid, deadline_ts=deadline)
            prepared_at = time.perf_counter()
            mark()
            if not prepared.prepared:
                raise RuntimeError(f"{cid} was not prepared by its deadline")
            committed = await coordinator.commit(cid, deadline_ts=deadline, checkpoint_dir=str(directory),
                                                 episode_ids=prepared.continued(in_flight), incremental=incremental)
            committed_at = time.perf_counter()
            mark()
        finally:
            await coordinator.resume(cid, deadline_ts=time.time() + DEADLINE_S)
            PROCESS_COLLECTOR.release(self)
        resumed_at = time.perf_counter()
        mark()
        written = _written_bytes(directory, self.seen)
        writes = {name: status["last_commit"] for name, status in (await coordinator.status()).items()
                  if (status.get("last_commit") or {}).get("checkpoint_id") == cid}
        return {"id": cid, "started_at": started_at, "incremental": incremental, "directory": directory,
                "writes": writes, "write_mb_s": _write_speed(writes), "longest_write": _longest_write(writes),
                "episodes": [parse_capture_key(key) for key in committed.episode_ids()],
                "committed_at": committed_at,
                "pause_ms": 1000 * (resumed_at - began), "prepare_ms": 1000 * (prepared_at - began),
                "commit_ms": 1000 * (committed_at - prepared_at), "resume_ms": 1000 * (resumed_at - committed_at),
                "bytes_written": sum(written.values()), "bytes_by_participant": written,
                "records": {name: m["record_count"] for name, m in committed.manifests().items()},
                "calls_ms": {f"{op}.{kind}": round(ms, 1) for op, kind, ms in coordinator.calls},
                **({"cpu_ms": cpu.phases(PHASES)} if cpu is not None else {})}

    async def level(self, level: int, final: bool) -> Result:
        load_at_start = loadavg()
        async with MeshClient(max_connections=level + 64) as client:
            driver = _Driver(client, self.urls.environment, self.tasks, f"l{level}", level)
            coordinator = self.coordinator()
            meter = CpuMeter(self.launcher.pids)
            driver.start()
            warm_until = time.monotonic() + WARM_S
            target = min(level, 4096) * 0.9
            while time.monotonic() < warm_until and (await self.episodes_live(client)) < target:
                await asyncio.sleep(0.5)
            await asyncio.sleep(min(2.0, self.gap_s * 2) if self.quick else SETTLE_S)
            meter.start()
            window_began = time.perf_counter()
            samples: list[Result] = []
            forgotten = 0
            done: set[str] = set()
            for pair in range(self.pairs):
                for incremental in (False, True):
                    await asyncio.sleep(self.gap_s)
                    finished = [key for key in driver.finished if key not in done]
                    if finished:  # what the collector does with finished rollouts
                        await self.control.run(coordinator.forget(finished, deadline_ts=time.time() + DEADLINE_S))
                        forgotten += len(finished)
                        done.update(finished)
                    kind = "incr" if incremental else "full"
                    in_flight = list(driver.in_flight.values())
                    samples.append(await self.control.run(
                        self.checkpoint(coordinator, f"l{level}-p{pair}-{kind}", incremental, in_flight)))
            window_s = time.perf_counter() - window_began
            usage = meter.stop()
            # the floor under the load the commits ran under (no checkpoint open), from a thread of
            # this process, as a participant's writer thread writes beside its event loop
            loaded_floor = await asyncio.to_thread(median_floor, self.root, _floor_size(samples))
            finished_in_window = sum(1 for end in driver.ends if end >= window_began)
            peaks = _peak_memory_mb(self.launcher.pids)
            hold = await self.generation_hold(client)
            in_flight_at_kill = dict(driver.in_flight)
            waiting_at_kill = set(driver.waiting)
            finished_before = Counter(driver.finished)
            finished_at = dict(driver.finished_at)
            driver.stopping = True
            await self.control.run(coordinator.aclose())
            self.launcher.kill_all()
            await driver.join(30.0)
        fulls = [s for s in samples if not s["incremental"]]
        incrs = [s for s in samples if s["incremental"]]
        floor = median_floor(self.root, _floor_size(samples))
        at_once = median_writes_at_once(self.root, fulls[-1]["bytes_by_participant"])
        timed_full = level != 2048 and not self.quick
        restore_full = await self.restore(fulls[-1], fulls[-1]["episodes"], keep=False) if timed_full else None
        latest = incrs[-1]
        scope = [e for e in latest["episodes"] if finished_at.get(e.rollout_id, 0.0) <= latest["committed_at"]
                 or e.rollout_id in in_flight_at_kill]
        restore_incr = await self.restore(latest, scope, keep=True)
        row = self.summary(level, samples, (floor, loaded_floor, at_once), restore_full, restore_incr, usage,
                           finished_in_window, window_s, peaks, driver, load_at_start, forgotten)
        row["generation_hold"] = hold
        if final:
            row["crash"] = await self.finish_after_crash(latest, scope, restore_incr, in_flight_at_kill,
                                                         waiting_at_kill, finished_before)
        else:
            await self.forget_all(restore_incr["restored_ids"])
        return row

    async def restore(self, checkpoint: Result, scope: list[RolloutIdentity], *, keep: bool) -> Result:
        """Fresh processes (SIGKILL, restart), restore from ``checkpoint``, resume; timed."""
        if any(self.launcher.returncode(name) is None for name in self.launcher.names):
            self.launcher.kill_all()
        began = time.perf_counter()
        await asyncio.to_thread(self.launcher.restart_all, MESH_READY_S)
        started_s = time.perf_counter() - began
        async with self.coordinator() as coordinator:
            await coordinator.discover()
            cid = f"restore-{checkpoint['id']}"
            began = time.perf_counter()
            restored = await coordinator.restore(cid, deadline_ts=time.time() + DEADLINE_S,
                                                 checkpoint_dir=str(checkpoint["directory"]), episode_ids=scope)
            restore_ms = 1000 * (time.perf_counter() - began)
            await coordinator.resume(cid, deadline_ts=time.time() + DEADLINE_S)
        return {"restore_ms": round(restore_ms, 1), "processes_start_s": round(started_s, 1),
                "scope": len(scope), "continued": restored.continued(), "restarts": restored.restarts(),
                "restored_ids": sorted({e.rollout_id for e in scope}), "kept": keep}

    async def forget_all(self, rollout_ids: list[str]) -> None:
        if rollout_ids:
            async with self.coordinator() as coordinator:
                await coordinator.forget(rollout_ids, deadline_ts=time.time() + DEADLINE_S)

    async def finish_after_crash(
        self, latest: Result, scope: list[RolloutIdentity], restored: Result, in_flight: dict[str, RolloutIdentity],
        waiting: set[str], finished_before: Counter[str],
    ) -> Result:
        """Dispatch every started rollout not finished before the crash once more; each must finish once."""
        continued = {e.rollout_id: e for e in restored["continued"]}
        again = [continued.get(key, RolloutIdentity(key, identity.attempt + 1)) for key, identity in in_flight.items()
                 if key not in finished_before]
        for episode in restored["restarts"]:
            if episode.rollout_id not in in_flight and episode.rollout_id not in finished_before:
                again.append(episode.next_attempt())
        async with MeshClient(max_connections=len(again) + 64) as client:
            driver = _Driver(client, self.urls.environment, self.tasks, "crash", len(again), fixed=again)
            began = time.perf_counter()
            driver.start()
            await driver.join(FINISH_S)
        total = finished_before + driver.finished
        started = set(finished_before) | {e.rollout_id for e in again}
        twice = sorted(key for key in started if total[key] > 1)
        never = sorted(key for key in started if total[key] == 0)
        return {"started_rollouts": len(started), "finished_before_crash": len(finished_before),
                "dispatched_after_restore": len(again), "continued_from_checkpoint": len(continued),
                "finished_after_restore": sum(driver.finished.values()), "finished_twice": len(twice),
                "never_finished": len(never), "failed_after_restore": driver.failed,
                **({"first_failure": driver.failures[0]} if driver.failures else {}),
                "refused_up_front_never_started": len(waiting), "refusals_after_restore": driver.refusals,
                "finish_s": round(time.perf_counter() - began, 1), "checkpoint": latest["id"]}

    def summary(
        self, level: int, samples: list[Result], floors: tuple[float, float, float], restore_full: Result | None,
        restore_incr: Result, usage: Result, finished: int, window_s: float, peaks: dict[str, float], driver: _Driver,
        load_at_start: list[float], forgotten: int,
    ) -> Result:
        def of(kind: bool) -> list[Result]:
            return [s for s in samples if s["incremental"] is kind]

        fulls, incrs = of(False), of(True)
        floor, loaded_floor, at_once = floors  # quiet (the mesh stopped), under the level's load, the writes alone
        write_p50 = statistics.median(s["write_mb_s"] for s in fulls)
        full_bytes = statistics.median(s["bytes_written"] for s in fulls)
        commit_speeds = [s["bytes_written"] / max(s["commit_ms"], 1e-6) / 1e3 for s in fulls]
        count = max(finished, 1)
        per_rollout = {name: round(1000 * seconds / count, 2) for name, seconds in usage["cpu_s"].items()}
        return {
            "in_flight": level,
            **{f"{name}_pause": quantiles_ms([s["pause_ms"] for s in group]) for name, group in
               (("full", fulls), ("incremental", incrs), ("all", samples))},
            **{f"{name}_{part}": quantiles_ms([s[f"{part}_ms"] for s in group]) for name, group in
               (("full", fulls), ("incremental", incrs)) for part in ("prepare", "commit", "resume")},
            "full_bytes_written_p50": int(full_bytes),
            "incremental_bytes_written_p50": int(statistics.median(s["bytes_written"] for s in incrs)),
            "incremental_over_full_bytes": [round(b["bytes_written"] / max(a["bytes_written"], 1), 4)
                                            for a, b in zip(fulls, incrs, strict=True)],
            "full_bytes_by_participant": fulls[-1]["bytes_by_participant"],
            "incremental_bytes_by_participant": incrs[-1]["bytes_by_participant"],
            "records": fulls[-1]["records"],
            "checkpoints": [{key: round(s[key], 1) if isinstance(s[key], float) else s[key] for key in _SAMPLE_KEYS}
                            for s in samples],
            **{f"{name}_calls_p50_ms": {key: round(statistics.median(s["calls_ms"].get(key, 0.0) for s in group), 1)
                                         for key in group[0]["calls_ms"]} for name, group in
               (("full", fulls), ("incremental", incrs))},
            "commit_write_mb_s_full": [round(v, 1) for v in commit_speeds],
            "fsync_floor_mb_s": round(floor, 1),
            "commit_over_floor": significant(statistics.median(commit_speeds) / max(floor, 1e-9)),
            "participant_write_mb_s_full": [round(s["write_mb_s"], 1) for s in fulls],
            "participant_write_over_floor": significant(write_p50 / max(floor, 1e-9)),
            "fsync_floor_loaded_mb_s": round(loaded_floor, 1),
            "participant_write_over_loaded_floor": significant(write_p50 / max(loaded_floor, 1e-9)),
            "writes_at_once_mb_s": round(at_once, 1),
            "participant_write_over_writes_at_once": significant(write_p50 / max(at_once, 1e-9)),
            "participant_write_ms_p50_full": _per_participant_p50(fulls, "write_ms"),
            "participant_write_cpu_ms_p50_full": _per_participant_p50(fulls, "write_cpu_ms"),
            "participant_sync_ms_p50_full": _per_participant_p50(fulls, "sync_ms"),
            "participant_capture_ms_p50_full": _per_participant_p50(fulls, "capture_ms"),
            "participant_open_wait_ms_p50_full": _per_participant_p50(fulls, "open_wait_ms"),
            **({"pause_cpu_ms_p50": _phase_cpu_p50(samples)} if "cpu_ms" in samples[0] else {}),
            "restore_full_ms": restore_full["restore_ms"] if restore_full else None,
            "restore_incremental_ms": restore_incr["restore_ms"],
            "restore_scope": restore_incr["scope"], "processes_start_s": restore_incr["processes_start_s"],
            "rollouts_per_s": round(finished / window_s, 2) if window_s > 0 else 0.0,
            "cpu_ms_per_rollout": per_rollout, "mesh_busy_cores": usage.get("mesh_busy_cores"),
            "machine_busy_cores": usage.get("machine_busy_cores"),
            "peak_memory_mb": peaks, "refusals": driver.refusals, "failed": driver.failed,
            **({"first_failure": driver.failures[0]} if driver.failures else {}),
            "forgotten": forgotten, "loadavg_at_start": load_at_start, "loadavg_at_end": loadavg(),
        }


async def _levels(
    launcher: MeshLauncher, root: Path, levels: Sequence[int], pairs: int, gap_s: float, progress: Path | None,
    quick: bool, phase_cpu: bool = False,
) -> list[Result]:
    bench = _Bench(launcher, root, pairs, gap_s, quick, phase_cpu)
    rows = []
    # the driver's own full collections (its thousands of slots) on the servers' schedule, so that
    # none holds its control calls either
    PROCESS_FULL_COLLECTIONS.start(DEFAULT_FULL_COLLECTION_INTERVAL_SECONDS)
    switch_s = sys.getswitchinterval()
    sys.setswitchinterval(CONTROL_SWITCH_S)
    try:
        for index, level in enumerate(levels):
            rows.append(await bench.level(level, final=index == len(levels) - 1))
            if progress is not None:  # each level as it ends: a long run keeps what it measured
                with progress.open("a") as file:
                    file.write(json.dumps(rows[-1], default=str) + "\n")
    finally:
        sys.setswitchinterval(switch_s)
        bench.control.close()
        PROCESS_FULL_COLLECTIONS.stop()
    return rows


def scale(
    *, levels: Sequence[int] = LEVELS, pairs: int = PAIRS, gap_s: float = 1.0, quick: bool = False,
    variants: dict[str, list[str]] | None = None, progress: Path | None = None, overrides: Sequence[str] = (),
    phase_cpu: bool = False,
) -> Result:
    """Pause, bytes and restore, full against incremental, at each level of rollouts in flight
    (``overrides``: config overrides of the mesh, after the suite's own; ``phase_cpu``: the CPU of
    each process in each phase of each pause, ``pause_cpu_ms_p50``, at the price of two readings of
    ``/proc`` inside each pause, ``marks_ms``)."""
    if quick:
        levels, pairs, gap_s = QUICK_LEVELS, 1, QUICK_GAP_S
    with (checkpoint_root("ngc-bench-scale-") as root,
          launched_mesh([*enabled_overrides(root), *OVERRIDES, *overrides]) as launcher):
        began = loadavg()
        rows = asyncio.run(_levels(launcher, root, levels, pairs, gap_s, progress, quick, phase_cpu))
    return {"config": "configs/quickstart.yaml", "overrides": list(overrides), "pairs_per_level": pairs,
            "gap_s": gap_s, "cpus": os.cpu_count(),
            "loadavg_at_start": began, "loadavg_at_end": loadavg(), "levels": rows,
            "variants": compare_variants(variants or {}, quick=quick)}


WORKER_VARIANTS: dict[str, list[str]] = {
    "1 worker": [],
    "2 workers": ["calculator_tools.resources_servers.calculator_tools.num_workers=2",
                  "simple_agent.responses_api_agents.simple_agent.num_workers=2",
                  "single_agent_turn.environment_servers.single_agent_turn.num_workers=2"],
}
"""The agent, resources and environment servers at 1 and at 2 worker processes (docs/protocol.md section 13)."""


def compare_variants(variants: dict[str, list[str]], *, quick: bool = False) -> Result:
    """CPU per rollout and rollouts/s of each mesh variant (config overrides), one after another."""
    from nemo_gym_ckpt.bench.rollouts import measure_rollouts

    level = 8 if quick else 256
    return {name: measure_rollouts(2.0 if quick else 10.0, overrides, concurrencies=(level,), layers=False)
            for name, overrides in variants.items()}


def plot_scale(result: Result, out: Path) -> list[str]:
    """``scale_pause.png``, ``scale_bytes.png`` and ``scale_restore.png`` (when matplotlib is present)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    rows = result["levels"]
    levels = [row["in_flight"] for row in rows]
    figures = {
        "scale_pause.png": ("checkpoint pause p50 (ms)", [("full", [r["full_pause"]["p50_ms"] for r in rows]),
                                                           ("incremental", [r["incremental_pause"]["p50_ms"]
                                                                            for r in rows])]),
        "scale_bytes.png": ("bytes written per checkpoint", [("full", [r["full_bytes_written_p50"] for r in rows]),
                                                             ("incremental", [r["incremental_bytes_written_p50"]
                                                                              for r in rows])]),
        "scale_restore.png": ("restore (ms)", [("from full", [r["restore_full_ms"] for r in rows]),
                                               ("from incremental", [r["restore_incremental_ms"] for r in rows])]),
    }
    figures["scale_restore.png"] = (figures["scale_restore.png"][0],
                                    [(legend, [v if v is not None else float("nan") for v in values])
                                     for legend, values in figures["scale_restore.png"][1]])
    written = []
    for name, (label, series) in figures.items():
        figure, axis = plt.subplots(figsize=(5, 3.2))
        for legend, values in series:
            axis.plot(levels, values, marker="o", label=legend)
        axis.set_xscale("log")
        axis.set_xlabel("rollouts in flight")
        axis.set_ylabel(label)
        axis.set_title(f"quickstart mesh, {os.cpu_count()} cores")
        axis.legend()
        figure.tight_layout()
        figure.savefig(out / name, dpi=120)
        plt.close(figure)
        written.append(name)
    return written
