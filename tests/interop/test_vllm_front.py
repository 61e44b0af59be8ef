"""Interop (c): NeMo Gym's own ``vllm_model`` and ``simple_agent`` in front of our inference worker.

Real processes: our worker (uvicorn, launched by our launcher, serving the embedded default model)
stands in for a vLLM server. From the Python 3.13 venv that has ``nemo-gym`` installed, each started
the way ``gym env start`` starts it (the server's ``app.py`` with ``NEMO_GYM_CONFIG_DICT`` and
``NEMO_GYM_CONFIG_PATH``): NeMo Gym 0.7's ``vllm_model`` as in its ``vllm_model_for_training.yaml``
(token ids from vLLM's ``logprobs.content`` as ``token_id:<id>``, prompt ids from ``/tokenize``),
``simple_agent`` on it, ``string_match``, and a second ``vllm_model`` that asks for the ids inline
(``request_prompt_and_generation_token_ids``: top-level ``prompt_token_ids`` and ``choices[].token_ids``).

The agent's ``/run`` gives rows, the second model's ``/v1/responses`` Responses objects; the last
output item of each must carry ``prompt_token_ids``, ``generation_token_ids`` and
``generation_log_probs``, and they must be what our worker generates: the prompt ids are the worker's
own tokenization of the chat, and a greedy completion of those prompt ids gives the same ids, the
same logprobs and the item's text.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from model_servers.inference_worker import default_model_data as data
from nemo_gym_ckpt.config import load_config_dict
from nemo_gym_ckpt.launch.launcher import MeshLauncher, find_free_port

pytestmark = [pytest.mark.interop, pytest.mark.timeout(120)]

HOST = "127.0.0.1"
SERVED = "nemo-gym-ckpt-tiny"
READY_TIMEOUT_S = 60.0
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


@dataclass
class NgServer:
    """One NeMo Gym server process."""

    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def site_packages(python: Path) -> Path:
    out = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, timeout=30, check=True)
    return Path(out.stdout.strip())


def start_ng_server(python: Path, site: Path, config: dict[str, Any], name: str, workdir: Path) -> NgServer:
    """``<type>/<impl>/app.py`` of instance ``name``, as ``gym env start`` runs it (cwd: ``workdir``)."""
    [(type_key, impls)] = [(k, v) for k, v in config[name].items()]
    [(impl, settings)] = list(impls.items())
    server_dir = site / type_key / impl
    env = {**os.environ, "NEMO_GYM_CONFIG_DICT": yaml.safe_dump(config), "NEMO_GYM_CONFIG_PATH": name,
           "PYTHONPATH": str(server_dir), "PYTHONDONTWRITEBYTECODE": "1"}
    log = workdir / f"{name}.log"
    with log.open("wb") as sink:
        process = subprocess.Popen([python, str(server_dir / "app.py")], cwd=workdir, env=env, stdout=sink,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    return NgServer(name, settings["port"], process, log)


def wait_healthy(servers: list[NgServer], deadline: float) -> None:
    pending = list(servers)
    with httpx.Client(timeout=2) as http:
        while pending:
            for server in list(pending):
                if server.process.poll() is not None:
                    raise AssertionError(f"{server.name} exited {server.process.returncode}:\n{server.tail()}")
                try:
                    if http.get(f"{server.url}/health").status_code == 200:
                        pending.remove(server)
                except httpx.TransportError:
                    pass
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {s.name}\n{s.tail()}" for s in pending)
                raise AssertionError(f"not healthy before the deadline: {[s.name for s in pending]}\n{tails}")
            time.sleep(0.2)


def ng_config(worker_url: str, ports: dict[str, int]) -> dict[str, Any]:
    """The resolved global config the NeMo Gym servers are given (two vllm_model variants)."""

    def model(port: int, **extra: Any) -> dict[str, Any]:
        return {"responses_api_models": {"vllm_model": {
            "entrypoint": "app.py", "host": HOST, "port": port, "base_url": f"{worker_url}/v1", "api_key": "x",
            "model": SERVED, "return_token_id_information": True, "uses_reasoning_parser": False, **extra}}}

    def agent(port: int, model_name: str) -> dict[str, Any]:
        return {"responses_api_agents": {"simple_agent": {
            "entrypoint": "app.py", "host": HOST, "port": port,
            "resources_server": {"type": "resources_servers", "name": "string_match"},
            "model_server": {"type": "responses_api_models", "name": model_name}}}}

    return {
        "head_server": {"host": HOST, "port": ports["head"]},  # never contacted: the dict is given
        "dry_run": False,
        "policy_model": model(ports["policy_model"]),
        "policy_model_inline": model(ports["policy_model_inline"], request_prompt_and_generation_token_ids=True),
        "string_match": {"resources_servers": {"string_match": {
            "entrypoint": "app.py", "host": HOST, "port": ports["string_match"], "domain": "knowledge"}}},
        "agent": agent(ports["agent"], "policy_model"),
    }


@dataclass
class Front:
    worker_url: str
    urls: dict[str, str]  # NeMo Gym server name -> url


@pytest.fixture(scope="module")
def front(ng_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    workdir = tmp_path_factory.mktemp("ng-front")
    site = site_packages(ng_python)
    deadline = time.monotonic() + READY_TIMEOUT_S
    names = ["policy_model", "policy_model_inline", "string_match", "agent"]
    taken: set[int] = set()
    ports = {}
    for name in ["head", "worker", *names]:
        ports[name] = find_free_port(HOST, taken)
        taken.add(ports[name])
    worker = MeshLauncher(load_config_dict({
        "head_server": {"port": 0},
        "inference_worker": {
            "responses_api_models": {"inference_worker": {"port": ports["worker"], "torch_threads": 1}},
        },
    }))
    worker_url = f"http://{HOST}:{ports['worker']}"
    config = ng_config(worker_url, ports)
    servers: list[NgServer] = []
    try:  # NeMo Gym's servers start while ours does: none calls the worker before a request
        servers.extend(start_ng_server(ng_python, site, config, name, workdir) for name in names)
        worker.start(ready_timeout_s=READY_TIMEOUT_S)
        wait_healthy(servers, deadline)
        yield Front(worker_url, {s.name: s.url for s in servers})
    finally:
        for server in servers:
            server.stop()
        worker.stop()


def rows(count: int) -> list[dict[str, Any]]:
    """string_match rows on questions of the embedded model's kind, greedy and short."""
    out = []
    for index in range(count):
        question = data.make_problem(random.Random(100 + index))["question"]
        message = {"role": "user", "type": "message", "content": [{"type": "input_text", "text": question}]}
        out.append({"responses_create_params": {"input": [message], "temperature": 0.0, "max_output_tokens": 24},
                    "expected_answer": "unknowable", "extraction_mode": "full_response"})
    return out


