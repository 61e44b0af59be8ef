"""A byte-level BPE tokenizer whose tokens may end inside a UTF-8 character.

Every byte is a token, and so is every 2- and 3-byte piece of a few multi-byte words: one token may
hold the end of one character and the start of the next, which decodes to U+FFFD until the ids that
complete it arrive. ``<|end|>`` is a special token (the eos of the default model's format) and
``<tool_call>`` an added one. Built with ``tokenizers`` only (decoded, never trained: no merges);
the worker's and the policy model's tests wrap it as they need.
"""

from __future__ import annotations

from typing import Any

from model_servers.inference_worker import default_model_data as data

__all__ = ["MULTIBYTE_WORDS", "build_byte_tokenizer", "byte_level_text"]

MULTIBYTE_WORDS = ("é", "€", "😀", " café", "naïve", "中文")


def byte_level_text(text: str) -> str:
    """``text`` in the byte-level alphabet: one character per byte, as the vocabulary holds them."""
    from tokenizers.pre_tokenizers import ByteLevel

    return "".join(piece for piece, _ in ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text))


def build_byte_tokenizer() -> Any:
    """A fresh ``tokenizers.Tokenizer`` (the caller may wrap or change it)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: index for index, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for word in MULTIBYTE_WORDS:
        mapped = byte_level_text(word)
        for i in range(len(mapped)):
            for j in range(i + 2, min(len(mapped), i + 3) + 1):
                vocab.setdefault(mapped[i:j], len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(data.END, special=True, normalized=False)])
    tokenizer.add_tokens([AddedToken(data.TOOL_CALL_OPEN, special=False, normalized=False)])
    return tokenizer
