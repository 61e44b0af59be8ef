"""The worker's HTTP layer over ``httpx.ASGITransport``, with a scripted engine behind it."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from model_servers.inference_worker.app import Config, _unless_disconnected, staging_dir
from model_servers.inference_worker.sampling import derive_seed
from model_servers.inference_worker.tests.conftest import TOKEN, WorkerClient, make_ctx
from model_servers.inference_worker.tests.scripted_engine import EOS, CharTokenizer, ScriptedEngine
from nemo_gym_ckpt.bounds import MAX_TOKENS
from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.context import ServerContext
from nemo_gym_ckpt.errors import ConfigError, InvalidRequest

pytestmark = pytest.mark.unit

TOK = CharTokenizer()
HELLO = TOK.encode("Hello")


def sse_events(body: bytes) -> list[Any]:
    events = []
    for block in body.decode().split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            payload = block[len("data: ") :]
            events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


async def complete(http: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    reply = await http.post("/v1/completions", json={"prompt": HELLO, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


async def test_completion_shape(worker_client: WorkerClient) -> None:
    engine = ScriptedEngine.from_text("abcdef")
    async with worker_client(engine, policy_version=3) as http:
        out = await complete(http, max_tokens=4, return_token_ids=True, logprobs=1, seed=11)
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert out["model"] == "nemo-gym-ckpt-tiny" and out["policy_version"] == 3
    choice = out["choices"][0]
    assert choice["text"] == "abcd" and choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert choice["token_ids"] == TOK.encode("abcd") and choice["prompt_token_ids"] == HELLO
    assert choice["seed"] == 11
    assert choice["logprobs"] == {"tokens": list("abcd"), "token_logprobs": [-0.01, -0.02, -0.03, -0.04],
                                  "top_logprobs": None, "text_offset": [0, 1, 2, 3]}
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    assert engine.admitted[0].seed == 11 and engine.admitted[0].prompt_token_ids == tuple(HELLO)


async def test_defaults_text_prompt_and_derived_seeds(worker_client: WorkerClient) -> None:
    engine = ScriptedEngine.from_text("xyz")
    async with worker_client(engine, seed=5) as http:
        first = await complete(http, prompt="Hi<|user|>", return_token_ids=True)
        second = await complete(http)
    assert first["choices"][0]["prompt_token_ids"] == TOK.encode("Hi<|user|>") == [44, 77, 3]
    assert first["usage"]["completion_tokens"] == 16
    assert "token_ids" not in second["choices"][0] and second["choices"][0]["logprobs"] is None
    seeds = [first["choices"][0]["seed"], second["choices"][0]["seed"]]
    assert seeds == [derive_seed(5, 0), derive_seed(5, 1)] and seeds[0] != seeds[1]
    request = engine.admitted[0]
    assert (request.temperature, request.top_p, request.max_tokens) == (1.0, 1.0, 16)


async def test_null_max_tokens_means_the_rest_of_the_context(worker_client: WorkerClient) -> None:
    engine = ScriptedEngine.from_text("abc")
    async with worker_client(engine) as http:
        out = await complete(http, max_tokens=None)
    assert engine.admitted[0].max_tokens == 64 - len(HELLO) == out["usage"]["completion_tokens"]


async def test_eos_is_in_token_ids_not_in_text(worker_client: WorkerClient) -> None:
    engine = ScriptedEngine([*TOK.encode("ok"), EOS, *TOK.encode("never")])
    async with worker_client(engine) as http:
        out = await complete(http, max_tokens=10, return_token_ids=True, logprobs=0,
                             skip_special_tokens=False)
    choice = out["choices"][0]
    assert choice["text"] == "ok" and choice["finish_reason"] == "stop" and choice["stop_reason"] is None
    assert choice["token_ids"] == [*TOK.encode("ok"), EOS]
    assert choice["logprobs"]["token_logprobs"] == [-0.01, -0.02, -0.03]
    assert choice["logprobs"]["tokens"][-1] == "<|end|>" and choice["logprobs"]["text_offset"] == [0, 1, 2]


async def test_ignore_eos_and_stop_token_ids(worker_client: WorkerClient) -> None:
    engine = ScriptedEngine([*TOK.encode("ab"), EOS, *TOK.encode("cd")])
    async with worker_client(engine) as http:
        past_eos = await complete(http, max_tokens=5, ignore_eos=True, return_token_ids=True)
        stop_id = await complete(http, max_tokens=5, stop_token_ids=[TOK.ids["b"]], return_token_ids=True)
    assert past_eos["choices"][0]["text"] == "abcd" and past_eos["choices"][0]["finish_reason"] == "length"
    choice = stop_id["choices"][0]
    assert choice["text"] == "a" and choice["token_ids"] == TOK.encode("ab")
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == TOK.ids["b"]


async def test_stop_string_cut_from_text_and_generation_cancelled(worker_client: WorkerClient) -> None:
    engine = ScriptedEngine.from_text("The answer is 42. More text")
    async with worker_client(engine) as http:
        out = await complete(http, max_tokens=40, stop=[" is", "42."], return_token_ids=True)
    choice = out["choices"][0]
    assert choice["text"] == "The answer" and choice["stop_reason"] == " is"
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == TOK.encode("The answer is")
    assert engine.cancelled == [engine.admitted[0].request_id]


async def test_stream_matches_non_stream(worker_client: WorkerClient) -> None:
    engine = ScriptedEngine.from_text("say <b>hi</b> then stop</b>")
    body = {"prompt": HELLO, "max_tokens": 30, "stop": "</b> then", "return_token_ids": True, "logprobs": 1}
    async with worker_client(engine, policy_version=2) as http:
        whole = (await http.post("/v1/completions", json=body)).json()
        reply = await http.post("/v1/completions", json={**body, "stream": True})
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = sse_events(reply.content)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    choices = [chunk["choices"][0] for chunk in chunks]
    assert all(chunk["policy_version"] == 2 and chunk["id"] == chunks[0]["id"] for chunk in chunks)
    assert "".join(c["text"] for c in choices) == whole["choices"][0]["text"] == "say <b>hi"
    assert [i for c in choices for i in c["token_ids"]] == whole["choices"][0]["token_ids"]
    logprobs = [lp for c in choices for lp in c["logprobs"]["token_logprobs"]]
    assert logprobs == [-0.01 * i for i in range(1, 19)]
    assert choices[0]["prompt_token_ids"] == HELLO and "prompt_token_ids" not in choices[1]
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["stop"]
    assert chunks[-1]["usage"] == whole["usage"] and all(c["usage"] is None for c in chunks[:-1])
    assert choices[-1]["stop_reason"] == "</b> then" and choices[-1]["seed"] == choices[0]["seed"]


async def test_stream_holds_back_possible_stop_prefix(worker_client: WorkerClient) -> None:
    engine = ScriptedEngine.from_text("ab<ab<c")
    async with worker_client(engine) as http:
        reply = await http.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 7, "stream": True,
                                                         "stop": "<cx"})
    texts = [event["choices"][0]["text"] for event in sse_events(reply.content)[:-1]]
    assert "".join(texts) == "ab<ab<c"
    assert texts[:6] == ["", "", "a", "b", "<", "a"] and texts[-1] == "b<c"


async def test_engine_failure_is_a_structured_error(worker_client: WorkerClient) -> None:
    engine = ScriptedEngine.from_text("abcdef", fail_after=3)
    async with worker_client(engine) as http:
        whole = await http.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 6})
        streamed = await http.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 6, "stream": True})
    assert whole.status_code == 503 and whole.json()["error"]["code"] == "unavailable"
    events = sse_events(streamed.content)
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["a", "b", "c"]
    assert events[-1] == {"error": {"code": "unavailable", "detail": "the scripted engine lost its device"}}


BAD_BODIES = [
    ({"prompt": None}, "prompt"),
    ({"prompt": ""}, "empty"),
    ({"prompt": []}, "at least one token"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [[1, 2]]}, "prompt"),
    ({"prompt": [1, 2.5]}, "prompt"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": [5, -1]}, "outside the vocabulary"),
    ({"prompt": [5, 99]}, "outside the vocabulary [0, 99)"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": 2**64}, "64-bit range"),  # refused by the JSON parser, before the field bound
    ({"n": 2}, "n=2"),
    ({"logprobs": 5}, "top-k logprobs are not implemented"),
    ({"logprobs": -1}, "logprobs"),
    ({"best_of": 3}, "'best_of'=3 is not supported"),
    ({"echo": True}, "'echo'=True is not supported"),
    ({"response_format": {"type": "json_object"}}, "'response_format'"),
    ({"frobnicate": 1}, "unknown field 'frobnicate'"),
    ({"stop": ["ok", ""]}, "stop strings must not be empty"),
    ({"stop": 3}, "stop"),
    ({"stop_token_ids": [1000]}, "stop_token_ids holds token ids outside"),
    ({"stream": "yes please"}, "stream"),
    ({"max_tokens": 60}, "exceeds the model's context length of 64"),
    ({"prompt": list(range(4, 68))}, "leaves no room"),
]


@pytest.mark.parametrize(("patch", "needle"), BAD_BODIES)
async def test_bad_completion_bodies_are_400(worker_client: WorkerClient, patch: dict[str, Any],
                                             needle: str) -> None:
    body = {"prompt": HELLO, **patch}
    async with worker_client(ScriptedEngine.from_text("a")) as http:
        reply = await http.post("/v1/completions", json={k: v for k, v in body.items() if v is not None})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "invalid_request"
    assert needle in reply.json()["error"]["detail"]


async def test_garbage_bodies_and_routes(worker_client: WorkerClient) -> None:
    async with worker_client(ScriptedEngine.from_text("a")) as http:
        as_json = {"content-type": "application/json"}
        not_json = await http.post("/v1/completions", content=b"{nope", headers=as_json)
        not_object = await http.post("/v1/completions", json=[1, 2])
        nan_body = b'{"prompt": [5], "temperature": NaN}'
        nan = await http.post("/v1/completions", content=nan_body, headers=as_json)
        wrong_model = await http.post("/v1/completions", json={"prompt": HELLO, "model": "gpt-9"})
        wrong_method = await http.get("/v1/completions")
        unknown = await http.post("/v1/embeddings", json={})
        version_garbage = await http.post("/ng-control/v1/policy-version", content=b"\x00\xff")
    assert [r.status_code for r in (not_json, not_object, nan)] == [400, 400, 400]
    assert wrong_model.status_code == 404 and "gpt-9" in wrong_model.json()["error"]["detail"]
    assert wrong_method.status_code == 405 and unknown.status_code == 404
    assert version_garbage.status_code == 400


async def test_neutral_openai_fields_are_accepted(worker_client: WorkerClient) -> None:
    neutral = {"user": "u1", "echo": False, "presence_penalty": 0, "frequency_penalty": 0.0, "best_of": 1,
               "logit_bias": {}, "top_k": -1, "n": 1, "model": "nemo-gym-ckpt-tiny", "temperature": None,
               "stream_options": {"include_usage": True}}
    async with worker_client(ScriptedEngine.from_text("ab")) as http:
        out = await complete(http, max_tokens=2, **neutral)
    assert out["choices"][0]["text"] == "ab"


async def test_models_health_and_rollout_prefix(worker_client: WorkerClient) -> None:
    async with worker_client(ScriptedEngine.from_text("ab"), served_model_name="tiny-x") as http:
        models = (await http.get("/v1/models")).json()
        health = await http.get("/health")
        prefixed = await http.post("/ng-rollout/r7-a2/v1/completions",
                                   json={"prompt": HELLO, "max_tokens": 2, "model": "tiny-x"})
        prefixed_version = await http.get("/ng-rollout/r7/ng-control/v1/policy-version")
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny-x"]
    assert models["data"][0]["max_model_len"] == 64
    assert health.status_code == 200
    assert prefixed.status_code == 200 and prefixed.json()["choices"][0]["text"] == "ab"
    assert prefixed_version.json() == {"policy_version": 0}


async def test_policy_version_set_and_stamped(worker_client: WorkerClient) -> None:
    async with worker_client(ScriptedEngine.from_text("ab"), policy_version=1) as http:
        assert (await http.get("/ng-control/v1/policy-version")).json() == {"policy_version": 1}
        before = await complete(http, max_tokens=1)
        set_reply = await http.post("/ng-control/v1/policy-version", json={"policy_version": 7})
        after = await complete(http, max_tokens=1)
        bad = [await http.post("/ng-control/v1/policy-version", json=body)
               for body in ({"policy_version": -1}, {"policy_version": "7"}, {"policy_version": 1.5},
                            {}, {"policy_version": 2, "extra": 1})]
        final = (await http.get("/ng-control/v1/policy-version")).json()
    assert set_reply.json() == {"policy_version": 7}
    assert (before["policy_version"], after["policy_version"], final["policy_version"]) == (1, 7, 7)
    assert [r.status_code for r in bad] == [400] * 5
    assert all(r.json()["error"]["code"] == "invalid_request" for r in bad)


async def test_version_is_the_one_current_at_admission(worker_client: WorkerClient) -> None:
    engine = ScriptedEngine.from_text("abc", gated=True)
    async with worker_client(engine, policy_version=4) as http:
        pending = asyncio.ensure_future(complete(http, max_tokens=3))
        await _until(lambda: len(engine.admitted) == 1)
        await http.post("/ng-control/v1/policy-version", json={"policy_version": 5})
        engine.release(3)
        out = await asyncio.wait_for(pending, timeout=5)
        engine.release(1)
        later = await asyncio.wait_for(complete(http, max_tokens=1), timeout=5)
    assert out["policy_version"] == 4 and later["policy_version"] == 5


async def test_policy_version_post_needs_the_token_when_checkpointing(
    worker_client: WorkerClient, tmp_path: Path
) -> None:
    async with worker_client(ScriptedEngine.from_text("a"), checkpoint=True, staging_dir=str(tmp_path)) as http:
        missing = await http.post("/ng-control/v1/policy-version", json={"policy_version": 2})
        wrong = await http.post("/ng-control/v1/policy-version", json={"policy_version": 2},
                                headers={"authorization": "Bearer nope"})
        right = await http.post("/ng-control/v1/policy-version", json={"policy_version": 2},
                                headers={"authorization": f"Bearer {TOKEN}"})
        read = await http.get("/ng-control/v1/policy-version")
    assert [missing.status_code, wrong.status_code, right.status_code] == [401, 401, 200]
    assert missing.json()["error"]["code"] == "unauthorized" and TOKEN not in wrong.text
    assert read.json() == {"policy_version": 2}


async def test_engine_lifecycle_follows_the_app(worker_client: WorkerClient) -> None:
    engine = ScriptedEngine.from_text("a")
    async with worker_client(engine):
        assert engine.started and not engine.closed
    assert engine.closed


def test_config_checks() -> None:
    assert make_ctx().settings.engine == "transformers" and make_ctx().settings.model_path is None
    with pytest.raises(ConfigError, match="model_path"):
        make_ctx(model_path="/no/such/model")
    with pytest.raises(ConfigError, match="engine"):
        make_ctx(engine="llama.cpp")
    with pytest.raises(ConfigError, match="unknown key"):
        make_ctx(max_batch=3)


async def _until(condition: Any, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.001)


@pytest.mark.parametrize("configured", [False, True])
def test_staging_lives_beside_the_checkpoint_root_never_inside_it(tmp_path: Path, configured: bool) -> None:
    root, own = tmp_path / "ckpts", tmp_path / "elsewhere"
    settings = {"staging_dir": str(own)} if configured else {}
    mesh = load_config_dict({"checkpoint": {"enabled": True, "control_auth_token": TOKEN, "root": str(root)},
                             "w1": {"responses_api_models": {"inference_worker": settings}}})
    instance = mesh.instance("w1")
    assert isinstance(instance.settings, Config)
    where = staging_dir(ServerContext(name="w1", settings=instance.settings, mesh=mesh))
    assert where == (own if configured else tmp_path / "ckpts.generation-cuts" / "w1")
    assert not where.is_relative_to(root)


class _BlockingTokenizer(CharTokenizer):
    """Encoding a text that starts with ``BLOCK`` waits until ``release`` is set (at most 5 s): a
    long tokenization that a test can hold while it asks the worker for something else."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()
        self.released_while_encoding: bool | None = None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if text.startswith("BLOCK"):
            self.entered.set()
            self.released_while_encoding = self.release.wait(5)
        return super().encode(text, add_special_tokens=add_special_tokens)


