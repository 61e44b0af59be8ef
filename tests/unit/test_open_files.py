"""A server process's open-file limit and the size of its client's pool (nemo_gym_ckpt.launch.open_files)."""

from __future__ import annotations

import resource
from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_gym_ckpt.config import load_config
from nemo_gym_ckpt.launch import child
from nemo_gym_ckpt.launch.open_files import MAX_POOL, MIN_POOL, raise_open_file_limit, server_pool_size

pytestmark = pytest.mark.unit


@pytest.fixture
def lowered_limit() -> Iterator[int]:
    """The soft limit lowered to 1,024 for the test (when the hard one is above it), then put back."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.fail(f"this test needs a hard open-file limit above 1,024, the machine has {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        yield hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_soft_limit_is_raised_toward_the_hard_one(lowered_limit: int) -> None:
    raised = raise_open_file_limit()
    assert raised > 1024
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == raised
    assert raised == (65_536 if lowered_limit == resource.RLIM_INFINITY else min(lowered_limit, 65_536))


def test_the_pool_is_a_third_of_the_files_within_its_bounds() -> None:
    assert [server_pool_size(n) for n in (256, 3_000, 20_000, 65_536)] == [MIN_POOL, MIN_POOL, 6_666, MAX_POOL]


def test_a_server_process_sizes_its_client_from_the_raised_limit(lowered_limit: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``build_app`` raises the limit and gives the server's context a client with that pool."""
    seen: list[int] = []
    real = child.MeshClient

    def recording(*, max_connections: int) -> object:
        seen.append(max_connections)
        return real(max_connections=max_connections)

    monkeypatch.setattr(child, "MeshClient", recording)
    mesh = load_config([Path(__file__).resolve().parents[2] / "configs/quickstart.yaml"], [])
    child.build_app(mesh, "calculator_tools")
    assert seen == [server_pool_size(resource.getrlimit(resource.RLIMIT_NOFILE)[0])]
