"""A character-level tokenizer with the embedded default model's special tokens and chat format.

Built in a test fixture (the shipped model is not needed): one id per character, the role and
framing markers as special tokens, the tool-call and tool-result tags as added tokens, and a
Jinja chat template that renders the format documented in ``default_model_data``.
"""

from __future__ import annotations

from pathlib import Path

from model_servers.inference_worker import default_model_data as data

__all__ = ["CHAT_TEMPLATE", "build_chat_tokenizer"]

CHAT_TEMPLATE = """\
{{- bos_token -}}
{%- if tools -%}
<|system|>Tools: {% for tool in tools -%}
{{ tool.function.name if tool.function is defined else tool.name }}{{ ", " if not loop.last else "" }}
{%- endfor %}<|end|>
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == "system" or message.role == "developer" -%}
<|system|>{{ message.content }}<|end|>
{%- elif message.role == "user" -%}
<|user|>{{ message.content }}<|end|>
{%- elif message.role == "assistant" -%}
<|assistant|>{{ message.content or "" }}
{%- for call in message.tool_calls or [] -%}
<tool_call>{"name":{{ call.function.name | tojson }},"arguments":{{ call.function.arguments }}}</tool_call>
{%- endfor -%}
<|end|>
{%- elif message.role == "tool" -%}
<|tool|><tool_result>{{ message.content }}</tool_result><|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}
"""

_SPECIAL = (data.PAD, data.BOS, data.UNK, data.SYSTEM, data.USER, data.ASSISTANT, data.TOOL, data.END)
_TAGS = (data.TOOL_CALL_OPEN, data.TOOL_CALL_CLOSE, data.TOOL_RESULT_OPEN, data.TOOL_RESULT_CLOSE)
_CHARS = ("\n", *(chr(code) for code in range(32, 127)))


def build_chat_tokenizer(directory: Path) -> Path:
    """Write the tokenizer (with its chat template) to ``directory`` and return it."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate((*data.SPECIAL_TOKENS, *_CHARS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=data.UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in _SPECIAL])
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in _TAGS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=data.PAD,
        bos_token=data.BOS,
        unk_token=data.UNK,
        eos_token=data.END,
        clean_up_tokenization_spaces=False,
        model_max_length=256,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    return directory
