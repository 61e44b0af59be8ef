"""Our config loader reads YAML scalars as NeMo Gym 0.7.0's loader (OmegaConf) does, on the same texts.

Each form of ``tests/support/yaml_scalars.SCALARS`` as a value (block, flow and list item) and as a
key, and each document of ``REFUSED``, is read by OmegaConf in NeMo Gym's Python (one run) and by
our ``load_yaml``: the values, types included, are the same, OmegaConf's is the table's, and a text
OmegaConf refuses we refuse too.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from nemo_gym_ckpt.config_yaml import YamlRefused, dump_yaml, load_yaml
from tests.support.yaml_scalars import REFUSED, SCALARS, encode

pytestmark = pytest.mark.interop


def _documents(text: str) -> list[str]:
    documents = [f"k: {text}\n", f"k:\n  - {text}\n"]
    if text and "," not in text:
        documents += [f"k: [{text}]\n", f"{text}: v\n"]
    return documents


DUMPED = [dump_yaml({"k": text}) for text, _ in SCALARS]
"""Each form, as a string, in the YAML we write for NeMo Gym's servers (and the head serves)."""
TEXTS = [document for text, _ in SCALARS for document in _documents(text)] + [text for text, _ in REFUSED] + DUMPED


@pytest.fixture(scope="module")
def omegaconf_values(ng_json: Any) -> dict[str, Any]:
    values: list[Any] = ng_json("yaml_values.py", json.dumps(TEXTS))
    return dict(zip(TEXTS, values, strict=True))


def _ours(text: str) -> Any:
    try:
        return encode(load_yaml(text))
    except (YamlRefused, yaml.YAMLError):
        return {"error": "refused"}


def test_every_text_reads_as_omegaconf_reads_it(omegaconf_values: dict[str, Any]) -> None:
    differ = {}
    for text in TEXTS:
        theirs, ours = omegaconf_values[text], _ours(text)
        if "error" in theirs and "error" in ours:
            continue
        if theirs != ours:
            differ[text] = {"omegaconf": theirs, "ours": ours}
    assert not differ, "\n".join(f"{text!r}: {json.dumps(both)}" for text, both in differ.items())


def test_the_unit_tiers_table_is_omegaconfs(omegaconf_values: dict[str, Any]) -> None:
    stale = {text: omegaconf_values[f"k: {text}\n"] for text, expected in SCALARS
             if omegaconf_values[f"k: {text}\n"] != encode({"k": expected})}
    assert not stale, stale
    assert all("error" in omegaconf_values[text] for text, _ in REFUSED)


def test_a_string_we_write_omegaconf_reads_as_that_string(omegaconf_values: dict[str, Any]) -> None:
    wrong = {text: omegaconf_values[dumped] for (text, _), dumped in zip(SCALARS, DUMPED, strict=True)
             if omegaconf_values[dumped] != encode({"k": text})}
    assert not wrong, wrong
