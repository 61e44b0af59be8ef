"""A Hugging Face tokenizer behind the ``EngineTokenizer`` view (used by both engines).

transformers is imported only by ``HFTokenizer.load``; chat templates render through the wrapped
tokenizer's ``apply_chat_template`` (its sandboxed Jinja environment).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nemo_gym_ckpt.errors import InvalidRequest

if TYPE_CHECKING:
    from model_servers.inference_worker.engine import ChatTemplateRequest

__all__ = ["HFTokenizer"]


class HFTokenizer:
    """``encode``/``decode`` over a ``transformers`` tokenizer, ids limited to ``vocab_size``."""

    def __init__(self, tokenizer: Any, *, model_vocab_size: int | None = None) -> None:
        self._tok = tokenizer
        size = len(tokenizer)
        self._vocab_size = min(size, model_vocab_size) if model_vocab_size else size
        self._token_texts: dict[int, str] = {}

    @classmethod
    def load(cls, path: Path | str, *, model_vocab_size: int | None = None) -> HFTokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path)), model_vocab_size=model_vocab_size)

    @property
    def eos_token_id(self) -> int | None:
        eos = self._tok.eos_token_id
        return eos if isinstance(eos, int) else None

    @property
    def pad_token_id(self) -> int:
        pad = self._tok.pad_token_id
        if isinstance(pad, int):
            return pad
        return self.eos_token_id or 0

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def backend(self) -> Any:
        """The wrapped ``transformers`` tokenizer (chat templates live there)."""
        return self._tok

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id], skip_special_tokens=False)
        return text

    def render_chat(self, messages: list[dict[str, Any]], request: ChatTemplateRequest) -> str:
        from jinja2 import TemplateError

        if not getattr(self._tok, "chat_template", None):
            raise InvalidRequest("this model's tokenizer has no chat template; use /v1/completions")
        try:
            text = self._tok.apply_chat_template(
                messages, tools=request.tools or None, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message, tokenize=False,
                **request.template_kwargs,
            )
        except (TemplateError, ValueError, TypeError) as error:  # the template (or its raise_exception) refused
            raise InvalidRequest(f"the chat template refused these messages: {error}") from error
        if not isinstance(text, str):
            raise InvalidRequest("the chat template did not render text")
        return text