def output_text(item: dict[str, Any]) -> str:
    return "".join(part["text"] for part in item["content"] if part["type"] == "output_text")


def check_tokens(http: httpx.Client, worker_url: str, row: dict[str, Any], response: dict[str, Any]) -> None:
    """The token fields of the response's last item are what our worker generates for the row's chat."""
    item = response["output"][-1]
    assert item["type"] == "message", item
    prompt, generation, logprobs = (item[field] for field in TOKEN_FIELDS)
    assert generation and len(generation) == len(logprobs)
    question = row["responses_create_params"]["input"][0]["content"][0]["text"]
    tokenized = http.post(f"{worker_url}/tokenize", json={"messages": [{"role": "user", "content": question}]})
    assert tokenized.json()["tokens"] == prompt
    again = http.post(f"{worker_url}/v1/completions", json={
        "prompt": prompt, "max_tokens": len(generation), "temperature": 0, "logprobs": 1, "return_token_ids": True,
    }).json()["choices"][0]
    assert again["token_ids"] == generation
    assert again["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=1e-4)
    assert again["text"] == output_text(item)


def test_simple_agent_rows_carry_our_workers_token_ids(front: Front) -> None:
    with httpx.Client(timeout=60) as http:
        for row in rows(3):
            reply = http.post(f"{front.urls['agent']}/run", json=row)
            assert reply.status_code == 200, f"{reply.status_code} {reply.text[:2000]}"
            result = reply.json()
            assert isinstance(result["reward"], float) and result["expected_answer"] == "unknowable"
            check_tokens(http, front.worker_url, row, result["response"])


def test_vllm_model_reads_the_inline_token_ids(front: Front) -> None:
    with httpx.Client(timeout=60) as http:
        for row in rows(2):
            reply = http.post(f"{front.urls['policy_model_inline']}/v1/responses", json=row["responses_create_params"])
            assert reply.status_code == 200, f"{reply.status_code} {reply.text[:2000]}"
            check_tokens(http, front.worker_url, row, reply.json())
