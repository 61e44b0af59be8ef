"""vLLM's OpenAI surface on the worker: ``/v1/chat/completions``, ``/tokenize``, ``/detokenize``, and
the vLLM token fields of ``/v1/completions``, over ``httpx.ASGITransport`` with a scripted engine."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import openai
import pytest

from model_servers.inference_worker.engine import ChatTemplateRequest
from model_servers.inference_worker.hf_tokenizer import HFTokenizer
from model_servers.inference_worker.model_dir import DEFAULT_MODEL_DIR
from model_servers.inference_worker.tests.conftest import WorkerClient
from model_servers.inference_worker.tests.scripted_engine import EOS, CharTokenizer, ScriptedEngine
from model_servers.inference_worker.tests.test_app import sse_events
from model_servers.policy_model.chat_format import load_chat_format

pytestmark = pytest.mark.unit

TOK = CharTokenizer()
USER = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
#: What vLLM's chat path asks for when NeMo Gym's vllm_model captures token ids.
VLLM_TOKEN_FIELDS = {"logprobs": True, "top_logprobs": 0, "return_tokens_as_token_ids": True,
                     "return_token_ids": True}
CALL_TEXT = '<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>'


def rendered(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **options: Any) -> str:
    return TOK.render_chat(messages, ChatTemplateRequest(tools=tools, **options))


def spelled(text: str) -> list[int]:
    """One id per character, special tokens spelled out (not the canonical encoding)."""
    return [TOK.ids[char] for char in text]


async def chat(http: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    reply = await http.post("/v1/chat/completions", json={"messages": USER, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


async def test_chat_with_vllm_token_fields(worker_client: WorkerClient) -> None:
    engine = ScriptedEngine([*TOK.encode("yo"), EOS])
    async with worker_client(engine, policy_version=4) as http:
        out = await chat(http, max_tokens=8, seed=3, **VLLM_TOKEN_FIELDS)
    prompt = TOK.encode(rendered([{"role": "user", "content": "hi"}]))
    assert engine.admitted[0].prompt_token_ids == tuple(prompt) and engine.admitted[0].max_tokens == 8
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert out["model"] == "nemo-gym-ckpt-tiny" and out["policy_version"] == 4
    assert out["prompt_token_ids"] == prompt
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "yo"}
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == [*TOK.encode("yo"), EOS]
    entries = choice["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{i}" for i in choice["token_ids"]]
    assert [e["logprob"] for e in entries] == [-0.01, -0.02, -0.03]
    assert entries[0]["bytes"] == list(b"token_id:" + str(choice["token_ids"][0]).encode())
    assert all(e["top_logprobs"] == [] for e in entries)
    assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 3, "total_tokens": len(prompt) + 3}


async def test_chat_without_token_fields_is_plain_openai(worker_client: WorkerClient) -> None:
    async with worker_client(ScriptedEngine.from_text("ok")) as http:
        plain = await chat(http, max_tokens=2)
        texts = await chat(http, max_tokens=2, logprobs=True)
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    assert plain["choices"][0]["logprobs"] is None and plain["choices"][0]["finish_reason"] == "length"
    assert [e["token"] for e in texts["choices"][0]["logprobs"]["content"]] == ["o", "k"]


async def test_tool_calls_are_parsed_as_the_policy_model_does(worker_client: WorkerClient) -> None:
    script = [*TOK.encode("Sure." + CALL_TEXT), EOS]
    async with worker_client(ScriptedEngine(script, context_length=256)) as http:
        called = await chat(http, tools=TOOLS, return_token_ids=True)
        refused = await chat(http, tools=TOOLS, tool_choice="none")
        untooled = await chat(http)
    message = called["choices"][0]["message"]
    assert called["choices"][0]["finish_reason"] == "tool_calls" and message["content"] == "Sure."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "add", "arguments": '{"a":1,"b":2}'}
    assert called["prompt_token_ids"] == TOK.encode(rendered([{"role": "user", "content": "hi"}], TOOLS))
    for reply in (refused, untooled):
        assert reply["choices"][0]["message"] == {"role": "assistant", "content": "Sure." + CALL_TEXT}
        assert reply["choices"][0]["finish_reason"] == "stop"


async def test_history_token_ids_are_kept_not_retokenized(
    worker_client: WorkerClient, caplog: pytest.LogCaptureFixture
) -> None:
    first_prompt = TOK.encode(rendered([{"role": "user", "content": "hi"}]))
    generation = [*spelled("yo<|end|>")]  # the model spelled the end marker: not the canonical ids
    assistant = {"role": "assistant", "content": "yo", "prompt_token_ids": first_prompt,
                 "generation_token_ids": generation, "generation_log_probs": [-0.1] * len(generation)}
    history = [*USER, assistant, {"role": "user", "content": "again"}]
    changed = [*USER, {**assistant, "content": "oy"}, {"role": "user", "content": "again"}]
    async with worker_client(ScriptedEngine.from_text("z")) as http:
        kept = await chat(http, messages=history, max_tokens=1, return_token_ids=True)
        with caplog.at_level(logging.WARNING):
            fresh = await chat(http, messages=changed, max_tokens=1, return_token_ids=True)
    text = rendered([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                     {"role": "user", "content": "again"}])
    known = [*first_prompt, *generation]
    assert kept["prompt_token_ids"][: len(known)] == known
    assert kept["prompt_token_ids"] == known + TOK.encode(text[len(TOK.decode(known, skip_special_tokens=False)):])
    assert kept["prompt_token_ids"] != TOK.encode(text)  # a fresh tokenization merges the spelled marker
    assert fresh["prompt_token_ids"] == TOK.encode(text.replace("A:yo", "A:oy"))
    assert "do not decode to the start of the rendered prompt" in caplog.text


async def test_required_prefix_token_ids(worker_client: WorkerClient) -> None:
    spelled_bos = spelled("<bos>")
    async with worker_client(ScriptedEngine.from_text("z")) as http:
        kept = await chat(http, max_tokens=1, return_token_ids=True, required_prefix_token_ids=spelled_bos)
        tokenized = (await http.post("/tokenize", json={"messages": USER,
                                                         "required_prefix_token_ids": spelled_bos})).json()
        wrong = await http.post("/v1/chat/completions", json={"messages": USER,
                                                              "required_prefix_token_ids": spelled("<|user|>")})
    assert kept["prompt_token_ids"][:5] == spelled_bos == tokenized["tokens"][:5]
    assert kept["prompt_token_ids"] == tokenized["tokens"]
    assert wrong.status_code == 400 and "required_prefix_token_ids" in wrong.json()["error"]["detail"]


async def test_chat_template_options(worker_client: WorkerClient) -> None:
    prefill = [*USER, {"role": "assistant", "content": "Hm"}]
    async with worker_client(ScriptedEngine.from_text("z")) as http:
        thinking = await chat(http, max_tokens=1, return_token_ids=True, chat_template_kwargs={"think": True})
        continued = await chat(http, messages=prefill, max_tokens=1, return_token_ids=True,
                               add_generation_prompt=False, continue_final_message=True)
    assert TOK.decode(thinking["prompt_token_ids"], skip_special_tokens=False).startswith("<bos>think=1;<|user|>")
    assert TOK.decode(continued["prompt_token_ids"], skip_special_tokens=False).endswith("<|end|>A:Hm")


async def test_chat_streaming_matches_the_whole_reply(worker_client: WorkerClient) -> None:
    script = [*TOK.encode("Sure." + CALL_TEXT), EOS]
    async with worker_client(ScriptedEngine(script, context_length=256)) as http:
        whole = await chat(http, **VLLM_TOKEN_FIELDS)
        plain = sse_events((await http.post("/v1/chat/completions", json={
            "messages": USER, "stream": True, "stream_options": {"include_usage": True}, **VLLM_TOKEN_FIELDS,
        })).content)
        tooled = sse_events((await http.post("/v1/chat/completions", json={
            "messages": USER, "stream": True, "tools": TOOLS})).content)
    assert plain[-1] == "[DONE]" and tooled[-1] == "[DONE]"
    first, *middle, usage = plain[:-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["prompt_token_ids"] == whole["prompt_token_ids"]
    assert "".join(c["choices"][0]["delta"]["content"] for c in middle) == "Sure." + CALL_TEXT
    assert [i for c in middle for i in c["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]
    tokens = [e["token"] for c in middle for e in c["choices"][0]["logprobs"]["content"]]
    assert tokens == [e["token"] for e in whole["choices"][0]["logprobs"]["content"]]
    assert middle[-1]["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    last = tooled[-2]["choices"][0]
    assert last["finish_reason"] == "tool_calls" and last["delta"]["content"] == "Sure."
    assert last["delta"]["tool_calls"][0]["function"]["name"] == "add" and last["delta"]["tool_calls"][0]["index"] == 0
    assert all(c["choices"][0]["delta"] == {} for c in tooled[1:-2])  # content held until the calls are known


async def test_the_openai_client_reads_the_vllm_fields(worker_client: WorkerClient) -> None:
    async with worker_client(ScriptedEngine([*TOK.encode("yo"), EOS])) as http:
        client = openai.AsyncOpenAI(base_url="http://worker/v1", api_key="-", http_client=http, max_retries=0)
        done = await client.chat.completions.create(
            model="nemo-gym-ckpt-tiny", messages=[{"role": "user", "content": "hi"}], logprobs=True,
            top_logprobs=0, extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
        )
        models = await client.models.list()
    choice = done.choices[0]
    assert choice.message.content == "yo" and choice.logprobs is not None and choice.logprobs.content is not None
    assert [entry.token for entry in choice.logprobs.content] == [f"token_id:{i}" for i in [*TOK.encode("yo"), EOS]]
    assert (choice.model_extra or {})["token_ids"] == [*TOK.encode("yo"), EOS]
    assert (done.model_extra or {})["prompt_token_ids"] == TOK.encode(rendered([{"role": "user", "content": "hi"}]))
    assert [m.id for m in models.data] == ["nemo-gym-ckpt-tiny"]


async def test_completions_token_id_strings_and_special_tokens(worker_client: WorkerClient) -> None:
    class BosTokenizer(CharTokenizer):
        def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
            return [1, *super().encode(text)] if add_special_tokens else super().encode(text)

    engine = ScriptedEngine(TOK.encode("ab"), tokenizer=BosTokenizer())
    async with worker_client(engine) as http:
        ids = (await http.post("/v1/completions", json={
            "prompt": "Hi", "max_tokens": 2, "logprobs": 0, "return_tokens_as_token_ids": True,
            "return_token_ids": True})).json()["choices"][0]
        bare = (await http.post("/v1/completions", json={
            "prompt": "Hi", "max_tokens": 2, "add_special_tokens": False, "return_token_ids": True})).json()
    assert ids["prompt_token_ids"] == [1, *TOK.encode("Hi")]
    assert ids["logprobs"]["tokens"] == [f"token_id:{i}" for i in TOK.encode("ab")]
    assert ids["logprobs"]["token_logprobs"] == [-0.01, -0.02]
    assert bare["choices"][0]["prompt_token_ids"] == TOK.encode("Hi")


async def test_tokenize_and_detokenize(worker_client: WorkerClient) -> None:
    async with worker_client(ScriptedEngine.from_text("yo")) as http:
        text = (await http.post("/tokenize", json={"prompt": "Hi<|end|>", "return_token_strs": True})).json()
        as_chat = (await http.post("/tokenize", json={"model": "nemo-gym-ckpt-tiny", "messages": USER,
                                                       "tools": TOOLS, "chat_template_kwargs": {}})).json()
        generated = await chat(http, tools=TOOLS, max_tokens=1, return_token_ids=True)
        back = (await http.post("/detokenize", json={"tokens": as_chat["tokens"]})).json()
    assert text == {"count": 3, "max_model_len": 64, "tokens": TOK.encode("Hi<|end|>"),
                    "token_strs": ["H", "i", "<|end|>"]}
    assert as_chat["tokens"] == generated["prompt_token_ids"] and as_chat["count"] == len(as_chat["tokens"])
    assert as_chat["token_strs"] is None
    assert back == {"prompt": rendered([{"role": "user", "content": "hi"}], TOOLS)}


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "'image_url' is not supported"),
    ({"messages": [{"role": "user", "content": "x", "prompt_token_ids": [1], "generation_token_ids": [2]}]},
     "only accepted on assistant"),
    ({"messages": [{"role": "assistant", "content": "x", "prompt_token_ids": [1]}]}, "come together"),
    ({"messages": [{"role": "assistant", "content": "x", "prompt_token_ids": [1],
                    "generation_token_ids": [500]}]}, "outside the vocabulary"),
    ({"messages": [{"role": "system", "content": "refuse"}]}, "the chat template refused"),
    ({"top_logprobs": 2, "logprobs": True}, "top-k logprobs are not implemented"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"tool_choice": "required", "tools": TOOLS}, "tool_choice 'required' is not supported"),
    ({"n": 2}, "n=2"),
    ({"frobnicate": 1}, "unknown field 'frobnicate'"),
    ({"chat_template": "{{ 'x' }}"}, "'chat_template'"),
    ({"chat_template_kwargs": {"tools": []}}, "may not set ['tools']"),
    ({"chat_template_kwargs": {f"k{i}": i for i in range(33)}}, "at most 32"),
    ({"continue_final_message": True}, "cannot both be true"),
    ({"required_prefix_token_ids": [-1]}, "required_prefix_token_ids"),
    ({"max_tokens": 60}, "exceeds the model's context length of 64"),
    ({"messages": [{"role": "user", "content": "x" * 70}]}, "context length"),
    ({"temperature": -1}, "temperature"),
    ({"stream": "yes please"}, "stream"),
]


@pytest.mark.parametrize(("patch", "needle"), BAD_CHATS)
async def test_bad_chat_bodies_are_400(worker_client: WorkerClient, patch: dict[str, Any], needle: str) -> None:
    async with worker_client(ScriptedEngine.from_text("a")) as http:
        reply = await http.post("/v1/chat/completions", json={"messages": USER, **patch})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "invalid_request" and needle in reply.json()["error"]["detail"]


BAD_TOKENIZE = [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ("/tokenize", {"messages": USER, "chat_template": "{{ 'x' }}"}, "chat_template"),
    ("/tokenize", {"messages": USER, "mm_processor_kwargs": {"a": 1}}, "mm_processor_kwargs"),
    ("/tokenize", {"messages": USER, "add_generation_prompt": True, "continue_final_message": True},
     "cannot both be true"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/detokenize", {"tokens": [1, 999]}, "outside the vocabulary"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
    ("/detokenize", {}, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "needle"), BAD_TOKENIZE)
async def test_bad_tokenize_bodies_are_400(worker_client: WorkerClient, path: str, body: dict[str, Any],
                                           needle: str) -> None:
    async with worker_client(ScriptedEngine.from_text("a")) as http:
        reply = await http.post(path, json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "invalid_request" and needle in reply.json()["error"]["detail"]


async def test_garbage_and_other_models(worker_client: WorkerClient) -> None:
    as_json = {"content-type": "application/json"}
    async with worker_client(ScriptedEngine.from_text("a")) as http:
        replies = [
            await http.post("/tokenize", content=b"{nope", headers=as_json),
            await http.post("/tokenize", json=[1]),
            await http.post("/detokenize", content=b"\x00\xff", headers=as_json),
            await http.post("/v1/chat/completions", content=b"[", headers=as_json),
        ]
        others = [
            await http.post("/tokenize", json={"model": "gpt-9", "prompt": "x"}),
            await http.post("/detokenize", json={"model": "gpt-9", "tokens": [5]}),
            await http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": USER}),
        ]
    assert [r.status_code for r in replies] == [400, 400, 400, 400]
    assert all(r.json()["error"]["code"] == "invalid_request" for r in replies)
    assert [r.status_code for r in others] == [404, 404, 404]
    assert all("gpt-9" in r.json()["error"]["detail"] for r in others)


async def test_the_default_model_renders_as_the_policy_model_does(worker_client: WorkerClient) -> None:
    """The real template of the embedded model: the worker's chat prompt is the policy model's."""
    tokenizer = HFTokenizer.load(DEFAULT_MODEL_DIR)
    fmt = load_chat_format(DEFAULT_MODEL_DIR)
    history = [
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    calculator = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
                  for name in ("add", "subtract", "multiply")]
    script = tokenizer.encode('<tool_call>{"name":"add","arguments":{"a":5,"b":1}}</tool_call><|end|>',
                              add_special_tokens=False)
    async with worker_client(ScriptedEngine(script, tokenizer=tokenizer, context_length=512)) as http:
        out = await chat(http, messages=history, tools=calculator, return_token_ids=True)
        counted = (await http.post("/tokenize", json={"messages": history, "tools": calculator})).json()
    expected = fmt.encode(fmt.render(history, calculator))
    assert out["prompt_token_ids"] == expected == counted["tokens"]
    message = out["choices"][0]["message"]
    assert message["content"] is None and out["choices"][0]["finish_reason"] == "tool_calls", out
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 5, "b": 1}
