"""The minimal participant under real uvicorn: the conformance suite over sockets, the coordinator
through a head server, and the ``nemo-gym-ckpt checkpoint`` command."""

from __future__ import annotations

import argparse
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from nemo_gym_ckpt.checkpoint.coordinator import Coordinator
from nemo_gym_ckpt.cli import checkpoint as cli
from nemo_gym_ckpt.config import CheckpointConfig
from nemo_gym_ckpt.identity import RolloutIdentity
from nemo_gym_ckpt.testing.conformance import CHECKS, ParticipantUnderTest
from nemo_gym_ckpt.testing.minimal import (
    MinimalHooks,
    MinimalServer,
    create_head_stub,
    create_minimal_server,
)

pytestmark = pytest.mark.sockets

TOKEN = "sockets-token-5678"
KINDS = ("environment", "model", "agent", "resources")


@pytest.fixture
def config(root: Path) -> CheckpointConfig:
    # A short grace lets the lease check run on the real clock in well under a second.
    return CheckpointConfig(enabled=True, control_auth_token=TOKEN, root=root, lease_grace_seconds=0.5)


def start_mesh(
    serve_app: Callable[[Any], str], config: CheckpointConfig
) -> tuple[str, dict[str, MinimalServer]]:
    """One real server per kind (two resources servers) and a head server listing them."""
    servers = {f"{kind}1": create_minimal_server(f"{kind}1", config, kind=kind) for kind in KINDS}
    servers["resources2"] = create_minimal_server("resources2", config, kind="resources")
    listing = [
        {"name": name, "type": "resources_servers", "implementation": "minimal", "url": serve_app(s.app)}
        for name, s in servers.items()
    ]
    return serve_app(create_head_stub(listing)), servers


@pytest.mark.parametrize("name", sorted(CHECKS))
async def test_conformance_over_sockets(
    name: str, serve_app: Callable[[Any], str], config: CheckpointConfig, root: Path
) -> None:
    @asynccontextmanager
    async def make() -> AsyncIterator[ParticipantUnderTest]:
        url = serve_app(create_minimal_server("sessions", config).app)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            yield ParticipantUnderTest(client, TOKEN, root, data=MinimalHooks())

    await CHECKS[name](make)


async def test_the_coordinator_drives_real_servers(
    serve_app: Callable[[Any], str], config: CheckpointConfig, root: Path
) -> None:
    head, servers = start_mesh(serve_app, config)
    servers["environment1"].adapter.put(RolloutIdentity("r1"), {"step": 2})
    servers["agent1"].adapter.put(RolloutIdentity("r1"), {"turns": ["hi"]})
    async with Coordinator(head, TOKEN, required_kinds=KINDS) as coordinator:
        deadline = time.time() + 30
        assert (await coordinator.prepare("c1", deadline_ts=deadline)).prepared
        committed = await coordinator.commit("c1", deadline_ts=deadline, checkpoint_dir=str(root / "ck"))
        assert committed.episode_ids() == ["r1"] and len(committed.manifests()) == 5
        await coordinator.resume("c1", deadline_ts=deadline)
        assert {s["phase"] for s in (await coordinator.status()).values()} == {"idle"}
    head, fresh = start_mesh(serve_app, config)
    async with Coordinator(head, TOKEN) as coordinator:
        restored = await coordinator.restore(
            "r1",
            deadline_ts=time.time() + 30,
            checkpoint_dir=str(root / "ck"),
            episode_ids=[RolloutIdentity("r1")],
        )
        assert restored.continued() == [RolloutIdentity("r1", 1)]
        await coordinator.resume("r1", deadline_ts=time.time() + 30)
    assert fresh["agent1"].adapter.sessions["r1-a1"].state == {"turns": ["hi"]}


@pytest.fixture
def run_cli(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Iterator[Callable[..., Any]]:
    monkeypatch.setenv("GYM_CKPT_TOKEN", TOKEN)
    parser = argparse.ArgumentParser(prog="nemo-gym-ckpt checkpoint")
    cli.configure(parser)

    def run(*argv: str, status: int = 0) -> Any:
        code = cli.main(parser.parse_args(list(argv)))
        out, err = capsys.readouterr()
        assert code == status, (code, out, err)
        if status:  # one line on stderr says why (stdout may still hold the per-participant result)
            assert len(err.strip().splitlines()) == 1, err
            return err
        return orjson.loads(out)

    yield run


def test_the_cli_drives_real_servers(
    serve_app: Callable[[Any], str],
    config: CheckpointConfig,
    run_cli: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    head, servers = start_mesh(serve_app, config)
    servers["environment1"].adapter.put(RolloutIdentity("r1", 1), {"step": 5})
    monkeypatch.chdir(config.root)  # --dir is relative to the shell's directory
    h = ("--head", head)
    assert set(run_cli("status", *h)) == set(servers)
    prepared = run_cli("prepare", *h, "--id", "c1")
    assert prepared["prepared"] is True and prepared["restarts"] == []
    committed = run_cli("commit", *h, "--id", "c1", "--dir", "ck", "--episode", "r1-a1")
    assert committed["participants"]["environment1"]["episode_ids"] == ["r1-a1"]
    assert run_cli("resume", *h, "--id", "c1")["participants"]["agent1"] == {
        "phase": "idle",
        "idempotent": False,
    }
    assert "stale_checkpoint" in run_cli("prepare", *h, "--id", "c1", status=1)
    retired = run_cli("retire", *h, "--episode", "x-a3")
    assert retired["participants"]["model1"] == {"retired": ["x-a3"]}
    assert run_cli("forget", *h, "--rollout", "x", "--id", "f1")["participants"]["agent1"] == {
        "forgotten": ["x"]
    }
    fresh_head, fresh = start_mesh(serve_app, config)
    restored = run_cli(
        "restore",
        "--head",
        fresh_head,
        "--id",
        "r1",
        "--dir",
        "ck",
        "--episode",
        "r1-a1",
        "--episode",
        "gone",
    )
    assert restored["continued"] == ["r1-a2"] and restored["restarts"] == ["gone"]
    assert fresh["environment1"].adapter.sessions["r1-a2"].state == {"step": 5}
    assert "no judge participant" in run_cli(
        "status", "--head", fresh_head, "--require-kind", "judge", status=1
    )
    monkeypatch.delenv("GYM_CKPT_TOKEN")
    assert "GYM_CKPT_TOKEN" in run_cli("status", *h, status=2)


def test_the_cli_refuses_bad_arguments(run_cli: Callable[..., Any]) -> None:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    for argv in (
        ["prepare", "--head", "http://x"],
        ["prepare", "--head", "http://x", "--id", "../x"],
        ["retire", "--head", "http://x", "--episode", "/bad"],
        ["restore", "--head", "h", "--id", "a"],
    ):
        with pytest.raises(SystemExit) as caught:
            parser.parse_args(argv)
        assert caught.value.code == 2
