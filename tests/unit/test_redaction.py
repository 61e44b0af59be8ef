"""The redaction of the config the head serves (``launch/redaction.py``).

Real secrets stay out of the reply: every key named like a credential (in any spelling, the plurals
that name credentials, an ``Authorization`` header), a copy of such a value inside another string,
and a URL's ``user:password@``. What is no secret is served as it is: a server's host (discovery
builds the URLs from it), the values of other headers, a tokenizer's special tokens and the chat
template and stop list that hold them, a ``*_header`` text, prose with the word "bearer", the
``git@`` of an ``ssh`` URL. The work is linear in the length of a string.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import yaml

from nemo_gym_ckpt.checkpoint.coordinator import servers_in_config
from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.launch.head import global_config_yaml
from nemo_gym_ckpt.launch.redaction import REDACTED, is_secret_key, redacted, secret_values

pytestmark = pytest.mark.unit

HEADER_TOKEN = "hdr-" + "z9" * 12
API_KEY = "sk-upstream-api-key-0123456789"


def _served(config: dict[str, Any]) -> Any:
    """``config`` as the head serves it, read back from its YAML."""
    return yaml.safe_load(yaml.safe_dump(redacted(config, secret_values(config)), sort_keys=False))


def test_discovery_finds_every_server_when_a_header_names_the_host() -> None:
    mesh = load_config_dict({
        "head_server": {"host": "127.0.0.1", "port": 15400},
        "calc": {"resources_servers": {"calculator_tools": {"host": "gpu-node-17", "port": 8001}}},
        "sm": {"resources_servers": {"string_match": {"host": "gpu-node-17", "port": 8002}}},
    })
    block = mesh.raw["calc"]["resources_servers"]["calculator_tools"]
    block["extra_headers"] = {"X-Forwarded-Host": "gpu-node-17", "Content-Type": "application/json",
                              "Authorization": f"Bearer {HEADER_TOKEN}"}
    block["judge_url"] = "http://gpu-node-17:9/v1"
    config = yaml.safe_load(global_config_yaml(mesh))
    assert servers_in_config(config) == [{"name": "calc", "url": "http://gpu-node-17:8001"},
                                         {"name": "sm", "url": "http://gpu-node-17:8002"}]
    got = config["calc"]["resources_servers"]["calculator_tools"]
    assert got["judge_url"] == "http://gpu-node-17:9/v1"
    assert got["extra_headers"] == REDACTED  # the headers, one of which is a credential, are not served


def test_a_host_is_never_redacted_even_when_a_secret_has_its_text() -> None:
    config = {"m": {"t": {"i": {"host": "gpu-node-17", "port": 8000, "password": "gpu-node-17"}}}}
    got = _served(config)["m"]["t"]["i"]
    assert (got["host"], got["password"]) == ("gpu-node-17", REDACTED)


def test_a_tokenizers_tokens_templates_and_stop_lists_are_kept() -> None:
    model = {
        "max_tokens": 512, "num_tokens": 3, "token_ids": [1, 2], "tokenizer": "Qwen/Qwen3-8B",
        "eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "pad_token": "<|endoftext|>",
        "abstention_token": "[IDK]", "stop": ["<|im_end|>", "<|im_end|>\n"],
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
        "response_format_mime": "application/json; charset=utf-8",
    }
    assert _served({"model": dict(model)})["model"] == model


def test_prompt_headers_prose_and_ssh_urls_are_kept() -> None:
    block = {
        "prompt_header": "Solve the following problem.", "csv_header": "question,answer",
        "system_header": "You are a careful grader.",
        "system_prompt": "Solve the following problem. Put the final answer in \\boxed{}.",
        "judge_prompt": "You are the bearer responsible for grading.",
        "repo_url": "git+ssh://git@github.com/NVIDIA/NeMo-Gym.git",
        "mirror": "https://mirror.example/simple", "with_port": "http://gpu-node-17:8001/v1",
    }
    assert _served({"math": dict(block)})["math"] == block


def test_every_secret_key_of_the_old_redaction_and_the_new_spellings_are_redacted() -> None:
    secrets = {
        "token": "t" * 20, "control_auth_token": "c" * 20, "api_key": API_KEY, "apikey": "a" * 20,
        "key": "k" * 20, "secret": "s" * 20, "secret_key": "sk" * 10, "password": "p" * 20,
        "passwd": "w" * 20, "credentials": {"user": "u", "pass": "q" * 20}, "credential": "r" * 20,
        "otlp_headers": {"x-custom": "h" * 20}, "hf-token": "hf_" + "Q" * 30, "apiKey": "b" * 20,
        "api_keys": ["sk-listed-key-0123456789", {"backup": "sk-backup-key-0123456789"}],
        "hf_tokens": ["hf_" + "R" * 30], "github_token": "ghp_" + "G" * 36, "basic_auth": "user:" + "v" * 20,
    }
    got = _served({"block": {**secrets, "use_auth_token": True, "max_new_tokens": 64, "sort_keys": False}})
    assert got["block"] == {**dict.fromkeys(secrets, REDACTED), "use_auth_token": True,
                            "max_new_tokens": 64, "sort_keys": False}
    assert all(is_secret_key(key) for key in ("X-Api-Key", "Authorization", "Proxy-Authorization", "Cookie"))


def test_a_key_that_names_a_field_is_served_and_its_value_is_kept_in_other_strings() -> None:
    block = {
        "answer_key": "expected_answer", "label_key": "gold_label_column", "sort_key": "problem_id",
        "primary_key": "task_identifier", "input_key": "question",
        "prompt": "Compare the reply with the expected_answer column; ties go by problem_id.",
    }
    assert _served({"verifier": dict(block)})["verifier"] == block
    assert not any(is_secret_key(key) for key in ("answer_key", "answerKey", "label-key", "cache_key", "keys"))


def test_a_key_named_for_no_field_is_a_credential_and_a_fields_key_with_a_credentials_value_too() -> None:
    secrets = {"webhook_key": "wh-s3cr3t-2024", "db_key": "correct horse battery staple",
               "gateway_key": "Bearer gw_9f8e7d6c5b4a3928171605f4", "acme_keys": ["k1", "k2"],
               "answer_key": "sk-proj-4f9a8b7c6d5e4f3a2b1c"}
    fields = {"split_key": "train_2024_v1", "answer_key_text": "kept", "question_key": "the answer is 42",
              "max_keys": 256, "num_keys": 4, "webhook_keys": 3, "required_keys": ["expected_answer", "question"],
              "group_by_key": "task_id", "system_prompt": "Compare with expected_answer."}
    command = "serve --webhook-secret wh-s3cr3t-2024 --db 'correct horse battery staple'"
    got = _served({"block": {**secrets, **fields, "start_command": command}})["block"]
    assert got == {**dict.fromkeys(secrets, REDACTED), **fields,
                   "start_command": f"serve --webhook-secret {REDACTED} --db '{REDACTED}'"}


def test_keys_named_for_a_credential_or_its_issuer_stay_redacted() -> None:
    secrets = {
        "access_key": "AKIA" + "A" * 16, "AWS_SECRET_ACCESS_KEY": "w" * 40, "private_key": "-----BEGIN " + "x" * 30,
        "ssh_key": "ssh-ed25519 " + "y" * 30, "openai_key": "sk-" + "o" * 30, "wandb_key": "z" * 40,
        "X-Api-Key": "xk-" + "m" * 30, "client-key": "ck-" + "n" * 30, "secretkey": "j" * 30,
    }
    got = _served({"block": {**secrets, "note": f"the key is {secrets['openai_key']}"}})
    assert got["block"] == {**dict.fromkeys(secrets, REDACTED), "note": f"the key is {REDACTED}"}


def test_an_authorization_headers_credential_is_redacted_wherever_it_is_copied() -> None:
    config = {
        "model": {"default_headers": {"Authorization": f"Bearer {HEADER_TOKEN}", "Accept": "text/plain"},
                  "proxy": {"Proxy-Authorization": f"Basic {API_KEY}"}},
        "notes": {
            "curl": f"curl -H 'Authorization: Bearer {HEADER_TOKEN}' https://example.test",
            "proxy_note": f"the proxy takes {API_KEY}",
        },
    }
    got = _served(config)
    assert got["model"] == {"default_headers": REDACTED, "proxy": {"Proxy-Authorization": REDACTED}}
    assert got["notes"] == {"curl": f"curl -H 'Authorization: {REDACTED}' https://example.test",
                            "proxy_note": f"the proxy takes {REDACTED}"}


def test_a_password_in_a_url_is_redacted_known_or_not() -> None:
    config = {"urls": {
        "judge_base_url": f"https://user:{API_KEY}@judge.example/v1",
        "mirror_url": "https://svc:unknown-password@mirror.example/simple",
        "db": "see postgresql://admin:hunter2hunter2@db.example:5432/x for the rows",
        "user_only": "https://user@host.example/x",
        "token_as_user": "https://ghp_0123456789abcdefABCDEF@github.com/o/r.git",
    }}
    assert _served(config)["urls"] == {
        "judge_base_url": f"https://{REDACTED}@judge.example/v1",
        "mirror_url": f"https://{REDACTED}@mirror.example/simple",
        "db": f"see postgresql://{REDACTED}@db.example:5432/x for the rows",
        "user_only": "https://user@host.example/x",
        "token_as_user": f"https://{REDACTED}@github.com/o/r.git",
    }


def _best_of_3_s(config: dict[str, Any]) -> float:
    times = []
    for _ in range(3):
        started = time.perf_counter()
        redacted(config, secret_values(config))
        times.append(time.perf_counter() - started)
    return min(times)


def test_redaction_is_linear_in_a_long_dotted_string() -> None:
    length = 20_000
    hostile = ("a." * length)[: length - 3] + "://"  # a scheme-like run no URL pattern may rescan
    harmless = "x" * (length - 3) + "://"
    secret = {"api_key": API_KEY}
    hostile_s = _best_of_3_s({"m": {"x": hostile, **secret}})
    harmless_s = _best_of_3_s({"m": {"x": harmless, **secret}})
    assert hostile_s < 20 * harmless_s + 0.005, (hostile_s, harmless_s)
