"""Benchmarks of the checkpoint control plane; ``nemo-gym-ckpt bench`` calls ``run_all``.

- ``cycle_latency``: prepare, commit, resume cycles across 5 idle participants, each its own
  uvicorn process on loopback, driven by the ``Coordinator`` through a head server: p50 and p99.
- ``commit_throughput``: one participant commits 10,000 records of 4 KB; its rate against this
  machine's fsync'd sequential write speed measured in the same run (write, fsync, rename, fsync
  of the directory: the floor any durable commit pays), as a ratio.
- ``admission_overhead``: what ``admit`` costs a data-plane request when checkpointing is on and
  idle (the hot path), per call.
- ``session_growth``: multi-turn sessions (each record the whole conversation), a full checkpoint,
  then a share of them one turn longer and an incremental one: the bytes it wrote (patches of the
  sessions that grew, spans for the rest) against the bytes of the grown records written whole.
- ``incremental_chain``: a full commit, then a chain of incremental ones, each after a few records
  changed a little (every checkpoint incremental, as a trainer takes them): the writer's CPU of the
  first and the last of the chain against a full commit's, and the bytes each wrote.
- ``sidecar_copy`` (``sidecar.py``): the policy model's full commit of token lines an earlier commit
  made durable, small against large: its write speed over the floor and its peak memory.

Every figure is measured within the run against its own baseline; each function returns a dict.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from nemo_gym_ckpt.bench.sidecar import sidecar_copy
from nemo_gym_ckpt.bench.stats import quantiles_ms
from nemo_gym_ckpt.checkpoint.coordinator import Coordinator
from nemo_gym_ckpt.checkpoint.models import CommitRequest, ControlRequest
from nemo_gym_ckpt.checkpoint.participant import Participant
from nemo_gym_ckpt.checkpoint.records import Record
from nemo_gym_ckpt.checkpoint.store import CheckpointStore, StopSignal
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.launch.head import ThreadedServer
from nemo_gym_ckpt.launch.launcher import find_free_port, wait_for_health
from nemo_gym_ckpt.testing.minimal import SessionsAdapter, create_head_stub

__all__ = ["admission_overhead", "commit_throughput", "cycle_latency", "incremental_chain", "run_all",
           "session_growth"]

Result = dict[str, Any]
KINDS = ("environment", "model", "agent", "resources", "resources")
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
MB = 1_000_000


def run_all(quick: bool = False) -> Result:
    """Every checkpoint benchmark (smaller sizes with ``quick``)."""
    return {
        "cycle": cycle_latency(cycles=10 if quick else 100),
        "commit_throughput": commit_throughput(records=1_000 if quick else 10_000),
        "admission": admission_overhead(calls=20_000 if quick else 200_000),
        "session_growth": session_growth(sessions=100 if quick else 2_000),
        "incremental_chain": incremental_chain(records=256 if quick else 4_096, commits=4 if quick else 12),
        "sidecar_copy": sidecar_copy(sizes_mb=(2, 8) if quick else (16, 160)),
    }


def percentiles(samples_ms: list[float]) -> Result:
    """p50, p99 and max of the samples, to the microsecond."""
    return {key: value for key, value in quantiles_ms(samples_ms, 3).items() if key != "n"}


# ---- prepare / commit / resume cycles ------------------------------------------------------------


def cycle_latency(
    *, participants: int = 5, cycles: int = 100, warmup: int = 5, root: Path | None = None
) -> Result:
    """Full cycles across ``participants`` idle participant processes on loopback."""
    token = secrets.token_hex(16)
    with _workdir(root) as directory, _participants(participants, directory, token) as urls:
        listing = [
            {"name": f"p{n}", "type": "resources_servers", "implementation": "minimal", "url": url}
            for n, url in enumerate(urls)
        ]
        with ThreadedServer(create_head_stub(listing), name="bench-head") as head:
            samples = asyncio.run(_cycles(head.url, token, cycles + warmup, directory))[warmup:]
    return {
        "participants": participants,
        "cycles": cycles,
        **percentiles([s["cycle"] for s in samples]),
        **{
            f"{op}_p50_ms": percentiles([s[op] for s in samples])["p50_ms"]
            for op in ("prepare", "commit", "resume")
        },
    }


async def _cycles(head_url: str, token: str, count: int, root: Path) -> list[dict[str, float]]:
    samples = []
    async with Coordinator(head_url, token) as coordinator:
        await coordinator.discover()
        for n in range(count):
            cid, deadline = f"bench-{n}", time.time() + 60
            started = time.perf_counter()
            prepared = await coordinator.prepare(cid, deadline_ts=deadline)
            after_prepare = time.perf_counter()
            assert prepared.prepared
            await coordinator.commit(cid, deadline_ts=deadline, checkpoint_dir=str(root / cid))
            after_commit = time.perf_counter()
            await coordinator.resume(cid, deadline_ts=deadline)
            ended = time.perf_counter()
            samples.append(
                {
                    "prepare": (after_prepare - started) * 1000,
                    "commit": (after_commit - after_prepare) * 1000,
                    "resume": (ended - after_commit) * 1000,
                    "cycle": (ended - started) * 1000,
                }
            )
    return samples


@contextmanager
def _participants(count: int, root: Path, token: str) -> Iterator[list[str]]:
    env = {**os.environ, "GYM_CKPT_TOKEN": token}
    ports: list[int] = []
    processes = []
    try:
        for n in range(count):
            ports.append(find_free_port("127.0.0.1", ports))
            command = [
                sys.executable,
                "-m",
                "nemo_gym_ckpt.testing.minimal",
                "--name",
                f"p{n}",
                "--kind",
                KINDS[n % len(KINDS)],
                "--root",
                str(root),
                "--port",
                str(ports[-1]),
            ]
            processes.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL))
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for url in urls:
            wait_for_health(url, timeout_s=START_TIMEOUT_S)
        yield urls
    finally:
        _stop(processes)


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_TIMEOUT_S)


@contextmanager
def _workdir(root: Path | None) -> Iterator[Path]:
    if root is not None:
        yield root
        return
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-", dir=os.environ.get("CKPT_BENCH_DIR")) as path:
        yield Path(path)


# ---- commit throughput against the fsync floor ----------------------------------------------------


def commit_throughput(
    *, records: int = 10_000, record_bytes: int = 4096, repeats: int = 3, root: Path | None = None
) -> Result:
    """A participant's commit of ``records`` records against fsync'd sequential writes, same run."""
    with _workdir(root) as directory:
        adapter = _filled_adapter(records, record_bytes)
        floor, commit = [], []
        for n in range(repeats):
            floor.append(_sequential_write(directory / f"floor-{n}", records * record_bytes))
            commit.append(asyncio.run(_commit_once(adapter, directory, f"throughput-{n}")))
    floor_mb_s = statistics.median(floor)
    commit_mb_s = statistics.median(commit)
    return {
        "records": records,
        "record_bytes": record_bytes,
        "repeats": repeats,
        "fsync_write_mb_s": round(floor_mb_s, 1),
        "commit_mb_s": round(commit_mb_s, 1),
        "commit_records_per_s": round(commit_mb_s * MB / record_bytes),
        "ratio_to_fsync_write": round(commit_mb_s / floor_mb_s, 3),
    }


def session_growth(
    *, sessions: int = 2_000, turns: int = 20, grown_share: float = 0.3, message_bytes: int = 400,
    root: Path | None = None,
) -> Result:
    """Bytes an incremental commit writes when ``grown_share`` of ``sessions`` conversations of
    ``turns`` messages took one more turn since the full one, against those sessions written whole."""
    every = max(1, round(1 / grown_share))
    with _workdir(root) as directory:
        store = CheckpointStore(directory)
        records = [_session_record(n, turns, message_bytes) for n in range(sessions)]
        _commit_records(store, directory / "full", records)
        grown = [_session_record(n, turns + 1, message_bytes) if n % every == 0 else record
                 for n, record in enumerate(records)]
        began = time.perf_counter()
        _commit_records(store, directory / "incremental", grown)
        elapsed = time.perf_counter() - began
        full_bytes = _new_bytes(directory / "full", set())
        written = _new_bytes(directory / "incremental", _inodes(directory / "full"))
    whole = sum(len(record.raw) + 1 for n, record in enumerate(grown) if n % every == 0)
    return {"sessions": sessions, "turns": turns, "grown": len(range(0, sessions, every)),
            "full_bytes": full_bytes, "incremental_bytes": written, "grown_records_whole_bytes": whole,
            "incremental_over_full": round(written / full_bytes, 4),
            "incremental_over_grown_whole": round(written / whole, 4),
            "incremental_commit_ms": round(1000 * elapsed, 1)}


def incremental_chain(
    *, records: int = 4_096, record_bytes: int = 700, changed_share: float = 0.03, commits: int = 12,
    fulls: int = 3, root: Path | None = None,
) -> Result:
    """The writer thread's CPU (write and seal, as a participant's commit runs them) of ``fulls`` full
    commits of ``records`` records, then of a chain of ``commits`` incremental ones, each after
    ``changed_share`` of the records changed a few bytes (chosen by a seeded generator)."""
    chosen = random.Random(15)
    current = [_state_record(n, 0, record_bytes) for n in range(records)]
    with _workdir(root) as directory:
        store = CheckpointStore(directory)
        full = [_timed_commit(store, directory / f"full-{n}", current, incremental=False) for n in range(fulls)]
        chain, earlier = [], _inodes(directory)
        for step in range(1, commits + 1):
            for number in chosen.sample(range(records), max(1, round(changed_share * records))):
                current[number] = _state_record(number, step, record_bytes)
            chain.append(_timed_commit(store, directory / f"chain-{step}", current))
            written = _new_bytes(directory / f"chain-{step}", earlier)
            earlier |= _inodes(directory / f"chain-{step}")
        full_bytes = _new_bytes(directory / "full-0", set())
    full_cpu = statistics.median(full)
    last = statistics.median(chain[-max(1, commits // 3):])
    return {"records": records, "record_bytes": record_bytes, "changed_per_commit": round(changed_share * records),
            "commits": commits, "full_write_cpu_ms": round(full_cpu, 2),
            "first_incremental_write_cpu_ms": round(chain[0], 2), "last_incremental_write_cpu_ms": round(last, 2),
            "first_over_full_cpu": round(chain[0] / full_cpu, 2), "last_over_full_cpu": round(last / full_cpu, 2),
            "full_bytes": full_bytes, "last_incremental_bytes": written}


def _state_record(number: int, version: int, size: int) -> Record:
    return Record.from_data({"episode_id": {"rollout_id": f"r{number:07d}", "attempt": 0},
                             "state": {"version": version, "text": _text(str(number), size)}})


def _timed_commit(
    store: CheckpointStore, directory: Path, records: list[Record], *, incremental: bool = True
) -> float:
    """The writer's CPU ms for one commit (its index made after, out of the timing, as after a pause)."""
    writer = store.open_writer(directory, "environment", "bench", StopSignal(), incremental=incremental)
    began = time.thread_time()
    writer.write_records(records)
    writer.finish("environment", "bench", directory.name)
    elapsed = time.thread_time() - began
    store.settle()
    return 1000 * elapsed


