"""The prompt ids of a chat: its chat-template text, tokenized, reusing ids already known for its start.

vLLM renders a chat and tokenizes the whole text again. That can change the ids of earlier turns
(a model may have generated a token sequence that is not the canonical tokenization of its text),
and training on a prompt whose history was re-tokenized is training on ids the model never
produced. Two ways name the ids that must stay:

- ``required_prefix_token_ids`` (NeMo Gym's ``vllm_model`` extension, ``supply_prefix_token_ids``):
  the prompt must start with exactly these ids. If their text is not the start of the rendered
  prompt, the request is refused (400): the caller's ids do not belong to this conversation.
- the token fields of the last assistant turn that carries them (``prompt_token_ids`` +
  ``generation_token_ids``, as ``vllm_model`` sends history back, and as NeMo RL's vLLM server
  reads them): the same splice; if their text does not start the prompt (the caller changed the
  text, or the template renders history differently), the whole prompt is tokenized afresh and a
  warning says so.

A splice is: the known ids, then the tokenization of only the rendered text after their decoded text
(no special tokens added). The reply's ``prompt_token_ids`` then start with the known ids.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from model_servers.inference_worker.chat_messages import ChatMessage, known_ids, template_messages
from model_servers.inference_worker.completions import check_token_ids
from model_servers.inference_worker.engine import ChatTemplateRequest, EngineTokenizer
from nemo_gym_ckpt.errors import InvalidRequest

__all__ = ["ChatPrompt", "chat_prompt"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatPrompt:
    text: str  # the rendered prompt
    ids: list[int]
    reused: int  # how many leading ids were taken as given, not tokenized


def _splice(tokenizer: EngineTokenizer, text: str, known: list[int]) -> ChatPrompt | None:
    known_text = tokenizer.decode(known, skip_special_tokens=False)
    if not text.startswith(known_text):
        return None
    rest = tokenizer.encode(text[len(known_text) :], add_special_tokens=False) if len(text) > len(known_text) else []
    return ChatPrompt(text, [*known, *rest], len(known))


def chat_prompt(
    tokenizer: EngineTokenizer, messages: list[ChatMessage], options: ChatTemplateRequest, *,
    required_prefix: list[int] | None = None, add_special_tokens: bool = False,
) -> ChatPrompt:
    """The rendered prompt of ``messages`` and its ids (see the module docstring for the splice)."""
    text = tokenizer.render_chat(template_messages(messages), options)
    if required_prefix:
        check_token_ids(required_prefix, tokenizer.vocab_size, "required_prefix_token_ids")
        spliced = _splice(tokenizer, text, required_prefix)
        if spliced is None:
            raise InvalidRequest("required_prefix_token_ids do not decode to the start of the rendered prompt")
        return spliced
    known = known_ids(messages)
    if known:
        check_token_ids(known, tokenizer.vocab_size, "an assistant message's token ids")
        spliced = _splice(tokenizer, text, known)
        if spliced is not None:
            return spliced
        logger.warning("the token ids of an assistant turn (%d) do not decode to the start of the rendered "
                       "prompt; tokenizing the whole prompt (%d chars) afresh", len(known), len(text))
    return ChatPrompt(text, tokenizer.encode(text, add_special_tokens=add_special_tokens), 0)
