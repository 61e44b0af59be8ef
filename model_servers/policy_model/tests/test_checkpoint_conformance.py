"""The conformance suite against the policy model participant: in process with a fake clock, and
over real uvicorn (both over the scripted worker), and in process with generation cuts on."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from model_servers.policy_model.chat_format import ChatFormat
from model_servers.policy_model.tests.policy_harness import TOKEN, PolicyHooks, serve_policy
from model_servers.policy_model.tests.scripted_worker import Generate, ScriptedWorker
from nemo_gym_ckpt.testing.clock import FakeClock
from nemo_gym_ckpt.testing.conformance import CHECKS, MakeParticipant, ParticipantUnderTest, check_participant


def maker(
    fmt: ChatFormat, tokenizer_dir: Path, root: Path, *, uvicorn: bool, **settings: Any
) -> MakeParticipant:
    @asynccontextmanager
    async def make() -> AsyncIterator[ParticipantUnderTest]:
        worker = ScriptedWorker(fmt)
        worker.default = Generate("ok")
        hooks = PolicyHooks(worker)
        if uvicorn:
            async with serve_policy(worker, tokenizer_dir, root=root, grace_s=0.5, uvicorn=True) as http:
                yield ParticipantUnderTest(http, TOKEN, root, data=hooks)
            return
        clock = FakeClock(start=1_700_000_000.0)
        async with serve_policy(worker, tokenizer_dir, root=root, clock=clock, **settings) as http:
            yield ParticipantUnderTest(
                http, TOKEN, root, now=clock.now, advance_clock=clock.advance, data=hooks
            )

    return make


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(CHECKS))
async def test_conformance_in_process(name: str, fmt: ChatFormat, tokenizer_dir: Path, root: Path) -> None:
    await CHECKS[name](maker(fmt, tokenizer_dir, root, uvicorn=False))


@pytest.mark.sockets
async def test_conformance_over_uvicorn(fmt: ChatFormat, tokenizer_dir: Path, root: Path) -> None:
    results = await check_participant(maker(fmt, tokenizer_dir, root, uvicorn=True))
    assert set(results) == set(CHECKS)
    assert set(results.values()) == {"passed"}, results


@pytest.mark.unit
async def test_conformance_with_generation_cuts(fmt: ChatFormat, tokenizer_dir: Path, root: Path) -> None:
    results = await check_participant(maker(fmt, tokenizer_dir, root, uvicorn=False, generation_cuts=True))
    assert set(results.values()) == {"passed"}, results
