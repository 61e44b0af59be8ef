"""The shipped embedded default model: tokenizer, chat template contract, and a generation smoke test."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from model_servers.inference_worker import default_model_data as data  # noqa: E402

pytestmark = pytest.mark.unit

MODEL_DIR = Path(data.__file__).resolve().parent / "default_model"


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.fixture(scope="module")
def model():
    m = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL_DIR))
    m.eval()
    return m


@pytest.fixture
def one_thread():
    # a 0.14M-parameter model gains nothing from more threads, and more threads stall on a busy CPU
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _problems(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    return [data.make_problem(rng) for _ in range(n)]


def test_files_and_size():
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (MODEL_DIR / name).is_file(), name
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= 5 * 1024 * 1024
    cfg = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert isinstance(cfg.get("chat_template"), str)


def test_special_tokens_are_single_ids(tok):
    for expected_id, token in enumerate(data.SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(token) == expected_id
        assert tok.encode(f"x{token}y", add_special_tokens=False) == [
            tok.convert_tokens_to_ids("x"),
            expected_id,
            tok.convert_tokens_to_ids("y"),
        ]
    assert tok.pad_token_id == 0
    assert tok.bos_token == data.BOS
    assert tok.unk_token == data.UNK


def test_eos_is_end(tok, model):
    end_id = tok.convert_tokens_to_ids(data.END)
    assert tok.eos_token == data.END
    assert tok.eos_token_id == end_id
    assert model.config.eos_token_id == end_id
    assert model.generation_config.eos_token_id == end_id
    assert model.generation_config.pad_token_id == tok.pad_token_id


def test_round_trip(tok):
    for p in _problems(7, 20):
        text = data.render_example(p) + " two  spaces\nnewline ~{}"
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text
    # every character is one token
    plain = "Lena has 120 apples."
    assert len(tok.encode(plain, add_special_tokens=False)) == len(plain)
    # encode adds nothing (the chat template writes <bos>)
    assert tok.encode("a") == [tok.convert_tokens_to_ids("a")]


def test_chat_template_matches_training_rendering(tok):
    for p in _problems(11, 30):
        messages = data.example_messages(p)
        rendered = tok.apply_chat_template(messages, tools=data.TOOLS, tokenize=False)
        assert rendered == data.render_example(p)
        # arguments given as a dict render the same compact JSON
        messages[1]["tool_calls"][0]["function"]["arguments"] = dict(p["arguments"])
        assert tok.apply_chat_template(messages, tools=data.TOOLS, tokenize=False) == data.render_example(p)
        prompt = tok.apply_chat_template(
            messages[:1], tools=data.TOOLS, add_generation_prompt=True, tokenize=False
        )
        assert prompt == data.render_prompt(p)
        assert data.render_example(p).startswith(prompt)


def test_chat_template_other_roles(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello."},
    ]
    tools = [{"name": "add"}, {"type": "function", "function": {"name": "multiply"}}]
    out = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert out == (
        "<bos><|system|>Tools: add, multiply<|end|><|system|>Be brief.<|end|><|user|>Hi<|end|>"
        "<|assistant|>Hello.<|end|><|assistant|>"
    )
    assert tok.apply_chat_template(messages[:2], tokenize=False) == (
        "<bos><|system|>Be brief.<|end|><|user|>Hi<|end|>"
    )


def test_greedy_tool_calls_well_formed(tok, model, one_thread):
    problems = _problems(4242, 20)
    prompts = [tok.encode(data.render_prompt(p), add_special_tokens=False) for p in problems]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=60, do_sample=False)
    well_formed = 0
    for row in out[:, width:].tolist():
        if tok.eos_token_id not in row:
            continue
        text = tok.decode(row[: row.index(tok.eos_token_id) + 1], skip_special_tokens=False)
        calls = data.parse_tool_calls(text)
        if calls and len(calls) == 1 and calls[0]["name"] in data.TOOL_NAMES:
            well_formed += 1
    assert well_formed >= 18
