"""The ``rollouts`` suite of ``nemo-gym-ckpt bench``: whole rollouts.

``measure_rollouts(duration_s, overrides)`` launches the quickstart mesh once (``MeshLauncher``)
and, at each concurrency (1, 8 and 64), keeps that many rollouts in flight for ``duration_s``:
``POST {environment}/ng-rollout/<id>/run`` with the quickstart's task rows, the call the collector
makes. It reports rollouts/s and p50/p99 latency of the rollouts that ended inside the window, and
where the time went:

- ``cpu_ms_per_rollout``: CPU time of each server process (from ``/proc``) and of this process (the
  driver: client, launcher threads) per rollout, with the machine's busy cores and load average.
  On a 2-core machine CPU is the currency: the shares say which hop costs what;
- ``layers``: the same rollouts replayed one hop down, each layer alone at the same concurrency:
  ``engine`` (the rollout's two generations on an engine inside this process: no HTTP),
  ``worker`` (the two ``/v1/completions`` calls the policy model made, by token ids), ``policy`` (the
  two ``/v1/responses`` calls the agent made), ``tools`` (the tool call), ``session_calls`` (the
  environment's seed, verify and close_session), ``agent`` (one activation and its close) and
  ``environment`` (the rollout);
- ``latency_split_ms``: at concurrency 1, one rollout's latency split into generation, worker HTTP,
  policy-model overhead, tool calls, agent overhead, session calls and environment overhead: rounds
  of one call per layer replaying the same rollout (so every layer sees the same machine load),
  then differences of the layers' medians.

The replayed bodies come from the warm-up's rollouts: the quickstart captures token ids and decodes
greedily, so a replayed call generates what the rollout generated (``replay_identical`` checks).

The checkpoint suites on the same mesh (prepare latency, enabled-but-idle overhead) are in
``checkpoint_bench.py``.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from nemo_gym_ckpt.bench.mesh import (
    CALL_TIMEOUT_S,
    QUICKSTART,
    CpuMeter,
    MeshUrls,
    launched_mesh,
    loadavg,
    mesh_urls,
    task_rows,
)
from nemo_gym_ckpt.bench.stats import percentile
from nemo_gym_ckpt.checkpoint.headers import ACTIVATION_HEADER
from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import PROJECT_ROOT
from nemo_gym_ckpt.errors import GymError
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.launch.launcher import MeshLauncher

__all__ = [
    "CONCURRENCIES",
    "Replay",
    "measure_rollouts",
    "replay_of",
    "window_loop",
]

CONCURRENCIES = (1, 8, 64)
LAYERS = ("engine", "worker", "policy", "tools", "session_calls", "agent", "environment")

Result = dict[str, Any]
Call = Callable[[str], Awaitable[None]]


# ---- closed loop over a measurement window ---------------------------------------------------------


class _Window:
    """What a closed loop records: when calls ended and how long they took, and the failures."""

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency
        self.ends: list[tuple[float, float]] = []
        self.failures: list[str] = []
        self.closed = False
        self.opens = self.closes = 0.0
        self._seen: set[int] = set()
        self.warm = asyncio.Event()

    def ended(self, worker_id: int, started: float, failure: str | None = None) -> None:
        now = time.perf_counter()
        if failure is None:
            self.ends.append((now, now - started))
        else:
            self.failures.append(failure)
        self._seen.add(worker_id)
        if len(self._seen) == self.concurrency:
            self.warm.set()

    async def measure(self, meter: CpuMeter | None, ramp_s: float, duration_s: float) -> Result:
        """Open the window once every worker has ended a call and ``ramp_s`` passed; close it."""
        await asyncio.gather(self.warm.wait(), asyncio.sleep(ramp_s))
        self.opens = time.perf_counter()
        if meter is not None:
            meter.start()
        await asyncio.sleep(duration_s)
        self.closes, self.closed = time.perf_counter(), True
        return {} if meter is None else meter.stop()

    def counted(self) -> list[float]:
        return [latency for end, latency in self.ends if self.opens <= end < self.closes]


async def window_loop(
    call: Call, concurrency: int, duration_s: float, *, ramp_s: float, meter: CpuMeter | None = None
) -> Result:
    """``concurrency`` workers calling back to back; counted: the calls that end inside the window.

    The window opens once every worker has ended a call and ``ramp_s`` has passed (the pipeline
    is full and out of step by then), and lasts ``duration_s``; calls in flight at its end finish
    uncounted. ``meter`` measures the window. A call that fails with a ``GymError`` is counted in
    ``failed`` (the first reason is kept).
    """
    window = _Window(concurrency)

    async def worker(worker_id: int) -> None:
        n = 0
        while not window.closed:
            started = time.perf_counter()
            try:
                await call(f"{concurrency}-{worker_id}-{n}")
            except GymError as error:
                window.ended(worker_id, started, f"{error.code}: {error.detail}")
            else:
                window.ended(worker_id, started)
            n += 1

    async with asyncio.timeout(ramp_s + duration_s + 2 * CALL_TIMEOUT_S), asyncio.TaskGroup() as group:
        for worker_id in range(concurrency):
            group.create_task(worker(worker_id))
        usage = await window.measure(meter, ramp_s, duration_s)
    latencies = window.counted()
    failed = {"failed": len(window.failures), "first_failure": window.failures[0]} if window.failures else {}
    rates = _rates(latencies, window.closes - window.opens)
    return {"concurrency": concurrency, "rollouts": len(latencies), **rates, **failed, **usage}


def _rates(latencies: list[float], duration_s: float) -> Result:
    return {
        "rollouts_per_s": round(len(latencies) / duration_s, 2),
        "p50_ms": round(1000 * percentile(latencies, 0.5), 1),
        "p99_ms": round(1000 * percentile(latencies, 0.99), 1),
    }


# ---- CPU accounting ----------------------------------------------------------------------------------


def _per_rollout(point: Result) -> Result:
    """Add ``cpu_ms_per_rollout`` to a point measured with a ``CpuMeter``."""
    count = max(point["rollouts"], 1)
    per = {name: round(1000 * seconds / count, 2) for name, seconds in point.pop("cpu_s", {}).items()}
    return {**point, "cpu_ms_per_rollout": per, "cpu_ms_per_rollout_total": round(sum(per.values()), 1)}


# ---- what a rollout sent, to send again -------------------------------------------------------------


@dataclass(frozen=True)
class Replay:
    """The calls one finished rollout made on each hop, ready to be made again."""

    task: dict[str, Any]
    response: dict[str, Any]
    policy_bodies: list[dict[str, Any]]
    worker_bodies: list[dict[str, Any]]
    generations: list[list[int]]
    tool_calls: list[tuple[str, dict[str, Any]]]


def _model_call_starts(items: list[dict[str, Any]]) -> list[int]:
    """Indices of the output items that open a model call (a new ``prompt_token_ids``)."""
    starts = []
    for index, item in enumerate(items):
        prompt = item.get("prompt_token_ids")
        if prompt is not None and (index == 0 or items[index - 1].get("prompt_token_ids") != prompt):
            starts.append(index)
    return starts


def replay_of(task: dict[str, Any], row: dict[str, Any], served_model: str) -> Replay:
    """The replayable calls of the rollout ``row`` of ``task`` (its output items carry token ids)."""
    params = task["responses_create_params"]
    items = row["response"]["output"]
    given = params["input"]
    inputs = [{"role": "user", "content": given}] if isinstance(given, str) else list(given)
    rest = {key: value for key, value in params.items() if key != "input"}
    starts = _model_call_starts(items)
    worker = [{"model": served_model, "prompt": items[i]["prompt_token_ids"], "temperature": 0.0,
               "max_tokens": len(items[i]["generation_token_ids"]), "logprobs": 1, "return_token_ids": True,
               "skip_special_tokens": False} for i in starts]
    calls = [item for item in items if item.get("type") == "function_call"]
    tools = [(item["name"], orjson.loads(item["arguments"])) for item in calls]
    return Replay(
        task=task,
        response=row["response"],
        policy_bodies=[{**rest, "input": [*inputs, *items[:i]], "return_token_ids": True} for i in starts],
        worker_bodies=worker,
        generations=[items[i]["generation_token_ids"] for i in starts],
        tool_calls=tools,
    )


# ---- the layers ----------------------------------------------------------------------------------


class _Layers:
    """One rollout's worth of calls at each layer; ``key`` makes rollout ids unique."""

    def __init__(self, client: MeshClient, urls: MeshUrls, tasks: list[dict[str, Any]], replays: list[Replay],
                 label: str) -> None:
        self.client, self.urls, self.tasks, self.replays, self.label = client, urls, tasks, replays, label
        self.engine: Any = None
        self.pinned: Replay | None = None
        self._next = 0

    def _identity(self, layer: str, key: str) -> RolloutIdentity:
        return RolloutIdentity(f"bench-{self.label}-{layer}-{key}")

    def _replay(self) -> Replay:
        """The next replay in turn, or the pinned one (every layer then replays the same rollout)."""
        self._next += 1
        return self.pinned or self.replays[self._next % len(self.replays)]

    async def environment(self, key: str) -> None:
        self._next += 1
        task = self.pinned.task if self.pinned else self.tasks[self._next % len(self.tasks)]
        await self.client.post_json(f"{self.urls.environment}/run", task, identity=self._identity("env", key),
                                    timeout_s=CALL_TIMEOUT_S)

    async def agent(self, key: str) -> None:
        identity, body = self._identity("agent", key), self._replay().task["responses_create_params"]
        await self.client.request("POST", f"{self.urls.agent}/v1/responses", json=body, identity=identity,
                                  headers={ACTIVATION_HEADER: "1"}, timeout_s=CALL_TIMEOUT_S)
        await self.client.request("POST", f"{self.urls.agent}/close", json={}, identity=identity,
                                  idempotent=True)

    async def policy(self, key: str) -> None:
        for body in self._replay().policy_bodies:
            await self.client.post_json(f"{self.urls.policy}/v1/responses", body, timeout_s=CALL_TIMEOUT_S,
                                        rollout_prefix=False)

    async def worker(self, key: str) -> None:
        for body in self._replay().worker_bodies:
            await self.client.post_json(f"{self.urls.worker}/v1/completions", body, timeout_s=CALL_TIMEOUT_S,
                                        rollout_prefix=False)

    async def tools(self, key: str) -> None:
        replay, identity = self._replay(), self._identity("tool", key)
        for name, arguments in replay.tool_calls:
            await self.client.request("POST", f"{self.urls.resources}/{name}", json=arguments,
                                      identity=identity, check=False)

    async def session_calls(self, key: str) -> None:
        """The environment's own resources calls: seed, verify, close_session."""
        replay, identity, base = self._replay(), self._identity("res", key), self.urls.resources
        await self.client.request("POST", f"{base}/seed_session", json=replay.task, identity=identity)
        await self.client.request("POST", f"{base}/verify", json={**replay.task, "response": replay.response},
                                  identity=identity)
        await self.client.request("POST", f"{base}/close_session", json={}, identity=identity,
                                  idempotent=True)

    async def engine_pair(self, key: str) -> None:
        for body in self._replay().worker_bodies:
            await _generate(self.engine, body)


