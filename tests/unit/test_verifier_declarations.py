"""The twenty of NeMo Gym's training verifiers: declared in code, each with its folder here, documented.

Reads the declaration table (``nemo_gym_ckpt.bridge.declarations``), every folder of
``resources_servers/nemo_gym/`` (configs in NeMo Gym's shape, rows, README), ``docs/verifiers.md``,
and the source of NeMo Gym 0.7.0's servers in NeMo Gym's environment (``$NEMO_GYM_PYTHON``, else
built by ``scripts/nemo_gym_env.sh``): each class the table names is defined in its server's
``app.py``.
"""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from nemo_gym_ckpt.bridge.declarations import (
    DEFAULT_DECLARATION,
    NEMO_GYM_VERIFIERS,
    STATELESS_REPLAY,
    declaration_of,
)
from nemo_gym_ckpt.config import PROJECT_ROOT, load_config_dict
from nemo_gym_ckpt.errors import ConfigError
from nemo_gym_ckpt.resources.shell import Declaration
from tests.support.nemo_gym_env import nemo_gym_python

pytestmark = pytest.mark.unit

TWENTY = ("code_gen", "competitive_coding_challenges", "equivalence_llm_judge", "math_with_judge",
          "genrm_compare", "abstention", "calendar", "equivalence_rule", "ether0", "format_verification",
          "instruction_following", "inverse_if", "jailbreak_detection", "mcqa", "multichallenge", "nvarc",
          "reasoning_gym", "string_match", "structured_outputs", "terminus_judge")
"""The verifiers the upstream checkpoint work declares (issue 14)."""
CANNOT_RUN = {"ether0", "instruction_following"}
FOLDERS = PROJECT_ROOT / "resources_servers" / "nemo_gym"
DOC = PROJECT_ROOT / "docs" / "verifiers.md"


def _named(name: str, module: str, **attributes: Any) -> type:
    return type(name, (), {"__module__": module, **attributes})


def test_the_table_holds_the_twenty_each_stateless_and_replay() -> None:
    assert sorted(NEMO_GYM_VERIFIERS) == sorted(TWENTY)
    for verifier in NEMO_GYM_VERIFIERS.values():
        assert verifier.declaration == STATELESS_REPLAY == Declaration("stateless", "replay"), verifier
        server = _named(verifier.server_class, verifier.module)
        assert declaration_of(server, verifier.module) == STATELESS_REPLAY, verifier.name


def test_class_attributes_come_first_and_an_unknown_server_is_restart_only() -> None:
    string_match = NEMO_GYM_VERIFIERS["string_match"]
    own = _named(string_match.server_class, string_match.module, checkpoint_mode="restart_only")
    assert declaration_of(own, string_match.module) == Declaration("restart_only", "wait")
    mine = _named("MyVerifier", "resources_servers.mine.app", checkpoint_mode="stateless",
                  checkpoint_verify="replay")
    assert declaration_of(mine, "resources_servers.mine.app") == STATELESS_REPLAY
    same_name_elsewhere = _named(string_match.server_class, "resources_servers.mine.app")
    assert declaration_of(same_name_elsewhere, "resources_servers.mine.app") == DEFAULT_DECLARATION
    assert Declaration("restart_only", "wait") == DEFAULT_DECLARATION


@pytest.mark.parametrize("key", ["checkpoint_mode", "checkpoint_verify"])
def test_config_cannot_set_or_weaken_a_declaration(key: str) -> None:
    raw = {"string_match": {"resources_servers": {"string_match": {
        "entrypoint": "app.py", "package": "nemo_gym", key: "restart_only"}}}}
    with pytest.raises(ConfigError, match="declared in code"):
        load_config_dict(raw)


def _configs(name: str) -> list[Path]:
    return sorted((FOLDERS / name / "configs").glob("*.yaml"))


@pytest.mark.parametrize("name", TWENTY)
def test_each_has_its_folder_config_rows_and_readme(name: str) -> None:
    folder = FOLDERS / name
    readme = (folder / "README.md").read_text()
    assert "stateless" in readme and "replay" in readme, f"{name}/README.md names no declaration"
    configs = _configs(name)
    assert configs, f"{name} has no config"
    for path in configs:
        raw = yaml.safe_load(path.read_text())
        for instance, block in raw.items():
            assert set(block) == {"resources_servers"}, (path, instance)
            assert list(block["resources_servers"]) == [name], (path, instance)
            settings = block["resources_servers"][name]
            assert settings["package"] == "nemo_gym" and settings["entrypoint"] == "app.py", (path, instance)
            assert not {"checkpoint_mode", "checkpoint_verify"} & set(settings), (path, instance)
    rows = [json.loads(line) for path in sorted((folder / "data").glob("*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]
    assert rows, f"{name} has no rows"
    for row in rows:
        assert isinstance(row["responses_create_params"]["input"], list) and row["responses_create_params"]["input"]


def test_the_configs_load_as_one_mesh_with_the_judges_they_name() -> None:
    raw: dict[str, Any] = {"judge_worker": {"responses_api_models": {"inference_worker": {"engine": "script"}}}}
    judge = {"worker": {"type": "responses_api_models", "name": "judge_worker"}}
    for name in TWENTY:
        for path in _configs(name):
            raw |= yaml.safe_load(path.read_text())
    for block in list(raw.values()):
        for settings in block.get("resources_servers", {}).values():
            for value in settings.values():
                if isinstance(value, dict) and value.get("type") == "responses_api_models":
                    raw[value["name"]] = {"responses_api_models": {"policy_model": judge}}
    mesh = load_config_dict(raw)
    assert {instance.implementation for instance in mesh.of_type("resources_servers")} == set(TWENTY)


def test_docs_table_names_every_one_and_why_two_cannot_run() -> None:
    doc = DOC.read_text()
    rows = {line.split("|")[1].strip(): line for line in doc.splitlines() if line.startswith("| ")}
    assert set(TWENTY) <= set(rows), sorted(set(TWENTY) - set(rows))
    assert {name for name, verifier in NEMO_GYM_VERIFIERS.items() if verifier.cannot_run_here} == CANNOT_RUN
    for name in TWENTY:
        cannot = "| **no**:" in rows[name]
        assert cannot == (name in CANNOT_RUN), rows[name]


def _site_packages(python: str) -> Path:
    done = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, timeout=60, check=True)
    return Path(done.stdout.strip())


def test_each_named_class_is_the_one_nemo_gyms_app_defines() -> None:
    servers = _site_packages(nemo_gym_python()) / "resources_servers"
    for verifier in NEMO_GYM_VERIFIERS.values():
        source = servers / verifier.name / "app.py"
        assert source.is_file(), f"NeMo Gym's environment has no {source}"
        tree = ast.parse(source.read_text())
        classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
        assert verifier.server_class in classes, (verifier.name, verifier.server_class, sorted(classes))
