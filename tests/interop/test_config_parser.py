"""NeMo Gym 0.7.0's config parser and ours read the same configs the same way.

- NeMo Gym's parser (offline, in its own Python) finds every server instance of every config in
  ``configs/``, and of every server folder's config over the quickstart (NeMo Gym's own verifiers'
  folders under ``resources_servers/nemo_gym/`` included, a judge model added for those that name
  ``judge_model``), with our names, type keys and implementations; the only servers it adds are the
  relays it generates for agents that no environment server fronts.
- Our ``load_config`` loads NeMo Gym's own server YAMLs from the installed wheel, those
  docs/nemo-gym.md says load: string_match (with our model servers), simple_agent, single_agent_turn
  and legacy_agent (over the quickstart, their ``???`` set with ``++`` overrides).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from environment_servers.legacy_agent import app as legacy_app
from nemo_gym_ckpt.config import FOLDER_OF_TYPE, PROJECT_ROOT, MeshConfig, load_config
from nemo_gym_ckpt.errors import ConfigError

pytestmark = pytest.mark.interop

QUICKSTART = PROJECT_ROOT / "configs" / "quickstart.yaml"
MESH_CONFIGS = sorted((PROJECT_ROOT / "configs").glob("*.yaml"))
SERVER_CONFIGS = sorted(path for folder in FOLDER_OF_TYPE.values()
                        for path in (PROJECT_ROOT / folder).glob("*/configs/*.yaml"))
NEMO_GYM_SERVER_CONFIGS = sorted((PROJECT_ROOT / "resources_servers" / "nemo_gym").glob("*/configs/*.yaml"))
JUDGE = "judge_model.responses_api_models.policy_model"
JUDGE_MODEL = {f"{JUDGE}.entrypoint": "app.py", f"{JUDGE}.worker.type": "responses_api_models",
               f"{JUDGE}.worker.name": "inference_worker"}  # the judge the judge verifiers' configs name


def _settings_for(path: Path) -> dict[str, str]:
    return JUDGE_MODEL if "name: judge_model" in path.read_text() else {}


CASES: dict[str, tuple[list[Path], dict[str, str]]] = {
    str(path.relative_to(PROJECT_ROOT)): ([path], {}) for path in MESH_CONFIGS} | {
    f"quickstart + {path.relative_to(PROJECT_ROOT)}": ([QUICKSTART, path], _settings_for(path))
    for path in SERVER_CONFIGS + NEMO_GYM_SERVER_CONFIGS}
MODEL_CONFIGS = [PROJECT_ROOT / "model_servers" / name / "configs" / f"{name}.yaml"
                 for name in ("inference_worker", "policy_model")]


OLD_SHAPE = ("calc:\n  resources_servers:\n    calculator_tools: {}\n"
             "agent:\n  agents:\n    simple_agent:\n      model_server: {type: model_servers, name: m}\n")


@pytest.fixture(scope="module")
def old_shape(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config in this project's shape before it took NeMo Gym's."""
    path = tmp_path_factory.mktemp("old") / "old.yaml"
    path.write_text(OLD_SHAPE)
    return path


@pytest.fixture(scope="module")
def nemo_gym_parsed(ng_json: Any, old_shape: Path) -> dict[str, Any]:
    """NeMo Gym's reading of every case (and of the old shape), in one run of its parser."""
    cases = [{"id": case, "paths": [str(path) for path in paths],
              "overrides": [f"{key}={value}" for key, value in settings.items()]}
             for case, (paths, settings) in CASES.items()]
    cases.append({"id": "old shape", "paths": [str(old_shape)]})
    parsed: dict[str, Any] = ng_json("parse_configs.py", json.dumps(cases))
    return parsed


def servers_of(mesh: MeshConfig) -> dict[str, tuple[str, str]]:
    return {name: (inst.type, inst.implementation) for name, inst in mesh.instances.items()}


def unfronted_agents(mesh: MeshConfig) -> set[str]:
    fronted = {inst.settings.agent_server.name for inst in mesh.of_type("environment_servers")}  # type: ignore[attr-defined]
    return {inst.name for inst in mesh.of_type("responses_api_agents")} - fronted


