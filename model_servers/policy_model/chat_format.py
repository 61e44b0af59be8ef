"""The model's chat format: its tokenizer's chat template, and exact encode/decode.

Read from the model folder's own files, as Hugging Face stores them: ``tokenizer.json`` (a fast
tokenizer, loaded with the ``tokenizers`` library), ``tokenizer_config.json`` (special tokens,
``model_max_length``) and the chat template (``chat_template.jinja``, else the config's
``chat_template``). The template renders as transformers' ``apply_chat_template(messages,
tools=..., add_generation_prompt=True)`` renders it (``chat_template.py``), so any model folder with
a fast tokenizer and a chat template works, and the policy model imports neither transformers nor
torch. The rendered text already holds the template's special tokens (``<bos>`` included), so it is
encoded without adding any. Decoding keeps special tokens: tool-call tags and the eos marker must
stay visible to the parser.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from model_servers.policy_model.chat_template import CompiledChatTemplate, compile_chat_template
from nemo_gym_ckpt.errors import ConfigError, InvalidRequest

__all__ = ["ChatFormat", "load_chat_format"]

logger = logging.getLogger(__name__)

#: ``model_max_length`` above this is the tokenizer's "unknown" sentinel, not a real context size.
_UNBOUNDED_CONTEXT = 10**8
#: The named special tokens a chat template sees as variables (transformers' ``special_tokens_map``).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatFormat:
    """A model's fast tokenizer and chat template seen as the chat format of one model."""

    def __init__(self, tokenizer: Any, template: CompiledChatTemplate, *, eos_text: str,
                 context_length: int | None) -> None:
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer
        self._template = template
        self.eos_text = eos_text
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.context_length = context_length

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """The prompt text of ``messages`` with the generation prompt appended."""
        from jinja2 import TemplateError

        try:
            return self._template.render(messages, tools=tools or None, add_generation_prompt=True)
        except (TemplateError, TypeError, ValueError) as error:  # the template (or its raise_exception) refused
            raise InvalidRequest(f"the chat template refused these messages: {error}") from error

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; special tokens are kept unless asked otherwise."""
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string, or an added token's object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_source(directory: Path, config: dict[str, Any]) -> str | None:
    path = directory / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((item.get("template") for item in source
                       if isinstance(item, dict) and item.get("name") == "default"), None)
    return source if isinstance(source, str) and source else None


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read {path}: {error}", key="tokenizer_path") from error
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object", key="tokenizer_path")
    return config


def load_chat_format(directory: Path | str) -> ChatFormat:
    """Load the tokenizer and chat template of a model folder (offline)."""
    from jinja2 import TemplateSyntaxError
    from tokenizers import Tokenizer

    folder = Path(directory)
    logger.info("loading tokenizer from %s", folder)
    try:
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as error:  # tokenizers raises its own Exception for a missing or bad file
        detail = f"cannot load a tokenizer from {folder}: {error}"
        raise ConfigError(detail, key="tokenizer_path") from error
    config = _read_config(folder)
    source = _template_source(folder, config)
    if source is None:
        raise ConfigError("the tokenizer has no chat_template", key="tokenizer_path")
    special = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None}
    try:
        template = compile_chat_template(source, special)
    except TemplateSyntaxError as error:
        raise ConfigError(f"the chat template does not parse: {error}", key="tokenizer_path") from error
    context = config.get("model_max_length")
    bounded = isinstance(context, int) and context < _UNBOUNDED_CONTEXT
    return ChatFormat(tokenizer, template, eos_text=special.get("eos_token", ""),
                      context_length=context if bounded else None)
