"""The suites of ``nemo-gym-ckpt bench`` (``nemo_gym_ckpt.cli.bench`` is the command).

Every figure is measured as a rate or a ratio inside one run (ours against a baseline measured
seconds apart on the same machine), never compared with a stored number: these machines are shared
and noisy. Results go to ``<out>/results.json`` and ``<out>/results.md``, and plots to
``<out>/*.png`` when matplotlib is installed.

Suites (``--only`` picks some):

- ``client``: the mesh's real call path (a tool call on a calculator_tools process through
  ``MeshClient`` with the rollout prefix), httpx's own transport against httpx-aiohttp.
- ``worker``: inference-worker tokens/s, one sequence against batches.
- ``policy``: a chat completion through the policy model against the same call made on the worker
  directly.
- ``checkpoint``: the control plane (prepare/commit/resume cycles; commit throughput against the
  fsync floor; ``protocol.py``).
- ``rollouts``: whole quickstart rollouts at concurrency 1, 8 and 64: rollouts/s, p50/p99, CPU per
  rollout of every server process, and each layer (engine, worker, policy model, tools, agent,
  environment) replayed alone (``rollouts.py``).
- ``prepare_latency``: prepare, commit and resume on the quickstart mesh with 0, 32 and 256
  rollouts in flight, and what prepare waited for (``checkpoints.py``).
- ``checkpoint_overhead``: quickstart rollouts/s with checkpointing enabled but idle over the same
  mesh with it off: three meshes kept up (off, on, off), the same batch on each in rotation for
  several rounds; the median per-round ratio, and off over off as the noise floor.
- ``generation_cuts``: the checkpoint pause with 8 and 64 long generations in flight, and the tokens
  generated again after a crash mid-generation, with cuts against without (``cuts.py``).
- ``scale``: pause, commit, bytes written and restore time with 256 to 10,000 rollouts in flight,
  full against incremental checkpoints side by side, and a crash with every rollout finished once
  (``scale.py``; its plots ``scale_*.png``).

``--quick`` (or ``--duration-s`` under 3) runs every suite at its smallest size: the smoke-test form.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from nemo_gym_ckpt.bench import checkpoints, cuts, protocol, rollouts, scale
from nemo_gym_ckpt.bench.stats import percentile
from nemo_gym_ckpt.client import MeshClient, TransportName
from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.launch.launcher import MeshLauncher

__all__ = [
    "SUITES",
    "bench_checkpoint_overhead",
    "bench_generation_cuts",
    "bench_prepare_latency",
    "bench_rollouts",
    "bench_scale",
    "run_closed_loop",
    "run_suites",
]

logger = logging.getLogger(__name__)

Result = dict[str, Any]


async def run_closed_loop(call: Callable[[int], Awaitable[None]], concurrency: int, duration_s: float) -> Result:
    """``concurrency`` workers calling ``call`` back to back for ``duration_s``; rate and latencies."""
    latencies: list[float] = []
    stop_at = time.perf_counter() + duration_s

    async def worker(worker_id: int) -> None:
        n = 0
        while time.perf_counter() < stop_at:
            began = time.perf_counter()
            await call(worker_id * 1_000_000 + n)
            latencies.append(time.perf_counter() - began)
            n += 1

    began = time.perf_counter()
    async with asyncio.timeout(duration_s + 60):
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - began
    return {
        "concurrency": concurrency,
        "requests": len(latencies),
        "rate_per_s": len(latencies) / elapsed,
        "p50_ms": 1000 * percentile(latencies, 0.5),
        "p99_ms": 1000 * percentile(latencies, 0.99),
    }


def _quiet(_: str, __: str) -> None:
    """Drop server log lines during measurements."""


# ---- client transports ---------------------------------------------------------------------------


async def _drive_tool_calls(transport: TransportName, url: str, concurrency: int, duration_s: float) -> Result:
    async with MeshClient(transport=transport, max_connections=max(concurrency, 16)) as client:
        async def call(n: int) -> None:
            await client.post_json(url, {"a": n % 1000, "b": 7}, identity=RolloutIdentity(f"bench-{n}"))

        await run_closed_loop(call, concurrency, min(1.0, duration_s))  # warm-up: connections, JIT paths
        cpu_began = time.process_time()
        result = await run_closed_loop(call, concurrency, duration_s)
        cpu_s = time.process_time() - cpu_began
    # this process is the client alone (the server is a process of its own): its CPU per call
    cpu_us = round(1e6 * cpu_s / max(result["requests"], 1), 1)
    return {"transport": transport, **result, "client_cpu_us_per_call": cpu_us}


def bench_client(duration_s: float) -> Result:
    mesh = load_config_dict({"head_server": {"port": 0}, "calc": {"resources_servers": {"calculator_tools": {}}}})
    rows = []
    with MeshLauncher(mesh, on_line=_quiet) as launcher:
        launcher.start(ready_timeout_s=60)
        url = launcher.url_of("calc") + "/add"
        for concurrency in (1, 16, 64):
            for transport in ("httpx", "aiohttp"):
                rows.append(asyncio.run(_drive_tool_calls(transport, url, concurrency, duration_s)))
    ratios = {
        str(c): _rate(rows, "aiohttp", c) / max(_rate(rows, "httpx", c), 1e-9) for c in (1, 16, 64)
    }
    return {"rows": rows, "aiohttp_over_httpx": ratios}


def _rate(rows: list[Result], transport: str, concurrency: int) -> float:
    return next(r["rate_per_s"] for r in rows if r["transport"] == transport and r["concurrency"] == concurrency)


# ---- inference worker and policy model ------------------------------------------------------------


async def _worker_throughput(kv_cache: bool, new_tokens: int) -> Result:
    from model_servers.inference_worker.model_dir import DEFAULT_MODEL_DIR
    from model_servers.inference_worker.throughput import measure_throughput
    from model_servers.inference_worker.transformers_engine import TransformersEngine

    engine = await asyncio.to_thread(TransformersEngine.load, DEFAULT_MODEL_DIR, kv_cache=kv_cache)
    await engine.start()
    try:
        return dict(await measure_throughput(engine, [1, 8, 32, 64], new_tokens))
    finally:
        await engine.aclose()


def bench_worker(duration_s: float) -> Result:
    new_tokens = 64 if duration_s >= 3 else 32
    runs = {mode: asyncio.run(_worker_throughput(mode == "kv_cache", new_tokens))
            for mode in ("kv_cache", "full_recompute")}
    single = runs["kv_cache"]["results"][0]["tokens_per_s"]
    batched = {str(r["batch_size"]): r["tokens_per_s"] / max(single, 1e-9) for r in runs["kv_cache"]["results"]}
    return {"runs": runs, "batched_over_single_kv_cache": batched}


async def _policy_against_worker(worker_url: str, policy_url: str, model: str, duration_s: float) -> Result:
    """The same greedy generation through the policy model and straight from the worker."""
    chat = {"model": model, "messages": [{"role": "user", "content": "What is 12 times 34?"}],
            "tools": [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
                      for n in ("add", "subtract", "multiply")],
            "temperature": 0, "return_token_ids": True}
    rows = []
    async with MeshClient() as client:
        first = await client.post_json(f"{policy_url}/v1/chat/completions", chat)
        message = first["choices"][0]["message"]
        completion = {"model": model, "prompt": message["prompt_token_ids"], "temperature": 0,
                      "max_tokens": len(message["generation_token_ids"]), "return_token_ids": True}
        for concurrency in (1, 8):
            direct = await run_closed_loop(
                lambda _n: client.post_json(f"{worker_url}/v1/completions", completion), concurrency, duration_s)
            fronted = await run_closed_loop(
                lambda _n: client.post_json(f"{policy_url}/v1/chat/completions", chat), concurrency, duration_s)
            rows.append({"concurrency": concurrency, "worker_direct": direct, "through_policy": fronted,
                         "policy_over_direct_latency": fronted["p50_ms"] / max(direct["p50_ms"], 1e-9),
                         "policy_over_direct_rate": fronted["rate_per_s"] / max(direct["rate_per_s"], 1e-9)})
    return {"prompt_tokens": len(message["prompt_token_ids"]),
            "generated_tokens": len(message["generation_token_ids"]), "rows": rows}


def bench_policy(duration_s: float) -> Result:
    mesh = load_config_dict({
        "head_server": {"port": 0},
        "inference_worker": {"responses_api_models": {"inference_worker": {}}},
        "policy_model": {"responses_api_models": {"policy_model": {
            "worker": {"type": "responses_api_models", "name": "inference_worker"}}}},
    })
    with MeshLauncher(mesh, on_line=_quiet) as launcher:
        launcher.start(ready_timeout_s=120)
        worker = launcher.url_of("inference_worker")
        policy = launcher.url_of("policy_model")
        model = mesh.instance("inference_worker").settings.served_model_name  # type: ignore[attr-defined]
        return asyncio.run(_policy_against_worker(worker, policy, model, duration_s))


def bench_checkpoint(duration_s: float) -> Result:
    return protocol.run_all(quick=duration_s < 3)


def bench_rollouts(duration_s: float, overrides: Sequence[str] = ()) -> Result:
    """The quickstart end to end; ``overrides`` are ``key=value`` config overrides."""
    return rollouts.measure_rollouts(duration_s, overrides)


def bench_prepare_latency(duration_s: float) -> Result:
    return checkpoints.prepare_latency(quick=duration_s < 3)


def bench_checkpoint_overhead(duration_s: float) -> Result:
    return checkpoints.checkpoint_overhead(quick=duration_s < 3)


def bench_generation_cuts(duration_s: float) -> Result:
    return cuts.run_all(quick=duration_s < 3)


def bench_scale(duration_s: float) -> Result:
    quick = duration_s < 3  # the quick form (the e2e tier) leaves out the 1 against 2 workers meshes
    return scale.scale(quick=quick, variants=None if quick else scale.WORKER_VARIANTS)


SUITES: dict[str, Callable[[float], Result]] = {
    "client": bench_client,
    "worker": bench_worker,
    "policy": bench_policy,
    "checkpoint": bench_checkpoint,
    "rollouts": bench_rollouts,
    "prepare_latency": bench_prepare_latency,
    "checkpoint_overhead": bench_checkpoint_overhead,
    "generation_cuts": bench_generation_cuts,
    "scale": bench_scale,
}


# ---- output --------------------------------------------------------------------------------------


def _markdown(results: dict[str, Result]) -> str:
    lines = ["# nemo-gym-ckpt bench", ""]
    for suite, result in results.items():
        lines += [f"## {suite}", "", "```json", json.dumps(result, indent=2, default=str), "```", ""]
    return "\n".join(lines)


def _plot_client(result: Result, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib is not installed: no plots")
        return
    figure, axis = plt.subplots(figsize=(5, 3.2))
    for transport in ("httpx", "aiohttp"):
        rows = [r for r in result["rows"] if r["transport"] == transport]
        axis.plot([r["concurrency"] for r in rows], [r["rate_per_s"] for r in rows], marker="o", label=transport)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("concurrent calls")
    axis.set_ylabel("tool calls / s")
    axis.set_title("MeshClient transport, loopback")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "client_transports.png", dpi=120)
    plt.close(figure)


def run_suites(names: Sequence[str], duration_s: float, out: Path) -> str:
    """Run the named suites one after another, write ``results.json``, ``results.md`` and plots to
    ``out``; answer the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Result] = {}
    for name in names:
        print(f"bench {name} ...", file=sys.stderr, flush=True)
        began = time.perf_counter()
        results[name] = SUITES[name](duration_s)
        results[name]["elapsed_s"] = round(time.perf_counter() - began, 1)
    if "scale" in results:
        results["scale"]["plots"] = scale.plot_scale(results["scale"], out)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    markdown = _markdown(results)
    (out / "results.md").write_text(markdown)
    if "client" in results:
        _plot_client(results["client"], out)

    return markdown
