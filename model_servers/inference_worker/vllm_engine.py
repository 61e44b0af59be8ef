"""The GPU engine: vLLM's async engine (``AsyncLLM``) in the worker process.

Written against vLLM's documented async API: ``AsyncLLM.from_engine_args(AsyncEngineArgs(...))``,
``generate(TokensPrompt(prompt_token_ids=...), SamplingParams(...), request_id)`` yielding
``RequestOutput`` deltas (``output_kind=DELTA``), ``abort`` when the consumer goes away (closing the
``generate`` iterator does that), ``shutdown``. Token ids in, token ids and the sampled token's
logprob out; detokenization happens in the worker's HTTP layer, so vLLM does not detokenize.

Known difference from the transformers engine: vLLM seeds one generator per request and draws from
it step after step, so a *sampled* generation continued from prompt + prefix with the same seed is a
fresh sample of the same policy, not the tokens the uninterrupted run would have drawn (greedy
continuations match, up to batch numerics). Exact sampled continuation on vLLM needs the per-position
sampler of ``sampling.py`` as a vLLM logits processor.

Generation cuts: a cut copies the tokens the worker's HTTP layer has taken and never aborts the vLLM
request (it goes on to its end unchanged); closing the iterator (a retire, a disconnect) aborts it
and the tokens taken are a valid prefix; a continuation is an ordinary request whose
``TokensPrompt`` is prompt + prefix ids (``GenerationRequest.continuation``).

Why a cut does not abort (issue 7 asked for "a cut aborts the request and keeps the tokens already
produced"; docs/protocol.md section 8 asks only to freeze at a token boundary and make the prefix
durable): most checkpoints end without a crash, and then the cut call must end exactly as if it had
not been cut. After an abort it could only go on as a continuation, which on vLLM is not the same
generation: (1) a sampled continuation restarts the request's seeded generator, so its draws are not
the ones the uninterrupted request would have made (the per-position sampler that makes this exact
on the transformers engine, ``sampling.py``, is not vLLM's; plugging it in as a logits processor is
future work); (2) even greedy, the prefix is re-prefilled in one pass where it had been decoded token
by token, and the logits differ in their last bits (and with the batch), so a near tie can flip a
token. Aborting would also spend a re-prefill of prompt + prefix on every cut call, crash or not.
Freezing without aborting has none of these costs; after a crash the continuation is the only way
on, and there greedy matches up to those numerics (``tests/gpu``) and sampling is a fresh sample of
the same policy after the kept prefix. Abort-then-continue becomes the better choice only once both
(1) and (2) hold bit for bit on vLLM.

vllm is imported only inside ``load`` and ``generate``: this module imports on machines without it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from dataclasses import replace
from pathlib import Path
from typing import Any

from model_servers.inference_worker.engine import Engine, FinishReason, GenerationRequest, TokenStep
from model_servers.inference_worker.hf_tokenizer import HFTokenizer
from model_servers.inference_worker.model_dir import resolve_model_path
from model_servers.inference_worker.sampling import LogprobsMode
from nemo_gym_ckpt.errors import InternalError, Unavailable

__all__ = ["VllmEngine"]

_LOGPROBS_MODES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}


class VllmEngine(Engine):
    """vLLM's ``AsyncLLM`` behind the engine interface."""

    def __init__(self, llm: Any, tokenizer: HFTokenizer, *, context_length: int) -> None:
        super().__init__()
        self._llm = llm
        self._tokenizer = tokenizer
        self._context_length = context_length

    @classmethod
    async def load(
        cls,
        model_path: Path | None,
        *,
        max_batch_size: int = 64,
        max_model_len: int | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,
        logprobs_mode: LogprobsMode = "raw",
        extra_args: dict[str, Any] | None = None,
    ) -> VllmEngine:
        """Start vLLM on ``model_path`` (None: the embedded default model)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        path = resolve_model_path(model_path, must_exist=False)
        args = AsyncEngineArgs(
            model=str(path), max_model_len=max_model_len, max_num_seqs=max_batch_size, seed=seed,
            gpu_memory_utilization=gpu_memory_utilization, logprobs_mode=_LOGPROBS_MODES[logprobs_mode],
            **(extra_args or {}),
        )
        llm = AsyncLLM.from_engine_args(args)
        model_config = llm.model_config
        tokenizer = await asyncio.to_thread(
            HFTokenizer.load, path, model_vocab_size=model_config.get_vocab_size()
        )
        return cls(llm, tokenizer, context_length=int(model_config.max_model_len))

    @property
    def tokenizer(self) -> HFTokenizer:
        return self._tokenizer

    @property
    def context_length(self) -> int:
        return self._context_length

    async def aclose(self) -> None:
        self._llm.shutdown()

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenStep, None]:
        from vllm import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        outputs = self._llm.generate(prompt, _sampling_params(request), request.request_id)
        pending: TokenStep | None = None
        async with aclosing(outputs) as stream:
            async for output in stream:
                for step in _token_steps(output.outputs[0]):
                    if pending is not None:
                        yield pending
                    pending = step
                if output.finished:
                    yield _finished(pending, output.outputs[0].finish_reason)
                    return
        raise InternalError("vLLM ended a generation without finishing it")


def _sampling_params(request: GenerationRequest) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1, max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
        seed=request.seed, stop_token_ids=list(request.stop_token_ids), ignore_eos=request.ignore_eos,
        logprobs=1, output_kind=RequestOutputKind.DELTA, detokenize=False,
    )


def _token_steps(completion: Any) -> Iterator[TokenStep]:
    logprobs = completion.logprobs
    for index, token_id in enumerate(completion.token_ids):
        entry = logprobs[index].get(token_id) if logprobs is not None else None
        yield TokenStep(int(token_id), float(entry.logprob) if entry is not None else math.nan)


def _finished(last: TokenStep | None, reason: str | None) -> TokenStep:
    finish: FinishReason
    if reason == "stop":
        finish = "stop"
    elif reason == "length":
        finish = "length"
    else:
        raise Unavailable(f"vLLM ended the request without a token boundary finish ({reason})")
    if last is None:
        raise InternalError(f"vLLM finished a request ({reason}) without generating a token")
    return replace(last, finish_reason=finish)
