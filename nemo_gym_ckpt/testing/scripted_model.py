"""A scripted policy model: the real ``POST /v1/responses`` route, answers chosen by a Python policy.

The policy sees the request body and answers the output items of one model call; the app wraps
them in a Responses object (id, status, ``incomplete_details``, ``usage``) as the policy model server
does, stamps token capture fields on every item when the request asks for ``return_token_ids``,
and records every request with the capture key it arrived under, so tests can check what an agent
sent.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request

from nemo_gym_ckpt.identity import current_identity
from nemo_gym_ckpt.server import create_app

__all__ = [
    "ModelCall",
    "ScriptedModel",
    "calculator_policy",
    "function_call",
    "last_user_text",
    "message",
    "nim_policy",
]

Policy = Callable[[dict[str, Any]], list[dict[str, Any]]]
_IDS = itertools.count(1)


def message(text: str) -> dict[str, Any]:
    return {
        "id": f"msg_{next(_IDS)}", "type": "message", "role": "assistant", "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def function_call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    number = next(_IDS)
    return {"id": f"fc_{number}", "type": "function_call", "call_id": call_id or f"call_{number}",
            "name": name, "arguments": text, "status": "completed"}


def last_user_text(body: dict[str, Any]) -> str:
    items = body["input"]
    if isinstance(items, str):
        return items
    for item in reversed(items):
        if item.get("role") == "user":
            content = item["content"]
            return content if isinstance(content, str) else "".join(part["text"] for part in content)
    return ""


def calculator_policy(problems: dict[str, dict[str, Any]]) -> Policy:
    """Calls the problem's tool, then answers "The answer is <tool output>." (always right)."""

    def policy(body: dict[str, Any]) -> list[dict[str, Any]]:
        last = body["input"][-1] if isinstance(body["input"], list) else {}
        if last.get("type") == "function_call_output":
            return [message(f"The answer is {last['output']}.")]
        problem = problems[last_user_text(body)]
        return [function_call(problem["tool"], problem["arguments"])]

    return policy


def nim_policy(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Plays Nim perfectly for max_take 3: leaves a multiple of 4 (else takes 1)."""
    stones = int(re.findall(r"(\d+) stones left", last_user_text(body))[-1])
    take = stones % 4 or 1
    return [message(f"I take {take}.")]


@dataclass
class ModelCall:
    capture_key: str | None
    body: dict[str, Any]


@dataclass
class ScriptedModel:
    """The app and what it has seen."""

    policy: Policy
    incomplete: bool = False
    calls: list[ModelCall] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = create_app("policy_model")
        app.add_api_route("/v1/responses", self.responses, methods=["POST"])
        return app

    async def responses(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        identity = current_identity()
        self.calls.append(ModelCall(identity.capture_key if identity else None, body))
        output = self.policy(body)
        if body.get("return_token_ids"):
            output = [{**item, **_token_fields(len(self.calls))} for item in output]
        return _response(output, self.incomplete, len(self.calls), body)


def _token_fields(call: int) -> dict[str, Any]:
    return {"prompt_token_ids": [1, 2, call], "generation_token_ids": [call, 7],
            "generation_log_probs": [-0.5, -0.25], "policy_version": 0}


def _response(output: list[dict[str, Any]], incomplete: bool, call: int, body: dict[str, Any]) -> dict[str, Any]:
    """A whole Responses object (every field NeMo Gym's response model requires, as the policy model
    answers them)."""
    return {
        "id": f"resp_{call}", "object": "response", "model": "scripted", "created_at": 0,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "output": output,
        "usage": {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 3,
                  "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 13},
    }
