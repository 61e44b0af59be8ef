"""A byte-level BPE tokenizer whose tokens may end inside a UTF-8 character, and its chat format.

Every byte is a token, and so is every 2- and 3-byte piece of a few multi-byte words: one token may
hold the end of one character and the start of the next, which decodes to U+FFFD until the ids
that complete it arrive. ``<|end|>`` is its eos (a special token) and ``<tool_call>`` an added
token, as in the chat tokenizer. Built with ``tokenizers`` only (decoded, never trained: no merges).
"""

from __future__ import annotations

import functools
from typing import Any

from model_servers.inference_worker import default_model_data as data
from model_servers.policy_model.chat_format import ChatFormat
from model_servers.policy_model.chat_template import compile_chat_template
from model_servers.policy_model.tests.chat_tokenizer import CHAT_TEMPLATE

__all__ = ["MULTIBYTE_WORDS", "build_byte_tokenizer", "byte_chat_format", "byte_ids", "piece_ids"]

MULTIBYTE_WORDS = ("é", "€", "😀", " café", "naïve", "中文")


def _byte_level_text(text: str) -> str:
    from tokenizers.pre_tokenizers import ByteLevel

    return "".join(piece for piece, _ in ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text))


def build_byte_tokenizer() -> Any:
    """A fresh ``tokenizers.Tokenizer`` (the caller may wrap or change it)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: index for index, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for word in MULTIBYTE_WORDS:
        mapped = _byte_level_text(word)
        for i in range(len(mapped)):
            for j in range(i + 2, min(len(mapped), i + 3) + 1):
                vocab.setdefault(mapped[i:j], len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(data.END, special=True, normalized=False)])
    tokenizer.add_tokens([AddedToken(data.TOOL_CALL_OPEN, special=False, normalized=False)])
    return tokenizer


@functools.cache
def _shared() -> Any:
    return build_byte_tokenizer()


def byte_ids(text: str) -> list[int]:
    """One id per byte of ``text`` (``<|end|>`` and ``<tool_call>`` one id each)."""
    return list(_shared().encode(text, add_special_tokens=False).ids)


def piece_ids(word: str, size: int) -> list[int]:
    """The ids of ``word`` (one of ``MULTIBYTE_WORDS``) in pieces of ``size`` (2 or 3) bytes, the
    last piece shorter: pieces that end inside one character and start the next."""
    mapped = _byte_level_text(word)
    return [_shared().token_to_id(mapped[i : i + size]) for i in range(0, len(mapped), size)]


def byte_chat_format(tokenizer: Any | None = None) -> ChatFormat:
    """The chat format of the byte tokenizer (``tokenizer``: one built by ``build_byte_tokenizer``,
    wrapped perhaps), with the chat tokenizer's template and no context bound."""
    template = compile_chat_template(CHAT_TEMPLATE, {"bos_token": data.BOS, "eos_token": data.END})
    return ChatFormat(tokenizer if tokenizer is not None else build_byte_tokenizer(), template,
                      eos_text=data.END, context_length=None)
