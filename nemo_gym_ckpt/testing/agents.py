"""Driving an agent server under test: ``AgentHooks`` and the ``hold_policy`` model.

``hold_policy`` is a scripted model (``ScriptedModel(hold_policy)``) that asks for the ``hold`` tool
when the user text starts with "hold" and otherwise answers; with a resources server made by
``nemo_gym_ckpt.testing.resources.held`` the tool call stays in flight until released.
``AgentHooks`` are the conformance suite's ``DataHooks`` on an agent: ``request`` is one whole
activation (the next index of the episode), ``block`` holds an activation inside the tool call
(``NotApplicable`` on a restart-only agent, which never blocks).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import httpx

from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.testing.conformance import NotApplicable
from nemo_gym_ckpt.testing.scripted_model import function_call, last_user_text, message
from nemo_gym_ckpt.testing.waits import until

__all__ = ["WAIT_S", "AgentHooks", "hold_policy"]

WAIT_S = 10.0


def hold_policy(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A model that asks for the ``hold`` tool when told to hold, and otherwise answers."""
    items = body["input"]
    if isinstance(items, list) and items and items[-1].get("type") == "function_call_output":
        return [message(f"held: {items[-1]['output']}")]
    text = last_user_text(body)
    return [function_call("hold", {})] if text.startswith("hold") else [message(f"noted {text}")]

class AgentHooks:
    """The conformance suite's data plane on an agent: whole activations, and one held in a tool call."""

    def __init__(self, resources: httpx.AsyncClient, *, restart_only: bool) -> None:
        self.resources = resources
        self.restart_only = restart_only
        self.next: Counter[str] = Counter()
        self.pending: dict[str, asyncio.Task[httpx.Response]] = {}

    async def activate(
        self, client: httpx.AsyncClient, episode: RolloutIdentity, text: str
    ) -> httpx.Response:
        key = episode.capture_key
        index = self.next[key] + 1
        response = await client.post(f"/ng-rollout/{key}/v1/responses", json={"input": text},
                                     headers={"x-ng-agent-activation": str(index)})
        if response.status_code == 200:
            self.next[key] = index
        return response

    async def request(
        self, client: httpx.AsyncClient, episode: RolloutIdentity, payload: dict[str, Any]
    ) -> httpx.Response:
        return await self.activate(client, episode, f"state {sorted(payload.items())}")

    async def block(self, client: httpx.AsyncClient, episode: RolloutIdentity, blocked: bool) -> None:
        if self.restart_only:
            raise NotApplicable("a restart-only agent never blocks a prepare")
        key = episode.capture_key
        if blocked:
            self.pending[key] = asyncio.create_task(self.activate(client, episode, "hold on"))
            await self.until_held(key)
            return
        (await self.resources.post(f"/_test/release/{key}")).raise_for_status()

    async def until_held(self, key: str) -> None:
        async def held() -> bool:
            pending = self.pending.get(key)
            assert pending is None or not pending.done(), f"the held call ended: {pending.result().text}"
            return key in (await self.resources.get("/_test/held")).json()

        await until(held, f"the tool call of {key} held", timeout_s=WAIT_S, interval_s=0.002)

    async def aclose(self) -> None:
        """Release every held call and let the activations end (bounded; the rest are cancelled)."""
        for key in list(self.pending):
            (await self.resources.post(f"/_test/release/{key}")).raise_for_status()
        pending = [task for task in self.pending.values() if not task.done()]
        if pending:
            await asyncio.wait(pending, timeout=WAIT_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self.pending.values(), return_exceptions=True)
