"""The policy model's chat format against transformers: the same text, the same ids.

``chat_format.py`` reads the model folder itself instead of importing transformers. Here each
template renders the same conversations through ``AutoTokenizer.apply_chat_template`` (the
reference, from the worker's dependencies) and through ``load_chat_format``, and the texts must be
equal; encode and decode must give transformers' ids and text.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from model_servers.inference_worker import default_model_data as data
from model_servers.inference_worker.model_dir import DEFAULT_MODEL_DIR
from model_servers.policy_model.chat_format import load_chat_format
from nemo_gym_ckpt.errors import ConfigError, InvalidRequest

pytestmark = pytest.mark.unit

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# Templates written here to reach what real templates use: namespaces and loop controls, tojson's
# options, raise_exception, special-token variables, reasoning fields, generation blocks, dict(),
# and the whitespace rules (trim_blocks, lstrip_blocks).
TEMPLATES = {
    "namespace_and_loop_controls": (
        "{%- set ns = namespace(last_user=-1) -%}"
        "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
        "{%- endfor -%}{{ bos_token }}"
        "{%- for m in messages -%}{%- if loop.index0 > ns.last_user and m.role == 'tool' -%}{%- break -%}{%- endif -%}"
        "{%- if m.role == 'system' -%}{%- continue -%}{%- endif -%}"
        "[{{ m.role }}:{{ loop.index0 }}]{{ m.content if m.content is string else '' }}{{ eos_token }}"
        "{%- endfor -%}{%- if add_generation_prompt -%}[assistant]{%- endif -%}"
    ),
    "tojson_options": (
        "{%- if tools -%}{{ tools | tojson(indent=2) }}\n{{ tools[0] | tojson(sort_keys=true) }}\n"
        "{{ {'é': 'ü <&>'} | tojson }}{{ {'é': 1} | tojson(ensure_ascii=true) }}{%- endif -%}"
        "{%- for m in messages -%}{{ m | tojson(separators=(',', ':')) }}{%- endfor -%}"
    ),
    "whitespace_rules": (
        "{% for m in messages %}\n"
        "    {% if m.role == 'user' %}\n"
        "<u>{{ m.content }}</u>\n"
        "    {% else %}\n"
        "<o>{{ m.role }}</o>\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}<a>{% endif %}"
    ),
    "reasoning_generation_and_dict": (
        "{%- for m in messages -%}{%- set d = dict(role=m.role, n=loop.index) -%}"
        "{%- if m.role == 'assistant' -%}{% generation %}<think>{{ m.reasoning_content or '' }}|{{ m.thinking or '' }}"
        "</think>{{ m.content }}{% endgeneration %}{%- else -%}{{ d.role }}{{ d.n }}{{ m.content }}{%- endif -%}"
        "{%- endfor -%}{{ pad_token }}{{ unk_token }}"
    ),
    "raises_on_a_system_message_after_the_first": (
        "{%- for m in messages -%}{%- if m.role == 'system' and not loop.first -%}"
        "{{ raise_exception('a system message must come first') }}{%- endif -%}{{ m.content }}{%- endfor -%}"
    ),
}


def conversations(rng: random.Random) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    """Conversations of the default model's task, with tools and without, and a few odd shapes."""
    out: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = []
    for _ in range(4):
        problem = data.make_problem(rng)
        messages = data.example_messages(problem)
        out += [(messages[:n], tools) for n in (1, 3, len(messages)) for tools in (data.TOOLS, None)]
    out.append(([{"role": "system", "content": "Be exact."},
                 {"role": "user", "content": [{"type": "text", "text": "part one, "},
                                              {"type": "text", "text": "two"}]},
                 {"role": "assistant", "content": "ok", "reasoning": "first I think"},
                 {"role": "user", "content": "ünïcode <&> and\nnewlines"}], None))
    out.append(([{"role": "developer", "content": "Terse."}, {"role": "user", "content": "hi"},
                 {"role": "assistant", "content": "", "thinking": "hm",
                  "tool_calls": [{"id": "c1", "type": "function",
                                  "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": "3"}], data.TOOLS))
    return out


def model_folder(root: Path, name: str, template: str | None) -> Path:
    folder = root / name
    folder.mkdir()
    for file in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / file, folder / file)
    if template is not None:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


REFERENCE = """
import json, sys
from transformers import AutoTokenizer
out = {}
for job_name, job in json.load(open(sys.argv[1])).items():
    tok = AutoTokenizer.from_pretrained(job["folder"])
    result = {"texts": [], "ids": [], "decoded": [], "vocab": len(tok), "eos": tok.eos_token}
    for messages, tools in job["chats"]:
        try:
            result["texts"].append(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                           tokenize=False))
        except Exception as error:
            result["texts"].append({"error": type(error).__name__})
    for text in job["texts"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        result["ids"].append(ids)
        result["decoded"].append(tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))
    out[job_name] = result
print(json.dumps(out))
"""


def reference(jobs: dict[str, tuple[Path, list[Any], list[str]]], tmp_path: Path) -> dict[str, dict[str, Any]]:
    """What transformers renders, encodes and decodes for each job (folder, chats, texts), each folder
    loaded on its own by ``AutoTokenizer``: all in one child process (the test process stays light,
    and transformers is imported once for the whole module)."""
    cases = tmp_path / "reference-cases.json"
    cases.write_text(json.dumps({name: {"folder": str(folder), "chats": chats, "texts": texts}
                                 for name, (folder, chats, texts) in jobs.items()}))
    done = subprocess.run([sys.executable, "-c", REFERENCE, str(cases)],
                          capture_output=True, text=True, timeout=300, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def ours(folder: Path, chats: list[Any]) -> list[Any]:
    fmt = load_chat_format(folder)
    texts: list[Any] = []
    for messages, tools in chats:
        try:
            texts.append(fmt.render(messages, tools))
        except InvalidRequest:
            texts.append({"error": "TemplateError"})
    return texts


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat-templates")
    shipped = model_folder(root, "default_model", None)
    return {"default_model": shipped, **{name: model_folder(root, name, source) for name, source in TEMPLATES.items()}}


TEMPLATE_NAMES = ["default_model", *TEMPLATES]


def chats_for(name: str) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    """The conversations each template renders (one more for the template that raises)."""
    chats = conversations(random.Random(11))
    if name == "raises_on_a_system_message_after_the_first":
        chats.append(([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}], None))
    return chats


def texts_to_encode(folder: Path) -> list[str]:
    """Rendered conversations of the default model, and a few odd strings."""
    fmt = load_chat_format(folder)
    texts = [fmt.render(messages, tools) for messages, tools in conversations(random.Random(4))]
    return [*texts, "", " leading and trailing ", "<|end|><|end|>", "ünïcode and \t tabs\n", '<tool_call>{"a":1}']


@pytest.fixture(scope="module")
def references(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """transformers' results for every test of this module, from one child process: each template's
    renderings (job ``render:<name>``) and the default model's encodings and decodings (``encode``)."""
    jobs = {f"render:{name}": (folders[name], chats_for(name), []) for name in TEMPLATE_NAMES}
    jobs["encode"] = (folders["default_model"], [], texts_to_encode(folders["default_model"]))
    return reference(jobs, tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_every_template_renders_the_text_transformers_renders(name: str, folders: dict[str, Path],
                                                              references: dict[str, dict[str, Any]]) -> None:
    expected = references[f"render:{name}"]["texts"]
    assert ours(folders[name], chats_for(name)) == expected
    assert any(isinstance(text, str) and text for text in expected), "the reference rendered something"


def test_encode_and_decode_give_the_ids_and_text_of_transformers(folders: dict[str, Path],
                                                                 references: dict[str, dict[str, Any]]) -> None:
    fmt = load_chat_format(folders["default_model"])
    texts = texts_to_encode(folders["default_model"])
    expected = references["encode"]
    assert [fmt.encode(text) for text in texts] == expected["ids"]
    assert [fmt.decode(ids) for ids in expected["ids"]] == expected["decoded"]
    assert (fmt.vocab_size, fmt.eos_text) == (expected["vocab"], expected["eos"])


def test_a_template_file_wins_over_the_config_and_a_broken_one_is_a_config_error(folders: dict[str, Path],
                                                                                   tmp_path: Path) -> None:
    folder = model_folder(tmp_path, "with_file", None)
    (folder / "chat_template.jinja").write_text("{{ messages | length }} messages")
    assert load_chat_format(folder).render([{"role": "user", "content": "x"}], None) == "1 messages"
    (folder / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="does not parse"):
        load_chat_format(folder)


def test_a_template_cannot_reach_private_names(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, "private", "{% set ns = namespace() %}{% set ns._x = 1 %}"
                                                "{{ messages.__class__ }}")
    with pytest.raises(InvalidRequest, match="refused"):
        load_chat_format(folder).render([{"role": "user", "content": "x"}], None)


def test_the_policy_model_imports_neither_transformers_nor_torch() -> None:
    code = ("import sys; from model_servers.policy_model.app import create_app; "
            "from model_servers.policy_model.chat_format import load_chat_format; "
            f"load_chat_format({str(DEFAULT_MODEL_DIR)!r}).render([{{'role': 'user', 'content': 'x'}}], None); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"
