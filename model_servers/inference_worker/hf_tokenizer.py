"""A Hugging Face tokenizer behind the ``EngineTokenizer`` view (used by both engines).

transformers is imported only by ``HFTokenizer.load``; chat templates render through the wrapped
tokenizer's ``apply_chat_template`` (its sandboxed Jinja environment).

``load_pretrained_tokenizer`` loads a model folder's tokenizer as ``AutoTokenizer`` would, but
without ``AutoTokenizer`` where the folder's own files already settle the answer: importing
``AutoTokenizer`` (through transformers' model configs) imports torch, seconds of start-up that a
worker without a torch model (the script engine) has no use for.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nemo_gym_ckpt.errors import InvalidRequest

if TYPE_CHECKING:
    from model_servers.inference_worker.engine import ChatTemplateRequest

__all__ = ["GENERIC_FAST_CLASSES", "GENERIC_MODEL_TYPES", "HFTokenizer", "generic_fast_tokenizer",
           "load_pretrained_tokenizer"]

#: ``tokenizer_class`` names that ``AutoTokenizer`` loads as transformers' generic fast tokenizer
#: (``PreTrainedTokenizerFast`` is an alias of ``TokenizersBackend`` since transformers 5).
GENERIC_FAST_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
#: ``model_type`` values for which ``AutoTokenizer`` keeps a generic ``tokenizer_class`` as it is
#: (for some model types it swaps in a class of its own). Kept short on purpose; a test checks each
#: entry against the installed transformers.
GENERIC_MODEL_TYPES = frozenset({"llama"})


def _json_object(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def generic_fast_tokenizer(path: Path | str) -> bool:
    """Whether ``AutoTokenizer`` would load the local folder ``path`` as the generic fast tokenizer.

    Decided from the folder's files alone, conservatively: a ``tokenizer.json``, a
    ``tokenizer_config.json`` naming a generic fast class, a ``config.json`` of a model type in
    ``GENERIC_MODEL_TYPES``, and no remote code (``auto_map``) in either config. Anything else: False.
    """
    folder = Path(path)
    if not (folder / "tokenizer.json").is_file():
        return False
    tokenizer_config = _json_object(folder / "tokenizer_config.json")
    model_config = _json_object(folder / "config.json")
    if tokenizer_config is None or model_config is None:
        return False
    return (
        tokenizer_config.get("tokenizer_class") in GENERIC_FAST_CLASSES
        and model_config.get("model_type") in GENERIC_MODEL_TYPES
        and "auto_map" not in tokenizer_config
        and "auto_map" not in model_config
    )


def load_pretrained_tokenizer(path: Path | str) -> Any:
    """The tokenizer ``AutoTokenizer.from_pretrained(path)`` gives, without torch where possible.

    A folder ``generic_fast_tokenizer`` accepts loads straight through ``PreTrainedTokenizerFast``
    (the class ``AutoTokenizer`` would pick, called the same way); anything else goes through
    ``AutoTokenizer``.
    """
    if generic_fast_tokenizer(path):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


class HFTokenizer:
    """``encode``/``decode`` over a ``transformers`` tokenizer, ids limited to ``vocab_size``."""

    def __init__(self, tokenizer: Any, *, model_vocab_size: int | None = None) -> None:
        self._tok = tokenizer
        size = len(tokenizer)
        self._vocab_size = min(size, model_vocab_size) if model_vocab_size else size
        self._token_texts: dict[int, str] = {}

    @classmethod
    def load(cls, path: Path | str, *, model_vocab_size: int | None = None) -> HFTokenizer:
        return cls(load_pretrained_tokenizer(path), model_vocab_size=model_vocab_size)

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
