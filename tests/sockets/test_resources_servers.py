"""Resources servers on real uvicorn (127.0.0.1), called by the real mesh client."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from nemo_gym_ckpt.client import MeshClient
from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.errors import InvalidRequest
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.launch.child import build_app

pytestmark = pytest.mark.sockets

MESH = load_config_dict({
    "calc": {"resources_servers": {"calculator_tools": {}}},
    "kv": {"resources_servers": {"kv_store": {}}},
})


def answer(text: str) -> dict[str, Any]:
    return {"output": [{"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": text}]}]}


async def test_calculator_tools_over_sockets(serve_app: Callable[[Any], str]) -> None:
    url = serve_app(build_app(MESH, "calc"))
    identity = RolloutIdentity("sock-1")
    async with MeshClient(transport="aiohttp") as client:
        tools = await client.get_json(f"{url}/tools")
        assert [t["name"] for t in tools] == ["add", "subtract", "multiply"]
        product = await client.request("POST", f"{url}/multiply", json={"a": 97, "b": 53}, identity=identity)
        assert product.text == "5141"
        refused = await client.request("POST", f"{url}/multiply", json={"a": "x"}, identity=identity,
                                       check=False)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_request"
        row = {"expected_answer": 5141, "response": answer("The answer is 5141.")}
        verdict = await client.post_json(f"{url}/verify", row, identity=identity)
        assert (verdict["reward"], verdict["extracted_answer"]) == (1.0, 5141)


async def test_kv_store_sessions_over_sockets(serve_app: Callable[[Any], str]) -> None:
    url = serve_app(build_app(MESH, "kv"))
    identity = RolloutIdentity("sock-2", 1)
    async with MeshClient(transport="httpx") as client:
        seeded = await client.request("POST", f"{url}/seed_session", json={"initial_state": {"a": "1"}},
                                      identity=identity)
        assert seeded.headers["x-ng-checkpoint-verify"] == "wait"
        cookies = dict(seeded.cookies)
        assert list(cookies) == ["ng_session_kv"]
        stored = await client.post_json(f"{url}/kv_set", {"key": "b", "value": "2"}, cookies=cookies,
                                        identity=identity)
        assert stored == {"key": "b", "value": "2"}
        with pytest.raises(InvalidRequest, match="call /seed_session first"):
            await client.post_json(f"{url}/kv_list", {}, identity=identity)
        listed = await client.post_json(f"{url}/kv_list", {}, cookies=cookies, identity=identity)
        assert listed == {"keys": ["a", "b"]}
        row = {"expected_state": {"a": "1", "b": "2"}, "response": answer("done")}
        verdict = await client.post_json(f"{url}/verify", row, cookies=cookies, identity=identity)
        assert verdict["reward"] == 1.0
