"""The inference worker: one engine behind vLLM's OpenAI-compatible surface.

Routes (all also reachable under ``/ng-rollout/<capture_key>/``):

- ``POST /v1/completions``: token ids (or text) in; text, token ids and logprobs out; SSE streaming.
- ``POST /v1/chat/completions``: a chat rendered with the model's chat template, generated as a
  completion of its prompt ids; vLLM's token fields (``chat_completions``).
- ``POST /tokenize``, ``POST /detokenize``: vLLM's tokenizer routes (``tokenize_routes``).
- ``GET /v1/models``: the served model name.
- ``GET|POST /ng-control/v1/policy-version``: the version of the served weights. Every completion is
  stamped with the version current when it was admitted. With checkpointing enabled the POST needs
  the control bearer token.
- ``/ng-control/v1/generation-cut`` (+ ``/keep``, ``/status``): generation cuts, mounted only with
  checkpointing enabled (``cut_routes``, ``generation_cuts``); completions may then name their
  ``model_call`` and ask for a ``continuation`` of a staged prefix.
- ``/ng-control/v1/generation-hold`` (+ ``/release``): no decode steps while a checkpoint is open,
  mounted only with checkpointing enabled (``hold_routes``, ``generation_hold``).
- ``GET /health`` (from the base app).

A completion is admitted only while the worker holds fewer than ``max_batch_size +
max_waiting_requests`` of them; the next is refused up front with 429 ``capacity_exceeded`` and
``Retry-After`` (``admission``).

The engine is loaded in the app's lifespan (``transformers`` on the CPU by default, ``vllm`` on a GPU);
torch and transformers are imported only then, so loading a config that names this app stays fast.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from model_servers.inference_worker.admission import DEFAULT_MAX_WAITING, Admission
from model_servers.inference_worker.chat_completions import ChatCompletionRequest, ChatView
from model_servers.inference_worker.chat_prompt import chat_prompt
from model_servers.inference_worker.completions import (
    CompletionBuilder,
    CompletionRequest,
    check_prompt_fits,
    plan_completion,
)
from model_servers.inference_worker.cut_routes import check_bearer, make_cut_router
from model_servers.inference_worker.engine import Engine
from model_servers.inference_worker.generation_cuts import GenerationCuts
from model_servers.inference_worker.generation_hold import GenerationHold
from model_servers.inference_worker.hold_routes import make_hold_router
from model_servers.inference_worker.live_generations import GenerationJob
from model_servers.inference_worker.model_dir import model_dir_problem, resolve_model_path
from model_servers.inference_worker.sampling import derive_seed
from model_servers.inference_worker.script_engine import ScriptRule
from model_servers.inference_worker.staging import StagingStore
from model_servers.inference_worker.tokenize_routes import make_tokenize_router
from nemo_gym_ckpt.bounds import MAX_INT64
from nemo_gym_ckpt.config import CheckpointConfig, ServerConfig
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.errors import GymError, InvalidRequest, NotFound, Unavailable
from nemo_gym_ckpt.identity import current_identity
from nemo_gym_ckpt.server import close_on_shutdown, sse_event
from nemo_gym_ckpt.server import create_app as create_app_base
from nemo_gym_ckpt.slots import Slot

__all__ = ["Config", "EngineFactory", "PolicyVersionBody", "create_app", "load_engine", "staging_dir"]

logger = logging.getLogger(__name__)
DEFAULT_STAGING_BASE = Path("./checkpoints")
#: How long a completion whose client went away may take to unwind its cancellation.
CANCEL_WAIT_S = 5.0


class Config(ServerConfig):
    """Settings of one inference worker (the YAML block under ``inference_worker:``)."""

    engine: Literal["transformers", "vllm", "script"] = "transformers"
    model_path: Path | None = None
    served_model_name: str = Field("nemo-gym-ckpt-tiny", min_length=1)
    max_batch_size: int = Field(64, ge=1)
    # completions admitted beyond the max_batch_size being generated (they wait for a row); the next
    # is refused up front: 429 capacity_exceeded, Retry-After overload_retry_after_s; null: no limit
    max_waiting_requests: int | None = Field(DEFAULT_MAX_WAITING, ge=0, le=10_000_000)
    overload_retry_after_s: float = Field(1.0, ge=1.0, le=60.0)
    max_model_len: int | None = Field(None, ge=2)
    policy_version: int = Field(0, ge=0, le=MAX_INT64)
    seed: int = 0
    logprobs_mode: Literal["raw", "processed"] = "raw"
    torch_threads: int | None = Field(None, ge=1)
    kv_cache: bool = True
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    vllm_args: dict[str, Any] = Field(default_factory=dict)
    # generation cuts (checkpointing on): where staged prefixes live and how many may
    staging_dir: Path | None = None  # null = <checkpoint root>.generation-cuts/<instance>, beside the root
    staging_max_files: int = Field(4096, ge=1)
    staging_max_bytes: int = Field(1 << 30, ge=1)
    # engine: script (script_engine.py): answers by rules, tokens of the default model's tokenizer
    script: list[ScriptRule] = Field(default_factory=list, max_length=10_000)
    script_default: str = ""

    @model_validator(mode="after")
    def _script_only_for_the_script_engine(self) -> Config:
        if self.engine != "script" and (self.script or self.script_default):
            raise ValueError("script and script_default are settings of engine: script")
        return self

    @model_validator(mode="after")
    def _local_model_exists(self) -> Config:
        if self.engine == "transformers" and self.model_path is not None:
            problem = model_dir_problem(self.model_path.expanduser())
            if problem is not None:
                raise ValueError(problem)
        return self


class PolicyVersionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy_version: StrictInt = Field(ge=0, le=MAX_INT64)  # a 64-bit version: a larger one breaks every reply


EngineFactory = Callable[[Config], Awaitable[Engine]]


async def load_engine(settings: Config) -> Engine:
    """The engine the settings name, loaded (model weights in memory), not yet started.

    The app sets the engine's ``policy_version`` from the settings before starting it.
    """
    if settings.engine == "script":
        from model_servers.inference_worker.script_engine import SCRIPT_CONTEXT_LENGTH, ScriptEngine

        tokenizer_path = str(resolve_model_path(settings.model_path))
        context = settings.max_model_len or SCRIPT_CONTEXT_LENGTH
        return await asyncio.to_thread(ScriptEngine.load, tokenizer_path, settings.script, settings.script_default,
                                       context_length=context)
    if settings.engine == "vllm":
        from model_servers.inference_worker.vllm_engine import VllmEngine

        return await VllmEngine.load(
            settings.model_path, max_batch_size=settings.max_batch_size, max_model_len=settings.max_model_len,
            seed=settings.seed, gpu_memory_utilization=settings.gpu_memory_utilization,
            logprobs_mode=settings.logprobs_mode, extra_args=settings.vllm_args,
        )
    from model_servers.inference_worker.transformers_engine import TransformersEngine

    path = resolve_model_path(settings.model_path)
    return await asyncio.to_thread(
        TransformersEngine.load, path, max_batch_size=settings.max_batch_size,
        max_model_len=settings.max_model_len, torch_threads=settings.torch_threads,
        logprobs_mode=settings.logprobs_mode, kv_cache=settings.kv_cache,
    )


class _Worker:
    """The loaded engine and the counter that seeds requests that come without a seed."""

    def __init__(self, settings: Config, cuts: GenerationCuts | None = None) -> None:
        self.settings = settings
        self.cuts = cuts
        self._engine: Engine | None = None
        self._requests = itertools.count()
        self.started_at = int(time.time())
        waiting = settings.max_waiting_requests
        self.admission = Admission(None if waiting is None else settings.max_batch_size + waiting,
                                   settings.overload_retry_after_s)

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise Unavailable("the inference engine is not loaded")
        return self._engine

    @property
    def loaded_engine(self) -> Engine | None:
        return self._engine

    def attach(self, engine: Engine | None) -> None:
        self._engine = engine

    def next_seed(self) -> int:
        return derive_seed(self.settings.seed, next(self._requests))

    async def job(self, body: CompletionRequest) -> GenerationJob:
        """What the completion runs: a fresh generation, or the continuation of a staged prefix."""
        engine, served = self.engine, self.settings.served_model_name
        cuts = self.cuts
        if cuts is None and (body.model_call is not None or body.continuation is not None):
            raise InvalidRequest("model_call and continuation need the mesh's checkpointing on")
        if cuts is not None and body.continuation is not None:
            return await cuts.continuation_job(body, engine, served, current_identity())
        # tokenizing a text prompt (up to MAX_TEXT characters) and checking its ids is O(prompt):
        # in a thread, so that the event loop (health, every stream) goes on meanwhile
        plan = await asyncio.to_thread(plan_completion, body, engine, served_model=served,
                                       next_seed=self.next_seed)
        if cuts is not None:
            return cuts.fresh_job(body, plan, engine, served, current_identity())
        return GenerationJob(plan.generation, CompletionBuilder(plan, engine.tokenizer, served,
                                                                engine.policy_version))


# ---- generation ----------------------------------------------------------------------------------


async def _generate(engine: Engine, job: GenerationJob) -> AsyncGenerator[bool, None]:
    """Feed the engine's tokens to the job's builder; yields after each one, True on the last.

    A continued terminal completion is finished before it starts: nothing is generated.
    """
    with job.tracked():
        if job.builder.finish_reason is not None:
            yield True
            return
        async with aclosing(engine.generate(job.request)) as steps:
            async for step in steps:
                finished = job.add(step)
                yield finished
                if finished:
                    return
        job.builder.close()


async def _collect(engine: Engine, job: GenerationJob) -> None:
    async with aclosing(_generate(engine, job)) as progress:
        async for _ in progress:
            pass


async def _stream(engine: Engine, job: GenerationJob) -> AsyncIterator[bytes]:
    builder = job.builder
    try:
        async with aclosing(_generate(engine, job)) as progress:
            async for _ in progress:
                chunk = builder.chunk()
                if chunk is not None:
                    yield sse_event(chunk)
    except GymError as error:
        logger.warning("completion stream %s failed: %s", builder.id, error)
        yield sse_event(error.to_body())
        return
    yield sse_event("[DONE]")


async def _stream_chat(engine: Engine, job: GenerationJob, view: ChatView) -> AsyncIterator[bytes]:
    builder = job.builder
    yield sse_event(view.first_chunk(builder))
    try:
        async with aclosing(_generate(engine, job)) as progress:
            async for _ in progress:
                chunk = view.chunk(builder)
                if chunk is not None:
                    yield sse_event(chunk)
    except GymError as error:
        logger.warning("chat stream %s failed: %s", view.id, error)
        yield sse_event(error.to_body())
        return
    usage = view.usage_chunk(builder)
    if usage is not None:
        yield sse_event(usage)
    yield sse_event("[DONE]")


class _HeldStream(StreamingResponse):
    """A streamed reply that keeps its completion's place in the worker until it ends, however it
    ends (its generator may never start when the client is gone before the first byte)."""

    def __init__(self, content: AsyncIterator[bytes], held: Slot) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._held = held

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._held.release()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[None]) -> None:
    """Run ``work``; cancel it (and so the engine request) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            # a cancel takes effect when the task next runs: wait for it (bounded) before looking
            task.cancel()
            await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
    if not task.done() or task.cancelled():
        if not task.done():  # still unwinding: its outcome is of no use to a client that left
            task.add_done_callback(_consume_outcome)
        raise InvalidRequest("the client disconnected before the completion finished")
    task.result()


