"""The worker tests' byte-level BPE tokenizer (tokens that may end inside a UTF-8 character) and
its chat format: ``<|end|>`` its eos and ``<tool_call>`` an added token, as in the chat tokenizer."""

from __future__ import annotations

import functools
from typing import Any

from model_servers.inference_worker import default_model_data as data
from model_servers.inference_worker.tests.byte_level import MULTIBYTE_WORDS, build_byte_tokenizer, byte_level_text
from model_servers.policy_model.chat_format import ChatFormat
from model_servers.policy_model.chat_template import compile_chat_template
from model_servers.policy_model.tests.chat_tokenizer import CHAT_TEMPLATE

__all__ = ["MULTIBYTE_WORDS", "build_byte_tokenizer", "byte_chat_format", "byte_ids", "piece_ids"]


@functools.cache
def _shared() -> Any:
    return build_byte_tokenizer()


def byte_ids(text: str) -> list[int]:
    """One id per byte of ``text`` (``<|end|>`` and ``<tool_call>`` one id each)."""
    return list(_shared().encode(text, add_special_tokens=False).ids)


def piece_ids(word: str, size: int) -> list[int]:
    """The ids of ``word`` (one of ``MULTIBYTE_WORDS``) in pieces of ``size`` (2 or 3) bytes, the
    last piece shorter: pieces that end inside one character and start the next."""
    mapped = byte_level_text(word)
    return [_shared().token_to_id(mapped[i : i + size]) for i in range(0, len(mapped), size)]


def byte_chat_format(tokenizer: Any | None = None) -> ChatFormat:
    """The chat format of the byte tokenizer (``tokenizer``: one built by ``build_byte_tokenizer``,
    wrapped perhaps), with the chat tokenizer's template and no context bound."""
    template = compile_chat_template(CHAT_TEMPLATE, {"bos_token": data.BOS, "eos_token": data.END})
    return ChatFormat(tokenizer if tokenizer is not None else build_byte_tokenizer(), template,
                      eos_text=data.END, context_length=None)
