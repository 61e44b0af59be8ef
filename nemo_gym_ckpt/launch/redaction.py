"""Redacting the secrets of a config before the head server serves it.

A key is *secret* (``is_secret_key``) when its last word, after ``-``, ``.``, spaces and camelCase
become ``_``, names a credential: ``token``, ``secret``, ``password``, ``passwd``, ``passphrase``,
``credential``, ``authorization``, ``auth``, ``cookie``, ``headers`` (and the plurals and joined
forms, ``apikey``, ``hf_tokens``). A token of a tokenizer is none (``eos_token``, ``pad_token``,
``abstention_token``), nor is a count or a list of ids (``max_tokens``, ``token_ids``,
``tokenizer``) or a single header (``prompt_header``). ``key`` is secret alone, and ``key`` or
``keys`` after a word that makes it a credential (``api_key``, ``X-Api-Key``, ``secret_key``,
``AWS_SECRET_ACCESS_KEY``, ``private_key``, ``api_keys``) or names a service that issues one
(``hf_key``, ``openai_key``, ``wandb_key``). A ``*_key`` after a word that names data (``answer_key``,
``label_key``, ``sort_key``, ``primary_key``, ``input_key``: ``_FIELD_QUALIFIERS``) names a field, a
column or a setting and is served as it is, unless its value has a credential's shape (one word of
20 or more characters holding letters and digits); any other ``*_key`` (``webhook_key``,
``stripe_key``) holding text is taken for a credential, as nothing says it is not (a number under it,
``max_keys: 256``, is none).

``redacted`` replaces the whole value of a secret key (a string, a list, a mapping) by ``REDACTED``,
a ``true``/``false`` switch excepted. In every other string it replaces each known secret (what
``secret_values`` collects: a string held directly under a secret key, or in a list held there, and
the credential of an ``Authorization: Scheme credential`` value; one under 8 characters only where
it is the whole string) and the userinfo of a URL that carries a password (``https://user:pw@host``)
or a user as long as an access token (``https://ghp_...@host``; ``git+ssh://git@host`` is kept).
A ``host`` value is never changed, so discovery still finds every server. The work is linear in the
length of the strings.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["REDACTED", "is_secret_key", "redacted", "secret_values"]

REDACTED = "<redacted>"
_SECRET_WORDS = frozenset({
    "token", "secret", "secrets", "password", "passwords", "passwd", "passphrase", "credential",
    "credentials", "headers", "authorization", "auth", "cookie", "cookies", "apikey", "apikeys",
    "apitoken", "apitokens", "authtoken", "accesstoken", "bearer", "secretkey", "accesskey", "privatekey",
})
_AUTHORIZATION_WORDS = frozenset({"authorization", "auth"})
"""The last words of a key whose value may be ``Scheme credential`` (``Bearer sk-...``)."""
_QUALIFIED_WORDS = frozenset({"key", "keys", "tokens"})
"""Last words that name a credential only after a word that says so (``api_key``, ``hf_tokens``)."""
_CREDENTIAL_QUALIFIERS = frozenset({
    "api", "auth", "access", "refresh", "bearer", "session", "secret", "private", "hf", "hub", "client",
    "service", "signing", "encryption", "ssh", "bot", "personal", "user", "admin", "master", "license",
    "subscription", "hmac", "jwt", "account", "deploy", "gpg", "pgp",
})
_KEY_ISSUERS = frozenset({
    "openai", "anthropic", "azure", "aws", "gcp", "google", "gemini", "cohere", "mistral", "groq", "together",
    "wandb", "ngc", "nvidia", "nvapi", "huggingface", "github", "gitlab", "slack",
})
"""Services whose name before ``key`` means their credential (``openai_key``, ``wandb_key``)."""
_KEY_QUALIFIERS = _CREDENTIAL_QUALIFIERS | _KEY_ISSUERS
"""Words before ``key``/``keys``/``tokens`` that make them credentials (``api_key``, ``api_keys``,
``openai_key``; not ``answer_key``, ``max_tokens``)."""
_FIELD_QUALIFIERS = frozenset({
    "answer", "answers", "label", "labels", "sort", "primary", "foreign", "input", "output", "target", "gold",
    "reference", "truth", "expected", "question", "problem", "prompt", "response", "completion", "solution",
    "instruction", "context", "query", "choice", "choices", "option", "options", "id", "cache", "group",
    "dedup", "partition", "shard", "dataset", "column", "field", "metric", "reward", "score", "result",
    "task", "split", "name", "text", "message", "messages", "data", "row", "record", "index", "lookup",
    "join", "dict", "map", "state", "category", "metadata", "tool", "rubric", "verifier", "env", "config",
    "max", "min", "num", "required", "optional", "allowed", "extra", "by", "include", "exclude", "ignore",
    "ignored", "unique", "sorted", "keep", "drop", "rng", "random", "seed",
})
"""Words before ``key``/``keys`` that make them a field's name, no credential (``answer_key``)."""
_VOCABULARY_QUALIFIERS = frozenset({
    "eos", "bos", "pad", "unk", "sep", "cls", "mask", "eot", "eom", "boi", "eoi", "special", "start",
    "end", "stop", "begin", "think", "image", "video", "audio", "placeholder", "abstention",
})
"""Words before ``token`` that make it a token of a tokenizer's vocabulary (``eos_token``), no secret."""
_HOST_WORD = "host"
_CREDENTIAL_SHAPE = re.compile(r"(?=\S*[A-Za-z])(?=\S*[0-9])\S{20,}")
"""A value a field's ``*_key`` is still redacted for: one word of 20 or more characters with letters
and digits (an access token's shape; ``expected_answer``, ``problem_id`` are not)."""
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_SEPARATORS = re.compile(r"[^a-z0-9]+")
_MIN_EMBEDDED = 8
"""A known secret this long or longer is redacted wherever it occurs inside a string; a shorter one
(``EMPTY``, ``dummy``: placeholders, not credentials) only where it is the whole value."""
_URL_PASSWORD = re.compile(r"(?<=://)(?:[^/?#@:\s]*:[^/?#\s]+|[A-Za-z0-9_~.%-]{16,})@")
"""The userinfo right after a URL's ``://`` that is a credential: ``user:password@``, or a user alone as
long as an access token (``https://ghp_...@github.com``; ``git@`` is kept). Tried only where ``://``
precedes, so linear."""