@pytest.mark.parametrize("case", list(CASES))
def test_nemo_gyms_parser_finds_every_server_of_ours(case: str, nemo_gym_parsed: dict[str, Any]) -> None:
    paths, settings = CASES[case]
    ours = load_config(paths, [f"++{key}={value}" for key, value in settings.items()])
    theirs = nemo_gym_parsed[case]
    assert "error" not in theirs and theirs["almost"] == []
    found = {server["name"]: (server["type"], server["implementation"]) for server in theirs["servers"]}
    assert {name: found.get(name) for name in ours.instances} == servers_of(ours)
    relays = {server["agent_server"]: (server["type"], server["implementation"])
              for server in theirs["servers"] if server["name"] not in ours.instances}
    assert relays == dict.fromkeys(unfronted_agents(ours), ("environment_servers", "legacy_agent"))


def test_the_old_shape_is_found_by_nobody(nemo_gym_parsed: dict[str, Any], old_shape: Path) -> None:
    """What the parser tests above would see before the move: NeMo Gym found nothing in our old shape."""
    assert nemo_gym_parsed["old shape"] == {"servers": [], "almost": []}
    with pytest.raises(ConfigError, match="'agents' is the old type key: write 'responses_api_agents'"):
        load_config([old_shape])


# ---- NeMo Gym's YAMLs in our loader ------------------------------------------------------------------


def test_nemo_gyms_string_match_config_loads_with_our_model_servers(ng_root: Path) -> None:
    mesh = load_config([ng_root / "resources_servers/string_match/configs/string_match.yaml", *MODEL_CONFIGS])
    assert servers_of(mesh) == {
        "string_match": ("resources_servers", "string_match"),
        "string_match_simple_agent": ("responses_api_agents", "simple_agent"),
        "string_match_environment_server": ("environment_servers", "legacy_agent"),
        "inference_worker": ("responses_api_models", "inference_worker"),
        "policy_model": ("responses_api_models", "policy_model"),
    }
    relay = mesh.instance("string_match_environment_server").settings
    assert isinstance(relay, legacy_app.Config)
    assert relay.resources_in(mesh.instances).name == "string_match"  # the agent's resources server
    assert mesh.instance("string_match").settings.domain == "knowledge"


def test_nemo_gyms_simple_agent_config_over_the_quickstart_keeps_the_quickstarts_resources_server(
    ng_root: Path,
) -> None:
    """NeMo Gym's file leaves the agent's resources server ``???``. Merged over the quickstart, which names
    one, the name stays, as NeMo Gym's merge (OmegaConf's) keeps a value that ``???`` is merged over."""
    path = ng_root / "responses_api_agents/simple_agent/configs/simple_agent.yaml"
    key = "simple_agent.responses_api_agents.simple_agent.resources_server.name"
    assert "???" in path.read_text()  # the file itself requires the name
    for overrides in ([], [f"++{key}=calculator_tools"]):
        agent = load_config([QUICKSTART, path], overrides).instance("simple_agent")
        assert (agent.settings.model_server.name, agent.settings.resources_server.name) == (  # type: ignore[attr-defined]
            "policy_model", "calculator_tools")


def test_nemo_gyms_environment_configs_load(ng_root: Path) -> None:
    turn = "single_agent_turn.environment_servers.single_agent_turn"
    path = ng_root / "environment_servers/single_agent_turn/configs/single_agent_turn.yaml"
    names = [f"++{turn}.agent_server.name=simple_agent", f"++{turn}.resources_server.name=calculator_tools"]
    mesh = load_config([QUICKSTART, path], names)
    settings = mesh.instance("single_agent_turn").settings
    assert (settings.default_episode_timeout_seconds, settings.cleanup_timeout_seconds) == (  # type: ignore[attr-defined]
        21600, 180)
    relay = "legacy_agent_environment_server.environment_servers.legacy_agent"
    mesh = load_config([QUICKSTART, ng_root / "environment_servers/legacy_agent/configs/legacy_agent.yaml"],
                       [f"++{relay}.agent_server.name=simple_agent"])
    assert servers_of(mesh)["legacy_agent_environment_server"] == ("environment_servers", "legacy_agent")