def _consume_outcome(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved, so that asyncio logs no "exception was never retrieved"


# ---- routes --------------------------------------------------------------------------------------


def _check_bearer(request: Request, checkpoint: CheckpointConfig) -> None:
    token = checkpoint.control_auth_token
    if checkpoint.enabled and token is not None:
        check_bearer(request, token.get_secret_value().encode())


def _install_routes(app: FastAPI, worker: _Worker, checkpoint: CheckpointConfig) -> None:
    served = worker.settings.served_model_name

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response | dict[str, Any]:
        engine = worker.engine
        with worker.admission.hold() as held:
            job = await worker.job(body)
            if job.builder.plan.stream:
                return _HeldStream(_stream(engine, job), held.pass_on())
            await _unless_disconnected(request, _collect(engine, job))
            return job.builder.response()

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response | dict[str, Any]:
        body.check_fields()
        if body.model is not None and body.model != served:
            raise NotFound(f"model {body.model!r} is not served here; this worker serves {served!r}")
        engine = worker.engine
        with worker.admission.hold() as held:
            prompt = await asyncio.to_thread(
                chat_prompt, engine.tokenizer, body.messages, body.template(),
                required_prefix=body.required_prefix_token_ids, add_special_tokens=body.add_special_tokens,
            )
            # a prompt too long for a CompletionRequest (over MAX_TOKENS ids) gets the same 400 as one
            # that is only too long for the context, not a validation error (500) out of completion()
            check_prompt_fits(len(prompt.ids), engine.context_length)
            job = await worker.job(body.completion(prompt))
            view = ChatView(body, prompt)
            if body.stream:
                return _HeldStream(_stream_chat(engine, job, view), held.pass_on())
            await _unless_disconnected(request, _collect(engine, job))
            return view.response(job.builder)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        engine = worker.engine
        card = {"id": served, "object": "model", "created": worker.started_at, "owned_by": "nemo-gym-ckpt",
                "root": served, "parent": None, "max_model_len": engine.context_length}
        return {"object": "list", "data": [card]}

    @app.get("/ng-control/v1/policy-version")
    async def get_policy_version() -> dict[str, int]:
        return {"policy_version": worker.engine.policy_version}

    @app.post("/ng-control/v1/policy-version")
    async def set_policy_version(body: PolicyVersionBody, request: Request) -> dict[str, int]:
        _check_bearer(request, checkpoint)
        engine = worker.engine
        engine.policy_version = body.policy_version
        return {"policy_version": engine.policy_version}


def _engine_health(worker: _Worker) -> Callable[[], None]:
    """``GET /health``'s check: 503 (unavailable, naming the cause) once the engine can serve no more
    requests, so that whoever watches health sees a dead worker."""

    def check() -> None:
        engine = worker.loaded_engine
        failure = engine.failure if engine is not None else None
        if failure is not None:
            raise Unavailable(f"the inference engine can serve no more requests: {failure}")

    return check


def staging_dir(ctx: ServerContext[Config]) -> Path:
    """Where this worker stages generation cuts: ``staging_dir``, else ``<root>.generation-cuts/<instance>``
    beside the checkpoint root (``./checkpoints`` -> ``./checkpoints.generation-cuts/inference_worker``;
    without a root, as if it were ``./checkpoints``).

    Never inside the root: the controller owns it and every ``checkpoint_dir`` in it (it creates,
    lists and deletes them), and gym servers write only under ``<checkpoint_dir>/gym/<kind>/<instance>/``
    (docs/protocol.md section 6). The worker is not a participant and the cut request names no directory;
    its staging store is its own state, kept across checkpoints and restarts, so it lives in its own
    directory. Put it on storage that survives what a checkpoint must survive (the same host's disk
    for a process crash; shared storage if the worker may come back elsewhere)."""
    configured = ctx.settings.staging_dir
    if configured is not None:
        return configured
    root = ctx.mesh.checkpoint.root or DEFAULT_STAGING_BASE
    return root.parent / f"{root.name}.generation-cuts" / ctx.name


def _generation_cuts(ctx: ServerContext[Config]) -> GenerationCuts | None:
    if not ctx.mesh.checkpoint.enabled:
        return None
    settings = ctx.settings
    store = StagingStore(staging_dir(ctx), max_files=settings.staging_max_files,
                         max_bytes=settings.staging_max_bytes)
    return GenerationCuts(store)


def create_app(ctx: ServerContext[Config], *, engine_factory: EngineFactory = load_engine) -> FastAPI:
    """The worker app; the engine comes from ``engine_factory`` when the app starts."""
    worker = _Worker(ctx.settings, _generation_cuts(ctx))
    hold = GenerationHold(lambda: worker.engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if worker.cuts is not None:
            await worker.cuts.open()
        engine = await engine_factory(ctx.settings)
        engine.policy_version = ctx.settings.policy_version
        await engine.start()
        worker.attach(engine)
        try:
            yield
        finally:
            hold.close()
            worker.attach(None)
            await engine.aclose()

    app = create_app_base(ctx.name, lifespan=lifespan, health_check=_engine_health(worker))
    _install_routes(app, worker, ctx.mesh.checkpoint)
    app.include_router(make_tokenize_router(lambda: worker.engine, ctx.settings.served_model_name))
    token = ctx.mesh.checkpoint.control_auth_token
    if worker.cuts is not None and token is not None:
        app.include_router(make_cut_router(worker.cuts, token.get_secret_value()))
        app.include_router(make_hold_router(hold, token.get_secret_value()))
    return close_on_shutdown(app, ctx.aclose)
