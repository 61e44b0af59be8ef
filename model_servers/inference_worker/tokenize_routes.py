"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` (served beside ``/v1``, as vLLM serves them).

``/tokenize`` has vLLM's two forms, told apart by ``messages``:

- text: ``{model?, prompt, add_special_tokens = true, return_token_strs = false}``;
- chat: ``{model?, messages, tools?, add_generation_prompt = true, continue_final_message = false,
  add_special_tokens = false, chat_template_kwargs?, return_token_strs = false}``, plus NeMo Gym's
  ``required_prefix_token_ids`` extension; the ids are those ``/v1/chat/completions`` would generate
  from (``chat_prompt``: the same template, the same splice of known ids).

Reply: ``{count, max_model_len, tokens, token_strs}``. ``/detokenize``: ``{model?, tokens}`` ->
``{prompt}`` (special tokens kept). Unknown fields, ids outside the vocabulary and another model's
name are refused (400 / 404).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, RootModel, StrictStr, ValidationError

from model_servers.inference_worker.chat_messages import (
    MAX_MESSAGES,
    MAX_TEXT,
    MAX_TOKEN_IDS,
    MAX_TOOLS,
    ChatMessage,
    ChatTool,
    TokenIds,
    template_request,
)
from model_servers.inference_worker.chat_prompt import chat_prompt
from model_servers.inference_worker.completions import check_token_ids
from model_servers.inference_worker.engine import Engine
from nemo_gym_ckpt.bounds import MAX_TOKEN_ID, Name
from nemo_gym_ckpt.errors import InvalidRequest, NotFound
from nemo_gym_ckpt.server import declare_body

__all__ = ["DetokenizeRequest", "TokenizeChatRequest", "TokenizeTextRequest", "make_tokenize_router"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizeTextRequest(_Strict):
    model: Name | None = None
    prompt: StrictStr = Field(max_length=MAX_TEXT)
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Strict):
    model: Name | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = Field(None, max_length=0)
    required_prefix_token_ids: TokenIds | None = None


class DetokenizeRequest(_Strict):
    model: Name | None = None
    tokens: list[Annotated[int, Field(ge=-MAX_TOKEN_ID, le=MAX_TOKEN_ID)]] = Field(max_length=MAX_TOKEN_IDS)


class TokenizeBody(RootModel[TokenizeChatRequest | TokenizeTextRequest]):
    """What ``/tokenize`` reads: a chat (``messages``) or a text (``prompt``)."""


def _validation_detail(error: ValidationError) -> str:
    first = error.errors()[0]
    location = ".".join(str(part) for part in first.get("loc", ())) or "body"
    return f"{location}: {first.get('msg', 'invalid')}"


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        data = orjson.loads(await request.body())
    except orjson.JSONDecodeError as error:
        raise InvalidRequest(f"the body is not JSON: {error}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object")
    return data


def _parsed(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise InvalidRequest(_validation_detail(error)) from None


def _check_model(name: str | None, served: str) -> None:
    if name is not None and name != served:
        raise NotFound(f"model {name!r} is not served here; this worker serves {served!r}")


def _tokenized(engine: Engine, body: TokenizeTextRequest | TokenizeChatRequest) -> list[int]:
    tokenizer = engine.tokenizer
    if isinstance(body, TokenizeTextRequest):
        return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    options = template_request(
        body.tools, add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message, chat_template_kwargs=body.chat_template_kwargs,
    )
    prompt = chat_prompt(tokenizer, body.messages, options, required_prefix=body.required_prefix_token_ids,
                         add_special_tokens=body.add_special_tokens)
    return prompt.ids


def make_tokenize_router(engine: Callable[[], Engine], served_model: str) -> APIRouter:
    """The two routes; ``engine`` gives the loaded engine (503 while it is not)."""
    router = APIRouter()

    @router.post("/tokenize", openapi_extra=declare_body(TokenizeBody))
    async def tokenize(request: Request) -> dict[str, Any]:
        data = await _json_body(request)
        kind: type[TokenizeTextRequest | TokenizeChatRequest] = (
            TokenizeChatRequest if "messages" in data else TokenizeTextRequest
        )
        body = _parsed(kind, data)
        _check_model(body.model, served_model)
        loaded = engine()
        ids = await asyncio.to_thread(_tokenized, loaded, body)
        strings = [loaded.tokenizer.token_text(i) for i in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": loaded.context_length, "tokens": ids, "token_strs": strings}

    @router.post("/detokenize", openapi_extra=declare_body(DetokenizeRequest))
    async def detokenize(request: Request) -> dict[str, str]:
        body: DetokenizeRequest = _parsed(DetokenizeRequest, await _json_body(request))
        _check_model(body.model, served_model)
        tokenizer = engine().tokenizer
        check_token_ids(body.tokens, tokenizer.vocab_size, "tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    return router
