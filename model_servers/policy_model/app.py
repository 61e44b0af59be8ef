"""The policy model server: OpenAI-compatible chat and Responses in front of the policy.

It renders chats with the model's chat template, parses Hermes-style tool calls, and hands the
caller the exact token ids and logprobs of each call for training (``return_token_ids``). It
generates on our inference worker (``worker``), sending token ids and reusing the ids of earlier
turns, or fronts an external OpenAI-compatible server (``upstream``). See README.md.

With ``checkpoint_policy: true`` and the mesh's checkpointing on, the server is the checkpoint
participant of kind ``model`` (``participant``): its routes serve through the custody backend
(admission, held replies, the capture ledger). Otherwise nothing of that is mounted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from model_servers.policy_model.backend import Backend
from model_servers.policy_model.call_params import Defaults
from model_servers.policy_model.capture_memory import CaptureMemory
from model_servers.policy_model.participant import mount_policy_participant
from model_servers.policy_model.routes import make_router
from model_servers.policy_model.upstream_backend import UpstreamBackend
from model_servers.policy_model.worker_backend import WorkerBackend
from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK, Clock
from nemo_gym_ckpt.config import MeshConfig, ServerConfig, ServerRef
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.server import close_on_shutdown
from nemo_gym_ckpt.server import create_app as create_app_base

__all__ = ["Config", "UpstreamConfig", "create_app", "make_backend", "tokenizer_dir"]


class UpstreamConfig(BaseModel):
    """An external OpenAI-compatible server; ``base_url`` includes ``/v1``."""

    model_config = ConfigDict(extra="forbid")

    base_url: str = Field(pattern=r"^https?://")
    api_key: SecretStr | None = None
    model: str = Field(min_length=1)


class Config(ServerConfig):
    worker: ServerRef | None = None
    upstream: UpstreamConfig | None = None
    tokenizer_path: Path | None = None
    model_name: str | None = None
    return_token_ids: bool = False
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(256, ge=1)
    request_timeout_s: float = Field(600.0, gt=0)
    checkpoint_policy: bool = False  # the one policy participant of the mesh (docs/protocol.md section 2)
    generation_cuts: bool = False  # cut the generations in flight at a checkpoint (needs the worker)
    # where the worker serves /ng-control/v1/generation-cut when not at its own URL (a NeMo RL-hosted engine)
    generation_cut_url: str | None = Field(None, pattern=r"^https?://", max_length=2048)
    # token lines the capture ledger holds in memory before it spills them (capture_memory.py)
    capture_memory_max_bytes: int = Field(256 * 1024 * 1024, ge=0, le=1 << 40)
    capture_spill_dir: str | None = None
    # no decode steps on the worker while a checkpoint is open (generation_hold.py): for a CPU mesh,
    # where the worker shares the cores with the commits; off on a GPU
    hold_generation_in_checkpoints: bool = False

    @model_validator(mode="after")
    def _one_backend(self) -> Config:
        if (self.worker is None) == (self.upstream is None):
            raise ValueError("set exactly one of worker (our inference worker) or upstream (an external "
                             "server)")
        if self.worker is not None and self.worker.type != "responses_api_models":
            raise ValueError(f"worker must be a responses_api_models instance, got {self.worker.type}")
        if self.upstream is not None and self.tokenizer_path is not None:
            raise ValueError("tokenizer_path is only used with worker (the upstream server tokenizes)")
        return self

    @model_validator(mode="after")
    def _cuts_on_the_policy_worker(self) -> Config:
        if self.generation_cuts and not (self.checkpoint_policy and self.worker is not None):
            raise ValueError("generation_cuts needs checkpoint_policy: true and a worker (an upstream server "
                             "cannot be cut)")
        if self.hold_generation_in_checkpoints and not (self.checkpoint_policy and self.worker is not None):
            raise ValueError("hold_generation_in_checkpoints needs checkpoint_policy: true and a worker (an "
                             "upstream server cannot be held)")
        return self


def tokenizer_dir(settings: Config, mesh: MeshConfig) -> Path:
    """Where the chat template and tokenizer live: ``tokenizer_path``, else the worker's model."""
    if settings.tokenizer_path is not None:
        return settings.tokenizer_path
    assert settings.worker is not None
    from model_servers.inference_worker.model_dir import resolve_model_path

    worker_settings = mesh.instance(settings.worker.name).settings
    return resolve_model_path(getattr(worker_settings, "model_path", None), must_exist=False)


def _served_name(settings: Config, mesh: MeshConfig) -> str:
    if settings.model_name:
        return settings.model_name
    if settings.upstream is not None:
        return settings.upstream.model
    assert settings.worker is not None
    worker_settings = mesh.instance(settings.worker.name).settings
    return str(getattr(worker_settings, "served_model_name", None) or settings.worker.name)


def make_backend(ctx: ServerContext[Config]) -> Backend:
    settings = ctx.settings
    name = _served_name(settings, ctx.mesh)
    if settings.upstream is not None:
        upstream = settings.upstream
        return UpstreamBackend(
            client=ctx.client, base_url=upstream.base_url, api_key=upstream.api_key, model=upstream.model,
            model_name=name, timeout_s=settings.request_timeout_s,
        )
    assert settings.worker is not None
    worker_settings = ctx.mesh.instance(settings.worker.name).settings
    return WorkerBackend(
        client=ctx.client, url=ctx.url_of(settings.worker), tokenizer_dir=tokenizer_dir(settings, ctx.mesh),
        model_name=name, timeout_s=settings.request_timeout_s,
        context_length=getattr(worker_settings, "max_model_len", None),
    )


def create_app(ctx: ServerContext[Config], *, clock: Clock = SYSTEM_CLOCK) -> FastAPI:
    """The server's app; ``clock`` is the checkpoint participant's (tests pass a fake one)."""
    settings = ctx.settings
    backend = make_backend(ctx)
    defaults = Defaults(settings.temperature, settings.top_p, settings.max_tokens, settings.return_token_ids)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        yield

    app = create_app_base(ctx.name, lifespan=lifespan)
    policy = None
    if settings.checkpoint_policy:
        worker_url = ctx.url_of(settings.worker) if settings.worker is not None else None
        memory = CaptureMemory(settings.capture_memory_max_bytes, settings.capture_spill_dir)
        policy = mount_policy_participant(
            app, ctx, backend, worker_url=worker_url, generation_cuts=settings.generation_cuts,
            cut_control_url=settings.generation_cut_url, clock=clock, capture_memory=memory,
            hold_generation=settings.hold_generation_in_checkpoints,
        )
    app.include_router(make_router(policy.backend if policy else backend, defaults))
    return close_on_shutdown(app, ctx.aclose)