async def _generate(engine: Any, body: dict[str, Any]) -> list[int]:
    from model_servers.inference_worker.engine import GenerationRequest

    request = GenerationRequest(tuple(body["prompt"]), body["max_tokens"], seed=0, temperature=0.0)
    async with aclosing(engine.generate(request)) as steps:
        return [step.token_id async for step in steps]


async def _load_engine(settings: Any) -> Any:
    """The worker's engine in this process (the transformers engine only), started."""
    module = importlib.import_module("model_servers.inference_worker.transformers_engine")
    model_dir = importlib.import_module("model_servers.inference_worker.model_dir")
    path = model_dir.resolve_model_path(settings.model_path)
    engine = await asyncio.to_thread(
        module.TransformersEngine.load, path, max_batch_size=settings.max_batch_size,
        max_model_len=settings.max_model_len, torch_threads=settings.torch_threads,
        kv_cache=settings.kv_cache,
    )
    await engine.start()
    return engine


# ---- the suite ---------------------------------------------------------------------------------------


@dataclass
class _Run:
    launcher: MeshLauncher
    urls: MeshUrls
    tasks: list[dict[str, Any]]
    duration_s: float
    ramp_s: float


async def _warm_up(run: _Run, client: MeshClient) -> list[Replay]:
    """Rollouts at concurrency 8 until the mesh is warm; answers their replays."""
    rows: list[tuple[dict[str, Any], dict[str, Any]]] = []

    async def one(key: str) -> None:
        task = run.tasks[len(rows) % len(run.tasks)]
        row = await client.post_json(f"{run.urls.environment}/run", task,
                                     identity=RolloutIdentity(f"warm-{key}"), timeout_s=CALL_TIMEOUT_S)
        rows.append((task, row))

    await window_loop(one, 8, max(1.0, run.duration_s / 2), ramp_s=0.0)
    replays = [replay_of(task, row, run.urls.served_model) for task, row in rows
               if any("prompt_token_ids" in item for item in row["response"]["output"])]
    if not replays:
        raise RuntimeError("the warm-up rollouts carry no token ids: the mesh must capture them")
    return replays


