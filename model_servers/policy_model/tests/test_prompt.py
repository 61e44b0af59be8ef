"""The chat format (rendering through the tokenizer's template) and prompt ids from known ids."""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import pytest

from model_servers.inference_worker import default_model_data as data
from model_servers.inference_worker.model_dir import DEFAULT_MODEL_DIR
from model_servers.policy_model.chat_format import ChatFormat, load_chat_format
from model_servers.policy_model.token_splice import known_prefix, prompt_ids
from nemo_gym_ckpt.errors import ConfigError, InvalidRequest

pytestmark = pytest.mark.unit


@pytest.fixture
def problem() -> dict:
    return data.make_problem(random.Random(3))


def test_rendering_follows_the_default_model_contract(fmt: ChatFormat, problem: dict) -> None:
    messages = data.example_messages(problem)
    assert fmt.render(messages[:1], data.TOOLS) == data.render_prompt(problem)
    expected = (
        data.render_prompt(problem)
        + data.render_tool_call(problem)
        + data.render_tool_result(problem["answer"])
    )
    assert fmt.render(messages[:3], data.TOOLS) == expected
    assert (
        fmt.render(messages[:1], None)
        == f"{data.BOS}{data.USER}{problem['question']}{data.END}{data.ASSISTANT}"
    )


def test_encode_decode_round_trip_with_tags_as_single_ids(fmt: ChatFormat) -> None:
    text = '<bos><|user|>hi<|end|><|assistant|><tool_call>{"a":1}</tool_call><|end|>'
    ids = fmt.encode(text)
    assert fmt.decode(ids) == text
    assert ids[0] == data.SPECIAL_TOKENS.index(data.BOS)
    assert data.SPECIAL_TOKENS.index(data.TOOL_CALL_OPEN) in ids
    assert fmt.eos_text == data.END
    assert fmt.context_length == 256


def test_known_prefix_is_the_last_assistant_turn_with_ids() -> None:
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "prompt_token_ids": [1, 2], "generation_token_ids": [3]},
        {"role": "tool", "content": "r"},
        {
            "role": "assistant",
            "content": "b",
            "prompt_token_ids": [1, 2, 3, 4],
            "generation_token_ids": [5, 6],
        },
        {"role": "assistant", "content": "no ids"},
        {"role": "user", "content": "more"},
    ]
    assert known_prefix(messages) == [1, 2, 3, 4, 5, 6]
    assert known_prefix(messages[:1]) is None


def _first_turn(fmt: ChatFormat, problem: dict) -> tuple[list[dict], list[int]]:
    """The first turn's ids as the model generated them: the tool-call tags spelled out character by
    character, which decodes to the same text as the single-id tags a fresh encoding would give."""
    messages = data.example_messages(problem)
    prompt = fmt.encode(fmt.render(messages[:1], data.TOOLS))
    spelled = [fmt.encode(ch)[0] for ch in data.render_tool_call(problem).removesuffix(data.END)]
    generation = [*spelled, fmt.encode(data.END)[0]]
    assistant = {**messages[1], "prompt_token_ids": prompt, "generation_token_ids": generation}
    return [messages[0], assistant, messages[2]], prompt + generation


def test_next_prompt_starts_with_the_known_ids_exactly(fmt: ChatFormat, problem: dict) -> None:
    messages, known = _first_turn(fmt, problem)
    text = fmt.render(messages, data.TOOLS)
    spliced = prompt_ids(fmt, text, known_prefix(messages))
    assert spliced.ids[: len(known)] == known  # never re-tokenized
    assert spliced.reused == len(known)
    assert spliced.ids != fmt.encode(text)  # a fresh encoding would have merged the tags
    assert fmt.decode(spliced.ids) == text
    assert fmt.decode(spliced.ids[len(known) :]) == data.render_tool_result(problem["answer"])


def test_known_ids_that_disagree_with_the_conversation_are_not_used(
    fmt: ChatFormat, problem: dict, caplog: pytest.LogCaptureFixture
) -> None:
    messages, known = _first_turn(fmt, problem)
    tampered = [*known[:-3], fmt.encode("9")[0], *known[-2:]]
    messages[1] = {**messages[1], "generation_token_ids": tampered[len(messages[1]["prompt_token_ids"]) :]}
    text = fmt.render(messages, data.TOOLS)
    with caplog.at_level(logging.WARNING):
        spliced = prompt_ids(fmt, text, known_prefix(messages))
    assert spliced.ids == fmt.encode(text)
    assert spliced.reused == 0
    assert "afresh" in caplog.text


def test_known_ids_outside_the_vocabulary_are_refused(fmt: ChatFormat) -> None:
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        prompt_ids(fmt, "<bos>", [1, fmt.vocab_size])


def test_a_folder_without_tokenizer_or_template_is_a_config_error(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    with pytest.raises(ConfigError, match="cannot load a tokenizer"):
        load_chat_format(tmp_path)
    bare = tmp_path / "bare"
    shutil.copytree(tokenizer_dir, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="no chat_template"):
        load_chat_format(bare)


def test_the_test_tokenizer_matches_the_shipped_default_model(fmt: ChatFormat) -> None:
    shipped = load_chat_format(DEFAULT_MODEL_DIR)
    rng = random.Random(5)
    for _ in range(5):
        problem = data.make_problem(rng)
        messages = [{"role": "developer", "content": "Be exact."}, *data.example_messages(problem)]
        messages[2] = {**messages[2], "content": "Let me see."}
        for tools in (data.TOOLS, None):
            text = fmt.render(messages, tools)
            assert shipped.render(messages, tools) == text
            assert shipped.encode(text) == fmt.encode(text)
    assert (shipped.eos_text, shipped.vocab_size, shipped.context_length) == (
        fmt.eos_text,
        fmt.vocab_size,
        fmt.context_length,
    )
