"""The CPU engine: a local Hugging Face causal LM behind one batching scheduler.

One background task runs decode steps. Each step takes every active request (up to
``max_batch_size``; the rest wait in arrival order), computes next-token logits for all of them on
the engine's one compute thread (``forward_steps.py``: by default one batch KV cache that sequences
join and leave row by row, with the caches of finished sequences reused by the next turn of the
same conversation; or, with ``kv_cache=False``, one forward over the left-padded full sequences)
and draws one token per row with the stateless sampler. New requests join at the next step;
finished and cancelled ones leave before it.

Full recompute (``kv_cache=False``) makes a generation continued from prompt + prefix ids execute
exactly the operations the uninterrupted run executes (bit-equal logits when run alone); with the
KV cache logits agree to float noise and tokens match.

Threads: torch runs on one dedicated thread, with ``torch_threads`` intra-op threads (default
``DEFAULT_TORCH_THREADS`` = 1). The mesh runs several server processes on few cores; with more
intra-op threads than the engine can keep scheduled, every small op waits at an OpenMP barrier for a
descheduled thread, and the worker burned ~10x the CPU per rollout and stalled for seconds under
load (docs/benchmarks.md, "Rollout throughput"). The embedded model's ops are too small to gain from
intra-op parallelism; raise ``torch_threads`` for a large model on a machine of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model_servers.inference_worker.engine import Engine, FinishReason, GenerationRequest, TokenStep
from model_servers.inference_worker.forward_steps import CachedDecode, FullRecompute, Stepper
from model_servers.inference_worker.hf_tokenizer import HFTokenizer
from model_servers.inference_worker.sampling import LogprobsMode, RowSampling, sample_batch
from nemo_gym_ckpt.errors import ConfigError, GymError, InternalError, Unavailable

__all__ = ["DEFAULT_TORCH_THREADS", "TransformersEngine"]

#: Intra-op threads of torch when the settings name none (see the module docstring).
DEFAULT_TORCH_THREADS = 1

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Slot:
    """One request inside the scheduler."""

    request: GenerationRequest
    stops: frozenset[int]
    ids: list[int]
    outbox: asyncio.Queue[TokenStep | GymError] = field(default_factory=asyncio.Queue)
    produced: int = 0
    done: bool = False
    cache: Any = None

    def row(self) -> RowSampling:
        req = self.request
        return RowSampling(req.seed, len(self.ids), req.temperature, req.top_p)

    def accept(self, token_id: int, logprob: float, context_length: int) -> TokenStep:
        self.ids.append(token_id)
        self.produced += 1
        finish: FinishReason | None = None
        if token_id in self.stops:
            finish = "stop"
        elif self.produced >= self.request.max_tokens or len(self.ids) >= context_length:
            finish = "length"
        self.done = finish is not None
        return TokenStep(token_id, logprob, finish)

    def fail(self, error: GymError) -> None:
        if not self.done:
            self.done = True
            self.outbox.put_nowait(error)


class TransformersEngine(Engine):
    """A ``transformers`` causal LM on the CPU with continuous batching of decode steps."""

    pausable = True

    def __init__(
        self,
        model: Any,
        tokenizer: HFTokenizer,
        *,
        context_length: int,
        max_batch_size: int = 64,
        logprobs_mode: LogprobsMode = "raw",
        kv_cache: bool = True,
        policy_version: int = 0,
    ) -> None:
        super().__init__(policy_version=policy_version)
        self._stepper: Stepper = (
            CachedDecode(model, tokenizer.pad_token_id, pool_size=2 * max_batch_size) if kv_cache
            else FullRecompute(model, tokenizer.pad_token_id)
        )
        self._tokenizer = tokenizer
        self._context_length = context_length
        self._max_batch_size = max_batch_size
        self._logprobs_mode: LogprobsMode = logprobs_mode
        self._waiting: deque[_Slot] = deque()
        self._active: list[_Slot] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failure: str | None = None
        self._thread: ThreadPoolExecutor | None = None
        self.steps = 0

    @classmethod
    def load(
        cls,
        path: Path,
        *,
        max_batch_size: int = 64,
        max_model_len: int | None = None,
        torch_threads: int | None = None,
        logprobs_mode: LogprobsMode = "raw",
        kv_cache: bool = True,
        policy_version: int = 0,
    ) -> TransformersEngine:
        """Load the model folder at ``path`` (blocking: call it in a thread from async code)."""
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch.set_num_threads(torch_threads or DEFAULT_TORCH_THREADS)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)
        model.eval()
        tokenizer = HFTokenizer.load(path, model_vocab_size=model.config.vocab_size)
        limit = _context_limit(model.config, max_model_len)
        return cls(model, tokenizer, context_length=limit, max_batch_size=max_batch_size,
                   logprobs_mode=logprobs_mode, kv_cache=kv_cache, policy_version=policy_version)

    @property
    def tokenizer(self) -> HFTokenizer:
        return self._tokenizer

    @property
    def context_length(self) -> int:
        return self._context_length

    @property
    def failure(self) -> str | None:
        return self._failure

    @property
    def kv_cache(self) -> bool:
        return isinstance(self._stepper, CachedDecode)

    @property
    def active_count(self) -> int:
        """Requests admitted and not yet finished or cancelled (a read-only snapshot)."""
        return sum(not slot.done for slot in (*self._active, *self._waiting))

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-engine")
            self._task = asyncio.create_task(self._run(), name="transformers-engine-scheduler")
            self._task.add_done_callback(self._on_scheduler_exit)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})  # a scheduler that died raises nothing here: _on_scheduler_exit logged it
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=False, cancel_futures=True)
        self._fail_all(Unavailable("the inference engine shut down"))

    def _on_scheduler_exit(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        # not restarted: the step that raised may have left the stepper's caches half updated
        self._failure = f"the engine scheduler died: {error!r}" if error is not None else \
            "the engine scheduler stopped"
        if error is not None:
            logger.error("engine scheduler died; refusing every request from now on", exc_info=error)
        self._fail_all(InternalError(self._failure))

    def _fail_all(self, error: GymError) -> None:
        for slot in (*self._active, *self._waiting):
            slot.fail(error)
        self._active.clear()
        self._waiting.clear()

    # ---- requests --------------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenStep, None]:
        slot = self._admit(request)
        try:
            while True:
                item = await slot.outbox.get()
                if isinstance(item, GymError):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            slot.done = True

    def _admit(self, request: GenerationRequest) -> _Slot:
        if self._failure is not None:
            raise Unavailable(f"the inference engine can serve no more requests ({self._failure}); "
                              "restart the worker")
        if self._task is None:
            raise Unavailable("the inference engine is not running")
        bad = [i for i in request.prompt_token_ids if not 0 <= i < self._tokenizer.vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary: {bad[:5]}")
        slot = _Slot(request, request.stop_set(self._tokenizer.eos_token_id), list(request.prompt_token_ids))
        self._waiting.append(slot)
        self._wakeup.set()
        return slot

    # ---- scheduler -------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await self._unpaused()  # a step already running finishes; none starts while paused
            batch = self._next_batch()
            if not batch:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            results = await self._step(batch)
            for slot, (token_id, logprob) in zip(batch, results, strict=True):
                if not slot.done:
                    slot.outbox.put_nowait(slot.accept(token_id, logprob, self._context_length))

    def _next_batch(self) -> list[_Slot]:
        self._active = [slot for slot in self._active if not slot.done]
        while self._waiting and len(self._active) < self._max_batch_size:
            slot = self._waiting.popleft()
            if not slot.done:
                self._active.append(slot)
        return list(self._active)

    async def _step(self, batch: list[_Slot]) -> list[tuple[int, float]]:
        rows = [slot.row() for slot in batch]
        self.steps += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._thread, self._compute, batch, rows)
        except (RuntimeError, ValueError, IndexError) as error:
            logger.exception("engine step failed for a batch of %d", len(batch))
            for slot in batch:
                slot.fail(InternalError(f"engine step failed: {error}"))
            return [(0, 0.0)] * len(batch)

    def _compute(self, batch: list[_Slot], rows: list[RowSampling]) -> list[tuple[int, float]]:
        import torch

        with torch.inference_mode():
            logits = self._stepper.logits(batch)[:, : self._tokenizer.vocab_size]
            return sample_batch(logits, rows, self._logprobs_mode)


def _context_limit(model_config: Any, max_model_len: int | None) -> int:
    limit = int(getattr(model_config, "max_position_embeddings", 0) or 0)
    if max_model_len is None:
        if limit <= 0:
            raise ConfigError("the model config names no max_position_embeddings; set max_model_len",
                              key="max_model_len")
        return limit
    if limit and max_model_len > limit:
        raise ConfigError(f"max_model_len {max_model_len} exceeds the model's {limit} positions",
                          key="max_model_len")
    return max_model_len
