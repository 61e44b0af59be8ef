"""Synthetic calculator tool-use chats for the embedded default model.

Pure Python (no torch, no transformers): the build script, the unit tests and the quickstart
dataset all import this module.  Everything is driven by a caller-supplied ``random.Random`` so a
seed fully determines the data.

The chat format is a contract shared with the policy model server and with the chat template
shipped in ``default_model/tokenizer_config.json``::

    <bos><|system|>Tools: add, subtract, multiply<|end|><|user|>{question}<|end|>
    <|assistant|><tool_call>{"name":"multiply","arguments":{"a":97,"b":53}}</tool_call><|end|>
    <|tool|><tool_result>5141</tool_result><|end|><|assistant|>The answer is 5141.<|end|>

(shown wrapped; the real text has no newlines or spaces between the parts).
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

# ----------------------------------------------------------------------------------------------
# Special tokens (ids are fixed by the order here; see build_default_model.py)
# ----------------------------------------------------------------------------------------------
PAD = "<pad>"
BOS = "<bos>"
UNK = "<unk>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
TOOL = "<|tool|>"
END = "<|end|>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"

SPECIAL_TOKENS: tuple[str, ...] = (
    PAD,
    BOS,
    UNK,
    SYSTEM,
    USER,
    ASSISTANT,
    TOOL,
    END,
    TOOL_CALL_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_RESULT_OPEN,
    TOOL_RESULT_CLOSE,
)

TOOL_NAMES: tuple[str, ...] = ("add", "subtract", "multiply")

_TOOL_DESCRIPTIONS = {
    "add": "Return a + b.",
    "subtract": "Return a - b.",
    "multiply": "Return a * b.",
}

#: OpenAI function-tool definitions for the three calculator tools (in the trained order).
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": _TOOL_DESCRIPTIONS[name],
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
    for name in TOOL_NAMES
]

ADD_MAX = 999
MULTIPLY_MAX = 99

# ----------------------------------------------------------------------------------------------
# Question templates: {a} and {b} are the two tool arguments (subtract: a >= b).
# ----------------------------------------------------------------------------------------------
_TEMPLATES: dict[str, tuple[str, ...]] = {
    "add": (
        "What is {a} plus {b}?",
        "Add {a} and {b}.",
        "What is the sum of {a} and {b}?",
        "Compute {a} + {b}.",
        "{name} has {a} {item} and buys {b} more. How many {item} does {pron} have now?",
        "{name} had {a} {item}. A friend gave {obj} {b} more. How many {item} does {name} have?",
        "A shop sold {a} {item} in the morning and {b} in the afternoon. How many {item} were sold?",
    ),
    "subtract": (
        "What is {a} minus {b}?",
        "Subtract {b} from {a}.",
        "Compute {a} - {b}.",
        "{name} has {a} {item} and gives away {b}. How many {item} are left?",
        "{name} had {a} {item} and sold {b} of them. How many {item} does {pron} have left?",
    ),
    "multiply": (
        "What is {a} times {b}?",
        "Multiply {a} by {b}.",
        "What is the product of {a} and {b}?",
        "Compute {a} * {b}.",
        "{name} buys {a} bags of {item} with {b} in each bag. How many {item} is that?",
        "There are {a} rows with {b} {item} in each row. How many {item} are there?",
    ),
}

# (name, subject pronoun, object pronoun)
_NAMES: tuple[tuple[str, str, str], ...] = (
    ("Lena", "she", "her"),
    ("Omar", "he", "him"),
    ("Priya", "she", "her"),
    ("Tom", "he", "him"),
    ("Sofia", "she", "her"),
    ("Kenji", "he", "him"),
    ("Maya", "she", "her"),
    ("Lucas", "he", "him"),
    ("Aisha", "she", "her"),
    ("Ben", "he", "him"),
    ("Nora", "she", "her"),
    ("Diego", "he", "him"),
)

_ITEMS: tuple[str, ...] = (
    "apples",
    "pencils",
    "marbles",
    "stickers",
    "books",
    "cookies",
    "coins",
    "cards",
    "stamps",
    "shells",
    "oranges",
    "balloons",
    "beads",
    "candles",
    "eggs",
    "flowers",
)

NUM_TEMPLATES = sum(len(t) for t in _TEMPLATES.values())


def run_tool(name: str, arguments: dict[str, Any]) -> int:
    """Execute one calculator tool on integer arguments ``a`` and ``b``."""
    a = arguments["a"]
    b = arguments["b"]
    if name == "add":
        return a + b
    if name == "subtract":
        return a - b
    if name == "multiply":
        return a * b
    raise KeyError(f"unknown tool {name!r}")


def make_problem(rng: random.Random) -> dict[str, Any]:
    """Draw one word problem.

    Returns ``{"question", "tool", "a", "b", "arguments", "answer", "template"}``; the operation is
    chosen uniformly among add/subtract/multiply, then a template uniformly within it.
    """
    tool = rng.choice(TOOL_NAMES)
    template_index = rng.randrange(len(_TEMPLATES[tool]))
    template = _TEMPLATES[tool][template_index]
    if tool == "multiply":
        a = rng.randint(0, MULTIPLY_MAX)
        b = rng.randint(0, MULTIPLY_MAX)
    else:
        a = rng.randint(0, ADD_MAX)
        b = rng.randint(0, ADD_MAX)
        if tool == "subtract" and b > a:
            a, b = b, a
    name, pron, obj = rng.choice(_NAMES)
    item = rng.choice(_ITEMS)
    question = template.format(a=a, b=b, name=name, pron=pron, obj=obj, item=item)
    arguments = {"a": a, "b": b}
    return {
        "question": question,
        "tool": tool,
        "a": a,
        "b": b,
        "arguments": arguments,
        "answer": run_tool(tool, arguments),
        "template": f"{tool}/{template_index}",
    }


def tool_call_json(name: str, arguments: dict[str, Any]) -> str:
    """Compact JSON of one call, key order ``name`` then ``arguments``."""
    return json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"), ensure_ascii=False)


def tools_line(tool_names: tuple[str, ...] | list[str] = TOOL_NAMES) -> str:
    return f"{SYSTEM}Tools: {', '.join(tool_names)}{END}"


def render_prompt(problem: dict[str, Any]) -> str:
    """Text up to and including the first ``<|assistant|>`` (what the model sees for turn 1)."""
    return f"{BOS}{tools_line()}{USER}{problem['question']}{END}{ASSISTANT}"


def render_tool_call(problem: dict[str, Any]) -> str:
    """The assistant's first turn body (without the leading ``<|assistant|>``), ending in ``<|end|>``."""
    return f"{TOOL_CALL_OPEN}{tool_call_json(problem['tool'], problem['arguments'])}{TOOL_CALL_CLOSE}{END}"