def _session_record(number: int, turns: int, message_bytes: int) -> Record:
    messages = [{"role": "user" if turn % 2 else "assistant", "content": _text(f"{number}.{turn}", message_bytes)}
                for turn in range(turns)]
    return Record.from_data({"episode_id": {"rollout_id": f"s{number:07d}", "attempt": 0},
                             "session": {"messages": messages, "turns": turns}})


def _text(seed: str, size: int) -> str:
    """``size`` characters that depend only on ``seed`` (a turn's text is the same at every commit)."""
    block = hashlib.sha256(seed.encode()).hexdigest()
    return (block * (size // len(block) + 1))[:size]


def _commit_records(store: CheckpointStore, directory: Path, records: list[Record]) -> None:
    writer = store.open_writer(directory, "agent", "bench", StopSignal())
    writer.write_records(records)
    writer.finish("agent", "bench", directory.name)


def _inodes(directory: Path) -> set[tuple[int, int]]:
    return {(path.stat().st_dev, path.stat().st_ino) for path in directory.rglob("*") if path.is_file()}


def _new_bytes(directory: Path, earlier: set[tuple[int, int]]) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*")
               if path.is_file() and (path.stat().st_dev, path.stat().st_ino) not in earlier)


def _filled_adapter(records: int, record_bytes: int) -> SessionsAdapter:
    adapter = SessionsAdapter()
    overhead = len(b'{"episode_id":{"rollout_id":"r0000000","attempt":0},"state":{"pad":""}}\n')
    for n in range(records):
        adapter.put(RolloutIdentity(f"r{n:07d}"), {"pad": "x" * (record_bytes - overhead)})
    return adapter


def _sequential_write(directory: Path, size: int, chunk: int = 1 << 20) -> float:
    """MB/s of writing ``size`` bytes, fsync, rename into place, fsync of the directory."""
    directory.mkdir(parents=True)
    block = os.urandom(chunk)
    started = time.perf_counter()
    fd = os.open(directory / "data.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for offset in range(0, size, chunk):
            os.write(fd, block[: min(chunk, size - offset)])
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(directory / "data.tmp", directory / "data")
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return size / MB / (time.perf_counter() - started)


async def _commit_once(adapter: SessionsAdapter, root: Path, cid: str) -> float:
    participant = Participant(
        kind="environment", instance="bench", adapter=adapter, store=CheckpointStore(root), lease_grace_s=600
    )
    deadline = time.time() + 600
    await participant.prepare(ControlRequest(checkpoint_id=cid, deadline_ts=deadline))
    started = time.perf_counter()
    reply = await participant.commit(
        CommitRequest(checkpoint_id=cid, deadline_ts=deadline, checkpoint_dir=str(root / cid))
    )
    elapsed = time.perf_counter() - started
    await participant.resume(ControlRequest(checkpoint_id=cid, deadline_ts=deadline))
    await participant.aclose()
    records = root / cid / "gym" / "environment" / "bench" / reply["manifest"]["records_file"]
    return records.stat().st_size / MB / elapsed


# ---- the hot path: admission while idle -----------------------------------------------------------


def admission_overhead(*, calls: int = 200_000) -> Result:
    """ns per ``admit`` of an idle participant, against an empty coroutine call (the floor)."""
    return asyncio.run(_admission(calls))


async def _admission(calls: int) -> Result:
    participant = Participant(
        kind="agent",
        instance="bench",
        adapter=SessionsAdapter(),
        store=CheckpointStore(Path(tempfile.gettempdir())),
        lease_grace_s=600,
    )
    identity = RolloutIdentity("r1", 3)

    async def nothing(_: RolloutIdentity) -> None:
        return None

    floor = await _time_calls(nothing, identity, calls)
    admit = await _time_calls(participant.admit, identity, calls)
    admit_ns, floor_ns = round(admit), round(floor)
    return {
        "calls": calls,
        "admit_ns": admit_ns,
        "empty_call_ns": floor_ns,
        "overhead_ns": admit_ns - floor_ns,  # from the rounded figures, so the three always add up
    }


async def _time_calls(call: Any, identity: RolloutIdentity, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        await call(identity)
    return (time.perf_counter() - started) / calls * 1e9
