"""Fixtures of the interop tier: tests against the real NeMo Gym 0.7.0, run in its own Python.

NeMo Gym 0.7.0 needs Python 3.13, this project runs on 3.11, so the tier never imports it: its
tests run NeMo Gym in a subprocess of the interpreter named by ``NEMO_GYM_INTEROP_PYTHON`` (a venv
with ``nemo-gym==0.7.0``; ``scripts/nemo_gym_env.sh`` installs one, cached, and prints its path).

- ``ng_python``: that interpreter (session scope; its nemo_gym version is checked once). Without
  the variable the tier is skipped, naming the script; with ``NEMO_GYM_INTEROP_REQUIRED=1`` (set by
  ``.ci/run``) a missing or wrong interpreter fails instead.
- ``ng_root``: NeMo Gym's install root (its site-packages), where its server folders and their
  ``configs/`` and ``data/`` are.
- ``ng_json(script, *args, cwd=...)``: runs ``tests/interop/nemo_gym_side/<script>`` in that
  interpreter (bounded) and answers the JSON it prints on its last stdout line.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

PYTHON_ENV = "NEMO_GYM_INTEROP_PYTHON"
REQUIRED_ENV = "NEMO_GYM_INTEROP_REQUIRED"
NEMO_GYM_VERSION = "0.7.0"
INSTALLER = "scripts/nemo_gym_env.sh"
SIDE = Path(__file__).resolve().parent / "nemo_gym_side"
RUN_TIMEOUT_S = 120.0

NgJson = Callable[..., Any]


def _unavailable(reason: str) -> None:
    if os.environ.get(REQUIRED_ENV) == "1":
        pytest.fail(f"interop tier required ({REQUIRED_ENV}=1) but {reason}", pytrace=False)
    pytest.skip(f"{reason}: run `export {PYTHON_ENV}=$({INSTALLER})` (a Python 3.13 venv with "
                f"nemo-gym=={NEMO_GYM_VERSION})")


@pytest.fixture(scope="session")
def ng_python() -> Path:
    named = os.environ.get(PYTHON_ENV)
    if not named:
        _unavailable(f"{PYTHON_ENV} is not set")
    python = Path(str(named))
    if not python.is_file():
        _unavailable(f"{PYTHON_ENV}={python} is not a file")
    probe = subprocess.run([str(python), "-c", "import nemo_gym; print(nemo_gym.__version__)"],
                           capture_output=True, text=True, timeout=60, check=False)
    version = probe.stdout.strip()
    if probe.returncode != 0 or version != NEMO_GYM_VERSION:
        pytest.fail(f"{PYTHON_ENV}={python} has nemo_gym {version or probe.stderr.strip()[-200:]!r}, "
                    f"not {NEMO_GYM_VERSION}", pytrace=False)
    return python


@pytest.fixture(scope="session")
def ng_root(ng_python: Path) -> Path:
    probe = subprocess.run([str(ng_python), "-c", "import nemo_gym; print(nemo_gym.PARENT_DIR)"],
                           capture_output=True, text=True, timeout=60, check=True)
    return Path(probe.stdout.strip())


@pytest.fixture(scope="session")
def ng_json(ng_python: Path, tmp_path_factory: pytest.TempPathFactory) -> NgJson:
    scratch = tmp_path_factory.mktemp("nemo_gym_cwd")

    def run(script: str, *args: str, cwd: Path | None = None, timeout_s: float = RUN_TIMEOUT_S) -> Any:
        done = subprocess.run([str(ng_python), str(SIDE / script), *args], capture_output=True, text=True,
                              cwd=cwd or scratch, timeout=timeout_s, check=False)
        if done.returncode != 0:
            raise AssertionError(f"{script} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    return run
