"""The shipped YAML (quickstart mesh, the server's snippet) and where the tokenizer comes from."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_servers.policy_model.app import Config, tokenizer_dir
from nemo_gym_ckpt.config import load_config, load_config_dict
from nemo_gym_ckpt.errors import ConfigError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
WORKER_REF = {"type": "responses_api_models", "name": "inference_worker"}


def test_quickstart_wires_the_policy_model_to_the_worker() -> None:
    mesh = load_config([REPO / "configs" / "quickstart.yaml"])
    settings = mesh.instance("policy_model").settings
    assert isinstance(settings, Config)
    assert settings.worker is not None
    assert mesh.instance(settings.worker.name).implementation == "inference_worker"
    assert settings.return_token_ids is True
    assert (mesh.head_server.host, mesh.head_server.port) == ("127.0.0.1", 11000)


def test_server_snippet_loads_beside_the_worker_snippet() -> None:
    mesh = load_config(
        [
            REPO / "model_servers" / "inference_worker" / "configs" / "inference_worker.yaml",
            REPO / "model_servers" / "policy_model" / "configs" / "policy_model.yaml",
        ]
    )
    settings = mesh.instance("policy_model").settings
    assert isinstance(settings, Config) and settings.upstream is None and settings.max_tokens == 256


def test_tokenizer_comes_from_the_worker_model_unless_named(tmp_path: Path) -> None:
    for name in ("config.json", "tokenizer_config.json"):
        (tmp_path / name).write_text("{}")
    raw = {
        "inference_worker": {"responses_api_models": {"inference_worker": {"model_path": str(tmp_path)}}},
        "policy_model": {"responses_api_models": {"policy_model": {"worker": WORKER_REF}}},
    }
    mesh = load_config_dict(raw)
    settings = mesh.instance("policy_model").settings
    assert isinstance(settings, Config)
    assert tokenizer_dir(settings, mesh) == tmp_path.resolve()
    named = settings.model_copy(update={"tokenizer_path": Path("/elsewhere")})
    assert tokenizer_dir(named, mesh) == Path("/elsewhere")


@pytest.mark.parametrize("setting", ["generation_cuts", "hold_generation_in_checkpoints"])
def test_cuts_and_holds_need_the_policy_participant_and_a_worker(setting: str) -> None:
    upstream = {"base_url": "http://127.0.0.1:9/v1", "model": "m"}
    for settings in ({"worker": WORKER_REF}, {"upstream": upstream, "checkpoint_policy": True}):
        raw = {"inference_worker": {"responses_api_models": {"inference_worker": {}}},
               "policy_model": {"responses_api_models": {"policy_model": {**settings, setting: True}}}}
        with pytest.raises(ConfigError, match=f"{setting} needs checkpoint_policy: true and a worker"):
            load_config_dict(raw)
