"""Our override values are NeMo Gym 0.7.0's: Hydra 1.3.8 in its Python, on the same arguments.

Each text of ``tests/support/override_values.VALUES`` as ``++k=<text>``, each of ``REFUSED``, and a
few argument lists that set one key more than once, are composed by Hydra's own steps in NeMo Gym's
Python, and all that Hydra accepts by NeMo Gym's own command-line reader in one run
(``nemo_gym_side/override_values.py``): the values, types included, are ours and the table's, and
what Hydra refuses we refuse (but ``shuffle()``, which Hydra evaluates to a random order and we
refuse).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from nemo_gym_ckpt.config_interpolations import interpolation_problem
from nemo_gym_ckpt.config_sources import parse_overrides, read_sources
from nemo_gym_ckpt.errors import ConfigError
from tests.support.override_values import REFUSED, VALUES
from tests.support.yaml_scalars import encode

pytestmark = pytest.mark.interop

TOGETHER = [["++a={x: 1, y: {p: 1}}", "++a={y: {q: 2}}", "++a.z=3"], ["++a=5", "++a.b=1"],
            ["++a=null", "++a.b=1"], ["++a=[1, 2]", "++a=[3]"], ["++a={x: 1}", "++a=null"],
            ["++a=1", "+b.c=[x, {d: 2.5}]", "++e=''"],
            ["hydra/job_logging=disabled", "++hydra.output_subdir=null", "++a=1"],
            # ??? replaces what an earlier override set, but in a mapping merged over a mapping keeps it
            ["++a=1", "++a=???"], ["++a={x: 1, y: 2}", "++a={x: ???, z: ???}"], ["++a=[1, 2]", "++a.1=???"],
            # a number through a list set earlier sets its item
            ["++a=[1, {b: 2}, [3], 4]", "++a.0=x", "++a.1.c=3", "++a.2.0=5", "++a.3.d=6", "++a.1={e: 7}"],
            # Hydra's key grammar (a second override, so that the whole key is compared)
            *([key, "++z=1"] for key in ("++$a.b-c.0=1", "++a.1_0.b$=1", "++1.5=1", "++0.1=1", "+a_-=1"))]
REFUSED_TOGETHER = [
    # a mapping and a list do not merge; a list has no item past its end, nor one named by a name
    ["++a=[1]", "++a={x: 1}"], ["++a={x: 1}", "++a=[1]"], ["++a={x: [1]}", "++a={x: {y: 1}}"],
    ["++a=[1, {x: 1}]", "++a.1=[1]"], ["++a=[1, 2]", "++a.5=1"], ["++a={x: [1]}", "++a.x.y=1"],
    *([key, "++z=1"] for key in ("++a..b=1", "++a.=1", "++.a=1", "++a b=1", "++0=1", "++01=1", "++a.01=1", "++-a=1",
                                 "++a:b=1", "++a.1a=1", "+++a=1", "++a@b=1", "a.b@c=1", "++a.b/c=1", "++\u00fc=1"))]
NOT_BUILT = ("shuffle(",)
ONE = [[f"++k={text}"] for text, _ in VALUES] + [[f"++k={text}"] for text, _ in REFUSED]
CASES = ONE + TOGETHER + REFUSED_TOGETHER


@pytest.fixture(scope="module")
def hydra(ng_json: Any) -> dict[str, Any]:
    answer: dict[str, Any] = ng_json("override_values.py", json.dumps(CASES))
    return answer


def ours(arguments: list[str], empty: Path) -> Any:
    """One ``++k=`` override: its value as parsed (keys typed, as Hydra's); several: the merged tree."""
    try:
        if len(arguments) == 1:
            return encode({key[0]: value for key, value in parse_overrides(arguments)})
        tree, _ = read_sources([empty], arguments)
    except ConfigError:
        return {"error": "refused"}
    tree.pop("config_paths")
    return encode(tree)


def test_hydras_steps_are_nemo_gyms_reading(hydra: dict[str, Any]) -> None:
    """Every list Hydra's steps accept reads the same in NeMo Gym's own reader, under its prefix c<index>."""
    accepted = {f"c{index}": result for index, result in enumerate(hydra["cases"]) if "error" not in result}
    assert len(accepted) >= len(VALUES) + len(TOGETHER)
    nemo_gym = {json.loads(json.dumps(key))[1].strip("'"): value for key, value in hydra["nemo_gym"]["dict"]}
    assert nemo_gym == accepted


def test_every_override_reads_as_hydra_reads_it(hydra: dict[str, Any], tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    differ = {}
    for case, theirs in zip(CASES, hydra["cases"], strict=True):
        mine = ours(case, empty)
        if ("error" in theirs and "error" in mine) or case[0].startswith(tuple(f"++k={n}" for n in NOT_BUILT)):
            continue
        if theirs != mine:
            differ[" ".join(case)] = {"hydra": theirs, "ours": mine}
    assert not differ, "\n".join(f"{case}: {json.dumps(both)}" for case, both in differ.items())


def test_the_unit_tiers_table_is_hydras(hydra: dict[str, Any]) -> None:
    read = dict(zip((json.dumps(case) for case in CASES), hydra["cases"], strict=True))
    stale = {text: read[json.dumps([f"++k={text}"])] for text, expected in VALUES
             if read[json.dumps([f"++k={text}"])] != encode({"k": expected})}
    assert not stale, stale
    assert [case for case in REFUSED_TOGETHER if "error" not in read[json.dumps(case)]] == []
    refused_by_hydra = {text for text, _ in REFUSED if "error" in read[json.dumps([f"++k={text}"])]}
    assert refused_by_hydra == {text for text, _ in REFUSED if not text.startswith(NOT_BUILT)}


def test_interpolations_are_checked_as_omegaconf_checks_them(ng_json: Any) -> None:
    """Random strings holding ``${`` of the grammar's own characters, taken or refused by
    ``interpolation_problem`` exactly when NeMo Gym's OmegaConf takes or refuses them."""
    rng = random.Random(49)
    pieces = ["${", "${", "$", "{", "}", "\\", ".", ":", ",", "[", "]", "'", '"', "a", "b1", "1", " ", "-", "(",
              "=", "oc.env", "null", "é", "@", "${a}", "${f:x,", "{k: v}", "\\${", "..", "\t"]
    texts = sorted({"${" + "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12))) for _ in range(3000)})
    taken = ng_json("interpolations.py", json.dumps(texts))
    differ = {text: theirs for text, theirs in zip(texts, taken, strict=True)
              if theirs != (interpolation_problem(text) is None)}
    assert sum(taken) >= 40 and not differ, differ  # 49 taken with this seed
