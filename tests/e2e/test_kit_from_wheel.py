"""The public test kit works for a server outside this repository, from an installed wheel.

The project is built into a wheel and installed into a fresh virtual environment whose only other
path is the site-packages of the running interpreter (its dependencies; a ``.pth`` line adds it as a
plain path, so the editable install of this checkout is not active there); a resources server and
its test (``tests/e2e/outside_server/``, the test named so that this repository's run does not collect
it) are copied to a folder outside the repository, and pytest runs
there in that environment (the repository is neither the working directory nor on ``sys.path``).
The test checks that ``nemo_gym_ckpt`` and its test kit came from the installed wheel and that the
server passes every check of the conformance suite.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
OUTSIDE = Path(__file__).parent / "outside_server"


LEFT_OUT = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "tests")


def test_an_outside_server_runs_the_conformance_suite_from_the_wheel(tmp_path: Path) -> None:
    source, wheels, env, work = (tmp_path / name for name in ("source", "wheels", "wheel-env", "work"))
    shutil.copytree(REPO, source, ignore=LEFT_OUT)  # a clean tree: no build/ left over from another build
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheels), str(source)], check=True, timeout=300, capture_output=True)
    (wheel,) = wheels.glob("nemo_gym_ckpt-*.whl")
    venv.create(env, with_pip=False)
    (site,) = env.glob("lib/python*/site-packages")
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, timeout=300, capture_output=True)
    shutil.copytree(OUTSIDE, work)
    (work / "echo_conformance_check.py").rename(work / "test_echo_conformance.py")
    environ = {**os.environ, "PYTHONPATH": str(work), "WHEEL_SITE": str(site)}
    done = subprocess.run(
        [str(env / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "asyncio_mode=auto",
         "-o", "asyncio_default_fixture_loop_scope=function",
         "--rootdir", str(work), str(work)],
        cwd=work, env=environ, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout
