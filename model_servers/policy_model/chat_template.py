"""A model's chat template compiled and rendered as Hugging Face ``apply_chat_template`` renders it.

The policy model only renders prompts and counts tokens, so it reads the model folder's files
itself (``chat_format.py``) instead of importing transformers, which imports torch (about 5 s of
CPU and 250 MB per process). The rendering keeps transformers' rules, which chat templates are
written against:

- a sandboxed Jinja environment (``ImmutableSandboxedEnvironment``) with ``trim_blocks`` and
  ``lstrip_blocks``, and the ``loopcontrols`` extension (``break``, ``continue``);
- ``tojson`` dumps JSON without HTML escaping and takes ``indent``, ``separators``, ``sort_keys``
  and ``ensure_ascii`` (default false);
- globals ``raise_exception(message)`` (a ``TemplateError``) and ``strftime_now(format)``;
- ``{% generation %}...{% endgeneration %}`` renders its body (the assistant-mask marker);
- ``namespace`` refuses attribute names that start with an underscore, and ``dict`` only builds;
- a message's keys whose value is null are dropped (a template tests for a missing key), and an
  empty conversation is refused;
- the variables are ``messages``, ``tools``, ``documents``, ``add_generation_prompt`` and the named
  special tokens (``bos_token``, ``eos_token``, ...); a message's reasoning under one of
  ``reasoning_content``, ``thinking`` or ``reasoning`` is also given under the first two.

``tests/test_chat_template.py`` renders the same conversations through transformers and through
this module and compares the text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["CompiledChatTemplate", "compile_chat_template"]

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(Extension):
    """``{% generation %}`` blocks render their body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """A template ``namespace`` that holds no underscore-prefixed names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's own signature: ``self`` may be a key
        self, rest = args[0], args[1:]
        values = dict(*rest, **kwargs)
        for name in values:
            _Namespace.refuse_private(name)
        jinja2.utils.Namespace.__init__(self, values)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace.refuse_private(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def refuse_private(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


class _DictMaker:
    """The template's ``dict``: builds dictionaries, exposes nothing of the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace,
                      dict=_DictMaker())
    return env


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as the template sees it: keys whose value is null dropped, reasoning under its names."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class CompiledChatTemplate:
    """One chat template, compiled once; ``render`` is safe to call from several threads."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        self.source = source
        self._template = _environment().from_string(source)
        self._special_tokens = dict(special_tokens)

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True) -> str:
        """The prompt text; a template that refuses the messages raises ``jinja2.TemplateError``."""
        if not messages:
            raise ValueError("an empty conversation has no chat prompt")
        chat = [_template_message(message) for message in messages]
        return self._template.render(**self._special_tokens, messages=chat, tools=tools, documents=None,
                                     add_generation_prompt=add_generation_prompt)


def compile_chat_template(source: str, special_tokens: Mapping[str, str]) -> CompiledChatTemplate:
    """Compile ``source``; a template that does not parse raises ``jinja2.TemplateSyntaxError``."""
    return CompiledChatTemplate(source, special_tokens)
