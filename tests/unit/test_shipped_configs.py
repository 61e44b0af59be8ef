"""Every YAML this repository ships is in NeMo Gym's shape and loads.

The files of ``configs/`` and of each server folder's ``configs/`` (the folder's own file on top of
the quickstart, which defines the servers they refer to) load with ``load_config``, and every
server block carries what NeMo Gym's parser needs to count it as a server: an ``entrypoint``, a
``domain`` on a resources server, a ``license`` on a train or validation dataset. (The interop tier
runs NeMo Gym's own parser on them: tests/interop/test_config_parser.py.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from nemo_gym_ckpt.config import FOLDER_OF_TYPE, PROJECT_ROOT, SERVER_TYPES, load_config

pytestmark = pytest.mark.unit

QUICKSTART = PROJECT_ROOT / "configs" / "quickstart.yaml"
MESH_CONFIGS = sorted((PROJECT_ROOT / "configs").glob("*.yaml"))
SERVER_CONFIGS = sorted(path for folder in FOLDER_OF_TYPE.values()
                        for path in (PROJECT_ROOT / folder).glob("*/configs/*.yaml"))


def server_blocks(path: Path) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """``(instance, type key, settings)`` of every server block of one file."""
    for name, block in (yaml.safe_load(path.read_text()) or {}).items():
        if isinstance(block, dict):
            for server_type in set(block) & set(SERVER_TYPES):
                for settings in block[server_type].values():
                    yield name, server_type, settings or {}


def nemo_gym_needs(path: Path) -> list[str]:
    """What NeMo Gym's parser would miss in the server blocks of ``path``."""
    missing = []
    for name, server_type, settings in server_blocks(path):
        if "entrypoint" not in settings:
            missing.append(f"{name}: entrypoint")
        if server_type == "resources_servers" and "domain" not in settings:
            missing.append(f"{name}: domain")
        for dataset in settings.get("datasets") or []:
            if dataset.get("type") in ("train", "validation") and "license" not in dataset:
                missing.append(f"{name}: datasets {dataset.get('name')}: license")
    return missing


def relative(path: Path) -> str:
    return str(path.relative_to(PROJECT_ROOT))


def test_there_are_configs_to_check() -> None:
    assert QUICKSTART in MESH_CONFIGS and len(SERVER_CONFIGS) >= 12


@pytest.mark.parametrize("path", MESH_CONFIGS + SERVER_CONFIGS, ids=relative)
def test_every_server_block_has_what_nemo_gym_needs(path: Path) -> None:
    assert list(server_blocks(path)), f"{relative(path)} declares no server block"
    assert nemo_gym_needs(path) == []


@pytest.mark.parametrize("path", MESH_CONFIGS, ids=relative)
def test_every_mesh_config_loads(path: Path) -> None:
    mesh = load_config([path])
    assert {name for name, _, _ in server_blocks(path)} == set(mesh.instances)


@pytest.mark.parametrize("path", SERVER_CONFIGS, ids=relative)
def test_every_server_folder_config_loads_over_the_quickstart(path: Path) -> None:
    mesh = load_config([QUICKSTART, path])
    instances = [mesh.instance(name) for name, _, _ in server_blocks(path)]
    assert [inst.type for inst in instances] == [server_type for _, server_type, _ in server_blocks(path)]
    assert any(path.is_relative_to(PROJECT_ROOT / inst.folder) for inst in instances), "no server of its folder"


def test_the_check_finds_what_nemo_gym_needs(tmp_path: Path) -> None:
    bare = tmp_path / "bare.yaml"
    bare.write_text("r:\n  resources_servers:\n    string_match:\n      datasets: [{name: d, type: train}]\n")
    assert nemo_gym_needs(bare) == ["r: entrypoint", "r: domain", "r: datasets d: license"]
