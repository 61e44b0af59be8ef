"""How the suite's files are spread over the xdist workers (``tests/support/parallel.py``): the e2e tier
is one unit of work, but for its files that start no server process, and every other file is its own."""

from __future__ import annotations

import pytest

from nemo_gym_ckpt.config import PROJECT_ROOT
from tests.support import parallel
from tests.support.parallel import E2E_TIER, TierFileScheduling

pytestmark = pytest.mark.unit

LAUNCHES = ("MeshLauncher", "launch_mesh", "nemo_gym_ckpt.cli.serve", '"run"', '"collect"', '"demo"', '"bench"')
"""What a file that starts server processes names (the launcher, or a command that launches a mesh)."""


def scope_of(nodeid: str) -> str:
    scheduling = TierFileScheduling.__new__(TierFileScheduling)  # the split needs no session
    return scheduling._split_scope(nodeid)


def test_the_e2e_tier_is_one_unit_and_every_other_file_its_own() -> None:
    assert scope_of("tests/e2e/test_crash_scenarios.py::test_a") == E2E_TIER
    assert scope_of("tests/e2e/test_demo.py::test_the_demo[x]") == E2E_TIER
    assert scope_of("tests/unit/test_cli.py::test_help") == "tests/unit/test_cli.py"
    server_test = "model_servers/policy_model/tests/test_app.py"
    assert scope_of(f"{server_test}::test_x") == server_test


def test_an_e2e_file_that_starts_no_server_process_is_a_file_of_its_own() -> None:
    kit = "tests/e2e/test_kit_from_wheel.py"  # builds a wheel; the kit's suite runs in process
    assert scope_of(f"{kit}::test_an_outside_server") == kit
    for path in parallel.OFF_TIER:
        assert path.startswith(E2E_TIER)
        assert scope_of(f"{path}::test_it") == path
        text = (PROJECT_ROOT / path).read_text()
        assert not [name for name in LAUNCHES if name in text], path
