"""The script engine (``engine: script``) behind the worker's real ``/v1/completions``, in process.

Loaded from the settings as the worker loads every engine (the default model's tokenizer): the
first rule whose texts are all in the prompt answers, EOS ends it, no match gives the default, a
prompt that ends with the start of the answer is continued, and the script keys are refused for
other engines.
"""

from __future__ import annotations

import httpx
import pytest

from model_servers.inference_worker.app import create_app
from model_servers.inference_worker.tests.conftest import make_ctx
from nemo_gym_ckpt.errors import ConfigError

pytestmark = pytest.mark.unit

SCRIPT = [
    {"when": ["capital", "France"], "say": "It is \\boxed{Paris}."},
    {"when": ["capital"], "say": "I do not know."},
]


async def complete(http: httpx.AsyncClient, prompt: str | list[int], **body: object) -> dict[str, object]:
    reply = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 64, **body})
    assert reply.status_code == 200, reply.text
    choice: dict[str, object] = reply.json()["choices"][0]
    return choice


async def test_the_first_matching_rule_answers_and_eos_ends_it() -> None:
    app = create_app(make_ctx(engine="script", script=SCRIPT, script_default="No idea."))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://worker", timeout=30
    ) as http:
        paris = await complete(http, "What is the capital of France?", return_token_ids=True)
        assert paris["text"] == "It is \\boxed{Paris}." and paris["finish_reason"] == "stop"
        assert (await complete(http, "The capital of Peru?"))["text"] == "I do not know."
        assert (await complete(http, "Hello"))["text"] == "No idea."
        short = await complete(http, "capital of France", max_tokens=3)
        assert short["finish_reason"] == "length"
        ids = paris["token_ids"]
        assert isinstance(ids, list) and len(ids) > 4
        prompt_ids = paris["prompt_token_ids"]
        assert isinstance(prompt_ids, list)
        rest = await complete(http, [*prompt_ids, *ids[:3]], return_token_ids=True)
        assert rest["token_ids"] == ids[3:]  # a continuation after a cut goes on with the rest


def test_script_keys_belong_to_the_script_engine() -> None:
    with pytest.raises(ConfigError, match="engine: script"):
        make_ctx(script=SCRIPT)