def is_secret_key(key: object) -> bool:
    """Whether a config key names a secret: ``api_key``, ``hf-token``, ``X-Api-Key``, ``api_keys``,
    ``Authorization``, ``client_secret``, ``otlp_headers``, ``password``... (``max_tokens``,
    ``eos_token``, ``prompt_header``, ``answer_key`` are not)."""
    words = _words(key)
    if not words:
        return False
    last, before = words[-1], words[-2] if len(words) > 1 else ""
    if last == "token":
        return before not in _VOCABULARY_QUALIFIERS
    if last == "key" and not before:
        return True  # a bare ``key``: nothing says it is anything but a credential
    if last in _SECRET_WORDS:
        return True
    if last in ("key", "keys") and before:
        return before not in _FIELD_QUALIFIERS or before in _KEY_QUALIFIERS
    return last in _QUALIFIED_WORDS and before in _KEY_QUALIFIERS


def _is_secret_item(key: object, value: Any) -> bool:
    """Whether ``key: value`` holds a secret: a secret key, but a ``*_key`` no credential word names
    (``webhook_key``) only with text in it (``max_keys: 256`` is a count), and a field's ``*_key``
    (``answer_key``) only with a value of a credential's shape."""
    words = _words(key)
    named_key = len(words) > 1 and words[-1] in ("key", "keys")
    if is_secret_key(key):
        return not named_key or words[-2] in _KEY_QUALIFIERS or bool(_held_strings(value, scheme_first=False))
    if not named_key:
        return False
    strings = _held_strings(value, scheme_first=False)
    return any(_CREDENTIAL_SHAPE.fullmatch(text.strip()) for text in strings)


def secret_values(value: Any) -> frozenset[str]:
    """The strings held directly under a secret key anywhere in ``value`` (or in a list held there),
    and the credential alone of an authorization value ``Scheme credential``: the strings ``redacted``
    looks for in every other string."""
    found: set[str] = set()
    if isinstance(value, Mapping):
        for key, item in value.items():
            if _is_secret_item(key, item):
                found |= _held_strings(item, scheme_first=_words(key)[-1] in _AUTHORIZATION_WORDS)
            found |= secret_values(item)
    elif isinstance(value, list):
        for item in value:
            found |= secret_values(item)
    return frozenset(found)


def redacted(value: Any, secrets: frozenset[str] = frozenset()) -> Any:
    """``value`` with the whole value of every secret key replaced by ``REDACTED``, and in every other
    string (a ``host`` excepted) each of ``secrets`` and the userinfo of a URL with a password."""
    return _redacted(value, _KnownSecrets(secrets))


def _words(key: object) -> list[str]:
    return [word for word in _SEPARATORS.split(_CAMEL.sub("_", str(key)).lower()) if word]


def _held_strings(value: Any, *, scheme_first: bool) -> set[str]:
    """The non-empty strings of ``value`` or of the lists it holds (not of a mapping: its own keys
    say which of its values are secrets)."""
    if isinstance(value, list):
        return set().union(*(_held_strings(item, scheme_first=scheme_first) for item in value))
    if not isinstance(value, str) or not value:
        return set()
    scheme, _, credential = value.strip().partition(" ")
    credential = credential.strip()
    if scheme_first and scheme.isalpha() and credential and " " not in credential:
        return {value, credential}  # "Bearer sk-...": the credential alone is a secret too
    return {value}


class _KnownSecrets:
    """Known secret strings: a pattern for those long enough to be looked for inside other strings."""

    def __init__(self, secrets: frozenset[str]) -> None:
        self.exact = frozenset(secret for secret in secrets if secret)
        embedded = sorted((s for s in self.exact if len(s) >= _MIN_EMBEDDED), key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, embedded))) if embedded else None

    def scrub(self, text: str) -> str:
        if text in self.exact:
            return REDACTED
        if self.pattern is not None:
            text = self.pattern.sub(REDACTED, text)
        return _URL_PASSWORD.sub(f"{REDACTED}@", text) if "://" in text else text


def _redacted(value: Any, secrets: _KnownSecrets) -> Any:
    if isinstance(value, Mapping):
        return {key: _redacted_item(key, value[key], secrets) for key in value}
    if isinstance(value, list):
        return [_redacted(item, secrets) for item in value]
    if isinstance(value, str):
        return secrets.scrub(value)
    return value


def _redacted_item(key: object, value: Any, secrets: _KnownSecrets) -> Any:
    if _is_secret_item(key, value) and _holds_secret(value):
        return REDACTED
    if isinstance(value, str) and _words(key)[-1:] == [_HOST_WORD]:
        return value  # an address, never a secret: discovery builds each server's URL from it
    return _redacted(value, secrets)


def _holds_secret(value: Any) -> bool:
    """Anything but an unset value or a switch (``use_auth_token: true`` holds no credential)."""
    return value is not None and not isinstance(value, bool)
