"""Config files read here as NeMo Gym 0.7.0 reads them: its loader and its directive pass, in its Python.

- ``tests/support/config_file_cases.MERGES``: NeMo Gym's ``_inherit_from`` / ``_copy`` leave the
  table's tree, and so do ours (the order of the keys too).
- ``REFUSED_MERGES``: each file we refuse, NeMo Gym refuses too or leaves a directive unexpanded in
  its tree (the block is then not what the file says).
- ``MALFORMED``: NeMo Gym's loader refuses each file (a malformed ``${...}``), as we do;
  ``WELL_FORMED``: it loads each, as we do, to the same values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_ckpt.config_sources import CONFIG_PATHS, read_sources
from nemo_gym_ckpt.errors import ConfigError
from tests.support.config_file_cases import MALFORMED, MERGES, REFUSED_MERGES, WELL_FORMED

pytestmark = pytest.mark.interop

TEXTS = [text for _, text, _ in MERGES] + [text for _, text, _, _ in REFUSED_MERGES] + \
    [text for text, _ in MALFORMED] + WELL_FORMED


@pytest.fixture(scope="module")
def nemo_gym_read(ng_json: Any) -> dict[str, Any]:
    """NeMo Gym's reading of every text, in one run."""
    return dict(zip(TEXTS, ng_json("config_files.py", json.dumps(TEXTS)), strict=True))


def ours(text: str, folder: Path) -> dict[str, Any]:
    path = folder / "config.yaml"
    path.write_text(text)
    try:
        tree, _ = read_sources([path], [])
    except ConfigError as error:
        return {"error": str(error)}
    del tree[CONFIG_PATHS]
    return {"tree": tree}


def unexpanded(value: Any) -> bool:
    """Whether a directive is left in ``value``: a ``_inherit_from`` / ``_copy`` key, or its string."""
    if isinstance(value, dict):
        return bool({"_inherit_from", "_copy"} & set(value)) or any(unexpanded(item) for item in value.values())
    if isinstance(value, list):
        return any(unexpanded(item) for item in value)
    return isinstance(value, str) and value.startswith(("${inherit_from:", "${copy:"))


def test_directives_merge_as_nemo_gyms(nemo_gym_read: dict[str, Any], tmp_path: Path) -> None:
    differ = {case: {"nemo_gym": nemo_gym_read[text], "ours": ours(text, tmp_path), "table": tree}
              for case, text, tree in MERGES
              if not json.dumps(nemo_gym_read[text]) == json.dumps(ours(text, tmp_path)) == json.dumps({"tree": tree})}
    assert not differ, json.dumps(differ, indent=1)


def test_directives_refused_here_are_refused_or_left_unexpanded_by_nemo_gym(
        nemo_gym_read: dict[str, Any], tmp_path: Path) -> None:
    taken = {case: nemo_gym_read[text] for case, text, _, _ in REFUSED_MERGES
             if "error" not in ours(text, tmp_path) or not (
                 nemo_gym_read[text].get("at") == "directives" or unexpanded(nemo_gym_read[text].get("tree")))}
    assert not taken, json.dumps(taken, indent=1)


def test_malformed_interpolations_are_refused_by_both_loaders(nemo_gym_read: dict[str, Any], tmp_path: Path) -> None:
    for text, _ in MALFORMED:
        theirs = nemo_gym_read[text]
        assert (theirs.get("at"), theirs.get("error", "").split(":")[0]) == ("load", "GrammarParseError"), text
        assert "error" in ours(text, tmp_path), text


def test_well_formed_strings_load_alike(nemo_gym_read: dict[str, Any], tmp_path: Path) -> None:
    differ = {text: (nemo_gym_read[text], ours(text, tmp_path)) for text in WELL_FORMED
              if nemo_gym_read[text] != ours(text, tmp_path)}
    assert not differ, differ