async def _replay_identical(layers: _Layers, replays: list[Replay]) -> float:
    """The share of replayed worker calls that generate exactly what the rollout generated."""
    same = total = 0
    for replay in replays[:8]:
        for body, generated in zip(replay.worker_bodies, replay.generations, strict=True):
            reply = await layers.client.post_json(f"{layers.urls.worker}/v1/completions", body,
                                                  rollout_prefix=False)
            same += reply["choices"][0].get("token_ids") == generated
            total += 1
    return round(same / max(total, 1), 3)


async def _points(run: _Run, concurrencies: Sequence[int], with_layers: bool) -> Result:
    async with MeshClient(max_connections=4 * max(concurrencies)) as client:
        replays = await _warm_up(run, client)
        layers = _Layers(client, run.urls, run.tasks, replays, "m")
        meter = CpuMeter(run.launcher.pids)
        rollouts = []
        for concurrency in concurrencies:
            layers.label = f"c{concurrency}"
            point = await window_loop(layers.environment, concurrency, run.duration_s, ramp_s=run.ramp_s,
                                      meter=meter)
            rollouts.append(_per_rollout(point))
        result: Result = {"rollouts": rollouts}
        engine = getattr(run.urls.worker_settings, "engine", "transformers")
        if with_layers and engine != "transformers":
            result["layers_skipped"] = f"the engine layer runs the transformers engine only, not {engine}"
        elif with_layers:
            result.update(await _layer_points(run, layers, concurrencies))
            result["replay_identical"] = await _replay_identical(layers, replays)
    return result