def render_tool_result(result: Any) -> str:
    """The tool turn plus the next generation prompt ``<|assistant|>``."""
    return f"{TOOL}{TOOL_RESULT_OPEN}{result}{TOOL_RESULT_CLOSE}{END}{ASSISTANT}"


def final_answer_text(answer: int) -> str:
    return f"The answer is {answer}."


def render_example(problem: dict[str, Any]) -> str:
    """One full training conversation as text (special tokens inline, no separators)."""
    return (
        render_prompt(problem)
        + render_tool_call(problem)
        + render_tool_result(problem["answer"])
        + final_answer_text(problem["answer"])
        + END
    )


def example_messages(problem: dict[str, Any], call_id: str = "call_0") -> list[dict[str, Any]]:
    """The same conversation as OpenAI chat messages (for ``apply_chat_template(..., tools=TOOLS)``)."""
    return [
        {"role": "user", "content": problem["question"]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {
                        "name": problem["tool"],
                        "arguments": json.dumps(problem["arguments"], separators=(",", ":")),
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": str(problem["answer"])},
        {"role": "assistant", "content": final_answer_text(problem["answer"])},
    ]


_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def parse_tool_calls(text: str) -> list[dict[str, Any]] | None:
    """Parse every ``<tool_call>{json}</tool_call>`` in an assistant turn.

    Returns a list of ``{"name": str, "arguments": dict}`` or ``None`` if any call is malformed or
    there is text outside the calls (a trailing ``<|end|>`` is allowed).
    """
    body = text.removesuffix(END)
    calls: list[dict[str, Any]] = []
    pos = 0
    for m in _CALL_RE.finditer(body):
        if body[pos : m.start()].strip():
            return None
        pos = m.end()
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            return None
        if (
            not isinstance(obj, dict)
            or not isinstance(obj.get("name"), str)
            or not isinstance(obj.get("arguments"), dict)
        ):
            return None
        calls.append({"name": obj["name"], "arguments": obj["arguments"]})
    if body[pos:].strip() or not calls:
        return None
    return calls