async def test_text_prompt_is_tokenized_off_the_event_loop(worker_client: WorkerClient) -> None:
    tokenizer = _BlockingTokenizer()
    engine = ScriptedEngine(TOK.encode("ok"), tokenizer=tokenizer)
    async with worker_client(engine) as http:
        pending = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": "BLOCK me", "max_tokens": 2}))
        assert await asyncio.to_thread(tokenizer.entered.wait, 5)
        health = await http.get("/health")  # served while the prompt is still being tokenized
        tokenizer.release.set()
        reply = await pending
    assert health.status_code == 200
    assert tokenizer.released_while_encoding is True  # the loop ran while encode() was blocked
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "ok"


class _HugeTokenizer(CharTokenizer):
    """A text holding ``HUGE`` encodes to one id more than a request may hold (cheaply)."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if "HUGE" in text:
            return [5] * (MAX_TOKENS + 1)
        return super().encode(text, add_special_tokens=add_special_tokens)


async def test_chat_prompt_over_max_tokens_is_the_context_length_400(worker_client: WorkerClient) -> None:
    engine = ScriptedEngine(TOK.encode("ok"), tokenizer=_HugeTokenizer())
    async with worker_client(engine) as http:
        long = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 80}]})
        huge = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "HUGE"}]})
    assert long.status_code == 400 and "leaves no room" in long.json()["error"]["detail"]
    assert huge.status_code == 400, huge.text  # was a 500: a ValidationError out of body.completion()
    assert huge.json()["error"]["detail"] == (f"the prompt ({MAX_TOKENS + 1} tokens) leaves no room in the "
                                              "model's context length of 64 tokens")


class _GoneClient:
    """A request whose client has already disconnected."""

    async def receive(self) -> dict[str, str]:
        return {"type": "http.disconnect"}


async def test_a_disconnected_client_cancels_the_work_and_is_a_quiet_400() -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def work() -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def run() -> None:
        await _unless_disconnected(_GoneClient(), work())  # type: ignore[arg-type]

    with pytest.raises(InvalidRequest, match="client disconnected"):  # was InvalidStateError (a 500)
        await asyncio.wait_for(run(), 10)
    assert started.is_set() and cancelled.is_set()