async def _layer_points(run: _Run, layers: _Layers, concurrencies: Sequence[int]) -> Result:
    layers.engine = await _load_engine(run.urls.worker_settings)
    calls: dict[str, Call] = {"engine": layers.engine_pair, "worker": layers.worker, "policy": layers.policy,
                              "tools": layers.tools, "session_calls": layers.session_calls,
                              "agent": layers.agent, "environment": layers.environment}
    rows = []
    try:
        split = await _latency_split(layers, calls, run.duration_s)
        for concurrency in concurrencies:
            layers.label = f"l{concurrency}"
            row: Result = {"concurrency": concurrency}
            for name in LAYERS:
                point = await window_loop(calls[name], concurrency, run.duration_s, ramp_s=run.ramp_s)
                row[name] = {key: point[key] for key in ("rollouts_per_s", "p50_ms", "p99_ms", "failed")
                             if key in point}
            rows.append(row)
    finally:
        await layers.engine.aclose()
    return {"latency_split_ms": split, "layers": rows}


async def _latency_split(layers: _Layers, calls: dict[str, Call], duration_s: float) -> Result:
    """One rollout's latency split by layer, at concurrency 1.

    Rounds of one call per layer, all replaying the same rollout, until ``duration_s`` has passed;
    each layer's median, and the differences between adjacent layers.
    """
    samples: dict[str, list[float]] = {name: [] for name in LAYERS}
    stop, rounds = time.perf_counter() + duration_s, 0
    while time.perf_counter() < stop or rounds < 3:
        layers.pinned = layers.replays[rounds % len(layers.replays)]
        for name in LAYERS:
            started = time.perf_counter()
            await calls[name](f"split-{rounds}")
            samples[name].append(1000 * (time.perf_counter() - started))
        rounds += 1
    layers.pinned = None
    return {"rounds": rounds, **_split(_median(samples))}


def _median(samples: dict[str, list[float]]) -> dict[str, float]:
    return {name: percentile(values, 0.5) for name, values in samples.items()}


def _split(p50: dict[str, float]) -> Result:
    parts = {
        "generation": p50["engine"],
        "worker_http": p50["worker"] - p50["engine"],
        "policy_model_overhead": p50["policy"] - p50["worker"],
        "tool_calls": p50["tools"],
        "agent_overhead": p50["agent"] - p50["policy"] - p50["tools"],
        "session_calls": p50["session_calls"],
        "environment_overhead": p50["environment"] - p50["agent"] - p50["session_calls"],
        "rollout": p50["environment"],
    }
    return {name: round(value, 1) for name, value in parts.items()}


def measure_rollouts(
    duration_s: float,
    overrides: Sequence[str] = (),
    *,
    concurrencies: Sequence[int] = CONCURRENCIES,
    layers: bool = True,
    config: Path = QUICKSTART,
) -> Result:
    """Launch the mesh of ``config`` (with ``overrides``) once and measure rollouts at each concurrency."""
    with launched_mesh(overrides, config) as launcher:
        run = _Run(launcher, mesh_urls(launcher.mesh), task_rows(launcher.mesh), duration_s,
                   ramp_s=min(1.0, duration_s / 4))
        began = loadavg()
        result = asyncio.run(_points(run, concurrencies, layers))
    return {"config": _relative(config), "overrides": list(overrides), "cpus": os.cpu_count(),
            "loadavg_at_start": began, **result}


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(PROJECT_ROOT))
    except ValueError:
        return str(path)
