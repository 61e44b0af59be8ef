"""What one model call is asked for and what it produced, independent of the wire format.

The chat and Responses routes both turn their request into a ``ChatCall`` (OpenAI chat messages,
chat-format tools, sampling) and their reply out of a ``ChatResult``; the backends (inference
worker or external upstream) only ever see these two shapes. A streaming call yields
``StreamStarted``, then ``TextDelta`` pieces, then the final ``ChatResult``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from nemo_gym_ckpt.capture import CAPTURE_FIELDS

__all__ = [
    "MODEL_CALL_HEADER",
    "TOKEN_FIELDS",
    "ChatCall",
    "ChatResult",
    "CutContinuation",
    "FinishReason",
    "ModelCallRef",
    "Sampling",
    "StreamEvent",
    "StreamStarted",
    "TextDelta",
    "TokenCapture",
    "ToolCall",
]

FinishReason = Literal["stop", "length", "tool_calls"]

#: The reply header naming the call in the capture ledger (only while checkpointing is on).
MODEL_CALL_HEADER = "x-nemo-gym-model-call-id"

#: The token capture fields, in the order they are written on a chat message or output item.
TOKEN_FIELDS = CAPTURE_FIELDS


@dataclass(frozen=True)
class Sampling:
    """Sampling settings after the server defaults are applied."""

    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelCallRef:
    """The call as the worker knows it for generation cuts: its id and its lineage at admission."""

    model_call_id: str
    parent_call_id: str | None
    previous_length: int

    def to_json(self) -> dict[str, Any]:
        return {"model_call_id": self.model_call_id, "parent_call_id": self.parent_call_id,
                "previous_length": self.previous_length}


@dataclass(frozen=True)
class CutContinuation:
    """A staged prefix the call continues from (a generation cut matched after a restore)."""

    staging_keys: tuple[str, ...]
    source_call_id: str
    prefix_token_count: int
    prefix_digest: str
    effective_output_limit: int

    def to_json(self) -> dict[str, Any]:
        return {"staging_keys": list(self.staging_keys), "source_call_id": self.source_call_id,
                "prefix_token_count": self.prefix_token_count, "prefix_digest": self.prefix_digest,
                "effective_output_limit": self.effective_output_limit}


@dataclass(frozen=True)
class ChatCall:
    """One generation request: chat messages (token fields kept on assistant turns) and tools."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    sampling: Sampling
    tool_choice: Literal["auto", "none"] = "auto"
    want_tokens: bool = False
    #: When set and ``sampling.seed`` is None, the backend derives the seed from this scope (the
    #: rollout id) and the prompt digest (``ids.call_seed``); set only while checkpointing is on.
    seed_scope: str | None = None
    #: Set only with generation cuts on: the call's id and lineage, and a staged prefix to continue.
    model_call: ModelCallRef | None = None
    continuation: CutContinuation | None = None
    #: Set only while checkpointing is on, for a call of a restored rollout whose last assistant turn
    #: came without token fields: prompt + generation ids of the calls its earlier attempts delivered
    #: (from the token sidecar), latest first, to splice the prompt from (``token_splice``).
    ledger_prefixes: tuple[list[int], ...] = ()

    @property
    def parse_tool_calls(self) -> bool:
        """Tool calls are parsed out of the text only when tools were offered and not refused."""
        return bool(self.tools) and self.tool_choice == "auto"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str

    def to_chat(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class TokenCapture:
    """Exact token ids and logprobs of one call, for training (NeMo Gym ``...ForTraining`` fields)."""

    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    policy_version: int | str | None = None

    def to_fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in TOKEN_FIELDS}


@dataclass(frozen=True)
class ChatResult:
    """The assistant turn one call produced."""

    content: str
    tool_calls: list[ToolCall]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    digest: str
    capture: TokenCapture | None = None
    #: What the capture ledger records (``ids.sha256_of``): the prompt and generated token ids on
    #: our worker (and upstream with token capture), else the messages sent and the reply.
    prompt_digest: str = ""
    output_digest: str = ""
    policy_version: int | str | None = None
    #: The capture ledger's id of the call (checkpointing on): the ``x-nemo-gym-model-call-id`` header.
    model_call_id: str | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class StreamStarted:
    """The backend accepted the call; ``digest`` names the prompt (stable ids before any token)."""

    digest: str
    model_call_id: str | None = None


@dataclass(frozen=True)
class TextDelta:
    text: str


StreamEvent = StreamStarted | TextDelta | ChatResult
