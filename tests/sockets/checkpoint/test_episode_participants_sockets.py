"""Environment and agent servers under real uvicorn: the conformance suite over sockets.

Every server of a stack (the participant under test, its gate agent or scripted model, its
calculator) is a real uvicorn server on 127.0.0.1, calling the others over real connections, on the
wall clock (a short lease grace lets the lease check run in well under a second). A test's servers
are told to stop when it ends and stop in the background while the next test runs (uvicorn takes
about 0.2 s to stop, most of it its own fixed sleeps); every stop is waited for, and its outcome
checked, when the module ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_ckpt.checkpoint.clock import SYSTEM_CLOCK
from nemo_gym_ckpt.launch.head import ThreadedServer
from nemo_gym_ckpt.testing.conformance import CHECKS, NotApplicable, ParticipantUnderTest
from nemo_gym_ckpt.testing.placement import Sockets, under_test
from tests.support.episode_participants import ENVIRONMENTS, TOKEN, agent_stack, checkpoint_config, env_stack

pytestmark = pytest.mark.sockets

AGENTS = ("simple_agent", "restart_only_agent")
RESTART_ONLY_SKIPS = {"restored_content_is_exported_byte_for_byte", "commit_scope_limits_the_export"}


@pytest.fixture(scope="module")
def stopping() -> Iterator[Callable[[ThreadedServer], None]]:
    """``stop(server)``: the server stops in the background; all stops are joined at the module's end."""
    stops: list[Future[None]] = []
    with ThreadPoolExecutor(max_workers=16) as pool:
        yield lambda server: stops.append(pool.submit(server.stop))
    for stop in stops:
        stop.result()  # a stop that raised errors the module's last test


@pytest.fixture
def serve(stopping: Callable[[ThreadedServer], None]) -> Iterator[Callable[[Any], str]]:
    """Real uvicorn servers, told to stop (in the background) when the test ends."""
    servers: list[ThreadedServer] = []

    def start(app: Any) -> str:
        server = ThreadedServer(app, "127.0.0.1", 0, name="participant-test")
        server.start(timeout_s=10.0)
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        stopping(server)


def cases() -> list[tuple[str, str]]:
    servers = [*ENVIRONMENTS, *AGENTS]
    return [(server, name) for server in servers for name in sorted(CHECKS)
            if not (server == "restart_only_agent" and name in RESTART_ONLY_SKIPS)]


@pytest.mark.parametrize(("server", "name"), cases())
async def test_conformance_over_sockets(
    server: str, name: str, serve: Callable[[Any], str], root: Path
) -> None:
    stack_of = env_stack if server in ENVIRONMENTS else agent_stack

    @asynccontextmanager
    async def make() -> AsyncIterator[ParticipantUnderTest]:
        placement = Sockets(serve)
        config = checkpoint_config(root, grace_s=0.5)
        async with (
            stack_of(server, placement, config, SYSTEM_CLOCK) as stack,
            under_test(stack, placement, root, SYSTEM_CLOCK, TOKEN) as pt,
        ):
            yield pt

    try:
        await CHECKS[name](make)
    except NotApplicable as reason:
        assert server == "restart_only_agent" and name == "prepare_reports_blockers_until_ready", reason
