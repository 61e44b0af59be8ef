"""``load_pretrained_tokenizer``: AutoTokenizer's tokenizer, without torch where the files settle it.

The default model's tokenizer loads through ``PreTrainedTokenizerFast`` directly and equals
AutoTokenizer's; a folder whose files name any other class (or a model type AutoTokenizer treats
specially) still goes through AutoTokenizer; a fresh interpreter that loads the default model's
tokenizer, or starts a script engine, never imports torch.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from model_servers.inference_worker.hf_tokenizer import (
    GENERIC_FAST_CLASSES,
    GENERIC_MODEL_TYPES,
    HFTokenizer,
    generic_fast_tokenizer,
    load_pretrained_tokenizer,
)
from model_servers.inference_worker.model_dir import resolve_model_path

DEFAULT = resolve_model_path(None)
TEXTS = [
    "What is 97 times 53?",
    "  leading and trailing spaces  ",
    "héllo wörld — ünïcödé ✓ 数学 🙂",
    "<|user|>hi<|end|><|assistant|><tool_call>{\"name\":\"add\"}</tool_call><|end|>",
    "<bos><pad><unk> plain <|system|>text",
    "",
]


def folder_like_default(tmp_path: Path, name: str, *, tokenizer: dict[str, Any] | None = None,
                        model: dict[str, Any] | None = None) -> Path:
    """The default model's tokenizer files and config, keys of their two configs replaced."""
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(DEFAULT / "tokenizer.json", folder / "tokenizer.json")
    for file, changes in (("tokenizer_config.json", tokenizer), ("config.json", model)):
        data = {**json.loads((DEFAULT / file).read_text()), **(changes or {})}
        (folder / file).write_text(json.dumps(data))
    return folder


def summary(tok: Any) -> dict[str, Any]:
    """What makes two tokenizers the same tokenizer, as far as the engines can tell."""
    return {
        "class": type(tok),
        "len": len(tok),
        "vocab": tok.get_vocab(),
        "special": {name: getattr(tok, name) for name in ("bos_token", "eos_token", "pad_token", "unk_token")},
        "special_ids": [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id],
        "all_special": tok.all_special_tokens,
        "added": {i: str(t) for i, t in tok.added_tokens_decoder.items()},
        "chat_template": tok.chat_template,
        "model_max_length": tok.model_max_length,
        "padding_side": tok.padding_side,
        "clean_up": tok.clean_up_tokenization_spaces,
        "encode": [tok.encode(t) for t in TEXTS],
        "encode_plain": [tok.encode(t, add_special_tokens=False) for t in TEXTS],
        "decode": [tok.decode(tok.encode(t), skip_special_tokens=False) for t in TEXTS],
        "decode_skip": [tok.decode(tok.encode(t), skip_special_tokens=True) for t in TEXTS],
        "chat": tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True,
                                        tokenize=False),
    }


def test_the_default_model_takes_the_direct_path() -> None:
    assert generic_fast_tokenizer(DEFAULT)


def test_the_default_tokenizer_equals_autotokenizers() -> None:
    direct = load_pretrained_tokenizer(DEFAULT)
    auto = AutoTokenizer.from_pretrained(str(DEFAULT))
    assert type(direct) is PreTrainedTokenizerFast
    assert direct.chat_template  # the default model ships one: it must come through
    assert summary(direct) == summary(auto)
    assert HFTokenizer.load(DEFAULT).encode(TEXTS[2]) == auto.encode(TEXTS[2])


@pytest.mark.parametrize("model_type", sorted(GENERIC_MODEL_TYPES))
@pytest.mark.parametrize("tokenizer_class", sorted(GENERIC_FAST_CLASSES))
def test_every_accepted_combination_is_what_autotokenizer_picks(tmp_path: Path, model_type: str,
                                                               tokenizer_class: str) -> None:
    """Each entry of the two allow-lists, checked against the installed transformers."""
    folder = folder_like_default(tmp_path, "m", tokenizer={"tokenizer_class": tokenizer_class},
                                 model={"model_type": model_type})
    assert generic_fast_tokenizer(folder)
    assert summary(load_pretrained_tokenizer(folder)) == summary(AutoTokenizer.from_pretrained(str(folder)))


@pytest.mark.parametrize(("tokenizer", "model", "expected"), [
    ({"tokenizer_class": "LlamaTokenizer"}, None, "LlamaTokenizer"),
    ({"tokenizer_class": "GPT2Tokenizer"}, None, "GPT2Tokenizer"),
    # a generic class, but a model type for which AutoTokenizer picks its own class
    (None, {"model_type": "qwen2"}, "Qwen2Tokenizer"),
])
def test_any_other_folder_goes_through_autotokenizer(tmp_path: Path, tokenizer: dict[str, str] | None,
                                                     model: dict[str, str] | None, expected: str) -> None:
    folder = folder_like_default(tmp_path, "other", tokenizer=tokenizer, model=model)
    assert not generic_fast_tokenizer(folder)
    loaded = HFTokenizer.load(folder).backend
    assert type(loaded).__name__ == expected
    assert summary(loaded) == summary(AutoTokenizer.from_pretrained(str(folder)))
    # the generic class would have tokenized differently: the fallback is not a formality
    assert loaded.encode(TEXTS[0]) != PreTrainedTokenizerFast.from_pretrained(str(folder)).encode(TEXTS[0])


def test_the_direct_path_needs_every_file_and_no_remote_code(tmp_path: Path) -> None:
    no_json = folder_like_default(tmp_path, "no-json")
    (no_json / "tokenizer.json").unlink()
    no_config = folder_like_default(tmp_path, "no-config")
    (no_config / "config.json").unlink()
    broken = folder_like_default(tmp_path, "broken")
    (broken / "tokenizer_config.json").write_text("{")
    remote = folder_like_default(tmp_path, "remote", tokenizer={"auto_map": {"AutoTokenizer": ["x.Tok", None]}})
    remote_model = folder_like_default(tmp_path, "remote-model", model={"auto_map": {"AutoConfig": "x.Cfg"}})
    no_class = folder_like_default(tmp_path, "no-class", tokenizer={"tokenizer_class": None})
    assert generic_fast_tokenizer(folder_like_default(tmp_path, "same"))
    for folder in (no_json, no_config, broken, remote, remote_model, no_class, tmp_path / "missing"):
        assert not generic_fast_tokenizer(folder), folder.name


def test_loading_the_default_tokenizer_or_a_script_engine_does_not_import_torch() -> None:
    code = (
        "import asyncio, sys\n"
        "from model_servers.inference_worker.hf_tokenizer import HFTokenizer\n"
        "from model_servers.inference_worker.model_dir import resolve_model_path\n"
        "HFTokenizer.load(resolve_model_path(None))\n"
        "loaded = 'torch' in sys.modules\n"
        "from model_servers.inference_worker.app import Config, load_engine\n"
        "engine = asyncio.run(load_engine(Config(engine='script', script=[], script_default='x')))\n"
        "print(type(engine).__name__, loaded, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip().splitlines()[-1] == "ScriptEngine False False"
