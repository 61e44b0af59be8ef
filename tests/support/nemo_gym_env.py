"""The Python of the NeMo Gym server environment, for the tests that run NeMo Gym's own servers.

``$NEMO_GYM_PYTHON`` when it is set (``.ci/run`` sets it), else the interpreter that
``scripts/nemo_gym_env.sh`` prints: the cached environment, built from the package registries on
first use (several minutes), so that these tests never depend on a machine's leftovers.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from nemo_gym_ckpt.config import NEMO_GYM_PYTHON_ENV, PROJECT_ROOT

__all__ = ["ENV_SCRIPT", "nemo_gym_python"]

ENV_SCRIPT = PROJECT_ROOT / "scripts" / "nemo_gym_env.sh"
BUILD_TIMEOUT_S = 1800


def nemo_gym_python() -> str:
    python = os.environ.get(NEMO_GYM_PYTHON_ENV)
    if not python:
        built = subprocess.run([str(ENV_SCRIPT)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        assert built.returncode == 0, f"{ENV_SCRIPT} failed:\n{built.stderr[-3000:]}"
        python = built.stdout.strip()
    assert Path(python).is_file(), f"{NEMO_GYM_PYTHON_ENV}={python} is not an interpreter"
    return python
