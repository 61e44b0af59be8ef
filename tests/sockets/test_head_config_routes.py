"""The head server's NeMo Gym routes on a real socket: ``/global_config_dict_yaml`` and ``/server_instances``.

``/global_config_dict_yaml`` must be what NeMo Gym's ``ServerClient.load_from_global_config`` reads
(``json.loads`` of the body gives the YAML text), hold every instance with its host and port, and
leak no secret: the control token, an API key, and a copy of the token under another key are all
redacted, while a plural like ``max_tokens`` is no secret; so are keys spelled ``hf-token``,
``api_keys`` (a list) and ``authorization``, and a secret inside a longer string (URL userinfo,
``Bearer ...``). The coordinator's discovery (and NeMo
Gym's rule: instance -> first type key -> first implementation -> host/port) finds every server in
it. ``/server_instances`` has exactly the fields of NeMo Gym's ``ServerInstanceDisplayConfig``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from nemo_gym_ckpt.checkpoint.coordinator import servers_in_config
from nemo_gym_ckpt.config import PROJECT_ROOT, load_config_dict
from nemo_gym_ckpt.launch.head import create_head_app
from nemo_gym_ckpt.launch.redaction import REDACTED

pytestmark = pytest.mark.sockets

TOKEN = "ctl-" + "s3cr3t" * 4
API_KEY = "sk-upstream-api-key-0123456789"
OTLP_AUTH = "Bearer otlp-collector-credential"
RAW: dict[str, Any] = {
    "head_server": {"host": "127.0.0.1", "port": 15400},
    "checkpoint": {"enabled": True, "control_auth_token": TOKEN},
    "telemetry": {"enabled": True, "otlp_headers": {"authorization": OTLP_AUTH}},
    "front": {"responses_api_models": {"policy_model": {
        "port": 15401, "max_tokens": 77,
        "upstream": {"base_url": "http://127.0.0.1:9/v1", "api_key": API_KEY, "model": "m"}}}},
    "sm": {"resources_servers": {"string_match": {"port": 15402, "host": "127.0.0.1"}}},
    "sm_copy": {"resources_servers": {"string_match": {"port": 15403}}},
}
DISPLAY_FIELDS = {"config_path", "dir_path", "entrypoint", "host", "name", "pid", "port", "process_name",
                  "server_type", "start_time", "status", "uptime_seconds", "url"}


def _mesh() -> Any:
    mesh = load_config_dict(RAW)
    # a secret copied into another (non-secret) key, as an interpolation of the token would put it
    mesh.raw["sm_copy"]["resources_servers"]["string_match"]["notes"] = TOKEN
    return mesh


def test_global_config_dict_yaml_is_nemo_gyms_json_string_of_the_redacted_config(
    serve_app: Callable[[Any], str]
) -> None:
    mesh = _mesh()
    url = serve_app(create_head_app(mesh))
    with httpx.Client(trust_env=False, timeout=5.0) as http:
        reply = http.get(f"{url}/global_config_dict_yaml")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("application/json")
    text = json.loads(reply.content)  # what NeMo Gym's ServerClient does first
    assert isinstance(text, str)
    config = yaml.safe_load(text)
    assert TOKEN not in reply.text and API_KEY not in reply.text and OTLP_AUTH not in reply.text
    assert config["telemetry"]["otlp_headers"] == REDACTED  # headers carry credentials
    assert config["checkpoint"]["control_auth_token"] == REDACTED
    assert config["front"]["responses_api_models"]["policy_model"]["upstream"]["api_key"] == REDACTED
    assert config["sm_copy"]["resources_servers"]["string_match"]["notes"] == REDACTED
    assert config["front"]["responses_api_models"]["policy_model"]["max_tokens"] == 77
    for name, port in (("front", 15401), ("sm", 15402), ("sm_copy", 15403)):
        block = next(iter(next(iter(config[name].values())).values()))
        assert (block["host"], block["port"]) == ("127.0.0.1", port), name  # the default host written out
    assert servers_in_config(config) == [
        {"name": "front", "url": "http://127.0.0.1:15401"},
        {"name": "sm", "url": "http://127.0.0.1:15402"},
        {"name": "sm_copy", "url": "http://127.0.0.1:15403"},
    ]


def test_server_instances_are_nemo_gyms_display_configs(serve_app: Callable[[Any], str]) -> None:
    mesh = _mesh()
    started = time.time()
    url = serve_app(create_head_app(mesh, processes=lambda: {"sm": (4242, started)}))
    with httpx.Client(trust_env=False, timeout=5.0) as http:
        instances = http.get(f"{url}/server_instances").json()
    assert [entry["process_name"] for entry in instances] == ["front", "sm", "sm_copy"]
    assert all(set(entry) == DISPLAY_FIELDS for entry in instances)
    sm = instances[1]
    assert sm == {"config_path": "sm", "dir_path": str(PROJECT_ROOT / "resources_servers" / "string_match"),
                  "entrypoint": "app.py", "host": "127.0.0.1", "name": "string_match", "pid": 4242,
                  "port": 15402, "process_name": "sm", "server_type": "resources_servers",
                  "start_time": started, "status": None, "uptime_seconds": None,
                  "url": "http://127.0.0.1:15402"}
    assert Path(sm["dir_path"], sm["entrypoint"]).is_file()
    assert instances[0]["pid"] is None and instances[0]["start_time"] is None  # not running here


def test_global_config_dict_yaml_redacts_secret_keys_of_every_spelling_and_secrets_inside_strings(
    serve_app: Callable[[Any], str]
) -> None:
    hf_token, listed, header_token = "hf_" + "Q" * 30, "sk-listed-key-0123456789", "hdr-" + "z9" * 12
    mesh = _mesh()
    block = mesh.raw["sm_copy"]["resources_servers"]["string_match"]
    block.update({
        "hf-token": hf_token,  # a hyphen
        "api_keys": [listed, {"backup": listed + "-2"}],  # a plural key, a list holding a mapping
        "authorization": f"Bearer {header_token}",
        "judge_base_url": f"https://user:{API_KEY}@judge.example/v1",  # a known secret in URL userinfo
        "judge_headers_text": f"Authorization: Bearer {API_KEY}",  # ... inside a longer string
        "curl": f"curl -H 'Authorization: Bearer {header_token}' https://{hf_token}@hub.example/x",
        "mirror_url": "https://svc:unknown-password@mirror.example/simple",  # userinfo of no known secret
        "sort_keys": False, "max_new_tokens": 64, "use_auth_token": True,  # no secrets
    })
    url = serve_app(create_head_app(mesh))
    with httpx.Client(trust_env=False, timeout=5.0) as http:
        reply = http.get(f"{url}/global_config_dict_yaml")
    text = json.loads(reply.content)
    for secret in (TOKEN, API_KEY, hf_token, listed, header_token, "unknown-password"):
        assert secret not in text, secret
    got = yaml.safe_load(text)["sm_copy"]["resources_servers"]["string_match"]
    assert got["hf-token"] == got["api_keys"] == got["authorization"] == REDACTED
    assert got["judge_base_url"] == f"https://{REDACTED}@judge.example/v1"
    assert got["judge_headers_text"] == f"Authorization: Bearer {REDACTED}"
    # the whole known value "Bearer hdr-..." of authorization is replaced, the URL's userinfo too
    assert got["curl"] == f"curl -H 'Authorization: {REDACTED}' https://{REDACTED}@hub.example/x"
    assert got["mirror_url"] == f"https://{REDACTED}@mirror.example/simple"
    assert (got["sort_keys"], got["max_new_tokens"], got["use_auth_token"]) == (False, 64, True)
    assert got["port"] == 15403
