"""How the suite's files are spread over pytest-xdist workers (``-n 2 --dist loadfile`` by default).

A worker takes whole files, in collection order, and the whole e2e tier is one unit of work: one
worker runs it from the start while the other runs everything else, so no two meshes of real
processes start at once on a 2-core machine. (xdist's own ``loadgroup`` marks groups by renaming
node ids, which pytest 9.2 no longer allows, so the grouping lives in the scheduler here.) The tier
sets the suite's wall time, so its files that start no server process at all (``OFF_TIER``) are
files like any other, run by whichever worker takes them.

Each worker's meshes take their free ports from their own slice of the launcher's default range
(``worker_port_range``, exported as ``$NEMO_GYM_CKPT_PORT_RANGE``, which child processes inherit),
so two workers never race for a port.
"""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

from nemo_gym_ckpt.launch.launcher import PORT_RANGE

__all__ = ["E2E_TIER", "OFF_TIER", "TierFileScheduling", "worker_port_range"]

E2E_TIER = "tests/e2e/"
OFF_TIER = ("tests/e2e/test_kit_from_wheel.py",)
"""e2e files that launch no server process: a wheel built and installed, the test kit's conformance
suite run in process by a pytest of that environment."""


class TierFileScheduling(LoadFileScheduling):
    """``loadfile``, except that every file of the e2e tier but those of ``OFF_TIER`` is one unit of work."""

    def _split_scope(self, nodeid: str) -> str:
        if nodeid.startswith(E2E_TIER) and not nodeid.startswith(OFF_TIER):
            return E2E_TIER
        return super()._split_scope(nodeid)


def worker_port_range(worker: str, count: int) -> str:
    """Worker ``gwN``'s slice of the launcher's default range, as ``LOW-HIGH``."""
    index = int(worker.removeprefix("gw"))
    width = (PORT_RANGE[1] - PORT_RANGE[0] + 1) // count
    low = PORT_RANGE[0] + index * width
    return f"{low}-{low + width - 1}"
