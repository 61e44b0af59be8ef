"""The model's chat format: its tokenizer's chat template, and exact encode/decode.

Rendering goes through ``tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=
True)`` so any Hugging Face model directory with a chat template works. The rendered text already
holds the template's special tokens (``<bos>`` included), so it is encoded without adding any.
Decoding keeps special tokens: tool-call tags and the eos marker must stay visible to the parser.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemo_gym_ckpt.errors import ConfigError, InvalidRequest

__all__ = ["ChatFormat", "load_chat_format"]

logger = logging.getLogger(__name__)

#: ``model_max_length`` above this is the tokenizer's "unknown" sentinel, not a real context size.
_UNBOUNDED_CONTEXT = 10**8


class ChatFormat:
    """A loaded tokenizer seen as the chat format of one model."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("the tokenizer has no chat_template", key="tokenizer_path")
        self._tokenizer = tokenizer
        self.eos_text: str = tokenizer.eos_token or ""
        self.vocab_size: int = len(tokenizer)
        context = getattr(tokenizer, "model_max_length", None)
        bounded = isinstance(context, int) and context < _UNBOUNDED_CONTEXT
        self.context_length: int | None = context if bounded else None

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """The prompt text of ``messages`` with the generation prompt appended."""
        from jinja2 import TemplateError

        try:
            text = self._tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=True, tokenize=False
            )
        except TemplateError as error:
            raise InvalidRequest(f"the chat template refused these messages: {error}") from error
        if not isinstance(text, str):
            raise InvalidRequest("the chat template did not render text")
        return text

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        text = self._tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return str(text)


def load_chat_format(directory: Path | str) -> ChatFormat:
    """Load the tokenizer of a model directory (offline; heavy imports happen here)."""
    from transformers import AutoTokenizer

    logger.info("loading tokenizer from %s", directory)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as error:  # missing files / no usable tokenizer in the folder
        detail = f"cannot load a tokenizer from {directory}: {error}"
        raise ConfigError(detail, key="tokenizer_path") from error
    return ChatFormat(tokenizer)
