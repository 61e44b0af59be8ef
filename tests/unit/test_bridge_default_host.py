"""A NeMo Gym server run in the mesh (the bridge) is where the launcher looks for it: the config's
``default_host`` is the host of every server whose block names none, for the bridge's own bind
(``ServerBlock``) and for the global config NeMo Gym's servers read (their judge model's address), as
for the launcher and our own servers. The bridge took 127.0.0.1 whatever ``default_host`` said, so
with ``default_host: 127.0.0.2`` the launcher polled 127.0.0.2 for a server bound on 127.0.0.1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_gym_ckpt.bridge.child import ServerBlock
from nemo_gym_ckpt.bridge.global_config import nemo_gym_config
from nemo_gym_ckpt.config import PROJECT_ROOT, MeshConfig, load_config

pytestmark = pytest.mark.unit

NEMO_GYM_SERVER = "math_with_judge_judged"
MESH = f"""
config_paths:
  - {PROJECT_ROOT / "configs" / "quickstart.yaml"}
  - {PROJECT_ROOT / "resources_servers/nemo_gym/math_with_judge/configs/math_with_judge_judged.yaml"}
judge_model:
  responses_api_models:
    policy_model: {{entrypoint: app.py, worker: {{type: responses_api_models, name: inference_worker}}}}
"""


def _mesh(tmp_path: Path, top: str, overrides: list[str]) -> MeshConfig:
    path = tmp_path / "mesh.yaml"
    path.write_text(MESH + top)
    mesh = load_config([str(path)], ["head_server.port=11000", *overrides])
    return mesh.with_ports({name: 12000 + index for index, name in enumerate(mesh.instances)})  # as launched


@pytest.mark.parametrize(("top", "overrides", "expected"), [
    ("", [], "127.0.0.1"),
    ("default_host: 127.0.0.2\n", [], "127.0.0.2"),
    ("default_host: 127.0.0.2\n", [f"{NEMO_GYM_SERVER}.resources_servers.math_with_judge.host=127.0.0.3"],
     "127.0.0.3"),
], ids=["no_default_host", "default_host", "own_host"])
def test_the_bridge_binds_where_the_launcher_polls(
    tmp_path: Path, top: str, overrides: list[str], expected: str
) -> None:
    mesh = _mesh(tmp_path, top, overrides)
    assert mesh.url_of(NEMO_GYM_SERVER) == f"http://{expected}:{mesh.instance(NEMO_GYM_SERVER).settings.port}"
    assert ServerBlock(mesh.raw, NEMO_GYM_SERVER).host == expected


@pytest.mark.parametrize("top", ["", "default_host: 127.0.0.2\n"], ids=["no_default_host", "default_host"])
def test_nemo_gyms_global_config_gives_every_server_the_address_the_mesh_serves_it(tmp_path: Path, top: str) -> None:
    mesh = _mesh(tmp_path, top, [])
    config = nemo_gym_config(mesh.raw)
    for name, instance in mesh.instances.items():  # the judge model a NeMo Gym server calls among them
        block = config[name][instance.type][instance.implementation]
        assert f"http://{block['host']}:{block['port']}" == mesh.url_of(name), name
    assert (config["head_server"]["host"], config["head_server"]["port"]) == (mesh.head_server.host, 11000)
