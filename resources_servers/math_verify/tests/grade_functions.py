"""Grade functions and warm-ups for ``GraderPool``'s tests; they run in the pool's spawned workers.

A spawned worker imports the module of the function it runs. This one imports only the standard
library, so a worker of these tests starts as a bare interpreter; ``test_app.py`` imports the app,
FastAPI and httpx, seconds of imports for every worker started. ``no_warm_up`` is the warm-up of
workers that never grade with ``math_verify`` (importing it took about 1.5 s a worker, for nothing).
"""

from __future__ import annotations

import os
import time


def no_warm_up() -> None:
    """Nothing to import: the grade functions here use the standard library only."""


def crash(expected: str, text: str) -> tuple[bool, str | None]:
    """A grade function whose worker process dies."""
    os._exit(3)


def same(expected: str, text: str) -> tuple[bool, str | None]:
    """A grade function that answers at once."""
    return expected == text, text


def stuck_on_stuck(expected: str, text: str) -> tuple[bool, str | None]:
    """A grade function that never answers ``"stuck"`` and answers anything else at once."""
    while text == "stuck":
        time.sleep(3600)
    return expected == text, text


def dies_on_its_first_grade(marker: str, text: str) -> tuple[bool, str | None]:
    """A grade function whose first call kills its worker (``marker``, a path, records that it did)."""
    if not os.path.exists(marker):
        with open(marker, "w"):
            pass
        os._exit(9)
    return True, text


def dies_grading(expected: str, text: str) -> tuple[bool, str | None]:
    """A grade function that works a while and then kills its worker (a crash on a bad answer)."""
    time.sleep(0.6)
    os._exit(9)


def slow_start() -> None:
    """A worker warm-up that takes 2 s, as importing sympy does on a busy machine."""
    time.sleep(2.0)
