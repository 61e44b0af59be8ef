"""The CPU of each process in each phase of a pause (``PhaseCpu``, the scale bench's ``phase_cpu``):
a process that works is charged in the phase it worked in, one that sleeps is not, and the split per
level is the median of each process, their sum and the cores they kept busy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from nemo_gym_ckpt.bench import scale
from nemo_gym_ckpt.bench.mesh import PhaseCpu

pytestmark = pytest.mark.unit

_SPIN = "import time\nuntil = time.time() + 20\nwhile time.time() < until:\n    pass\n"


@pytest.fixture
def processes() -> Iterator[dict[str, int]]:
    busy = subprocess.Popen([sys.executable, "-c", _SPIN])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(20)"])
    try:
        time.sleep(0.3)  # both started
        yield {"busy": busy.pid, "idle": idle.pid}
    finally:
        for process in (busy, idle):
            process.kill()
            process.wait(timeout=10)


_DRIVER = """
import json, sys, time
from nemo_gym_ckpt.bench.mesh import PhaseCpu
cpu = PhaseCpu({"busy": int(sys.argv[1]), "idle": int(sys.argv[2])})
cpu.mark()
time.sleep(0.6)  # the driver sleeps, the spinning one works (its share of a core: the machine is shared)
cpu.mark()
sum(i * i for i in range(2_000_000))  # the driver works
cpu.mark()
print(json.dumps(cpu.phases(("sleeping", "working"))))
"""


def test_each_process_is_charged_in_the_phase_it_worked_in(processes: dict[str, int]) -> None:
    if not os.path.exists(f"/proc/{os.getpid()}/task"):
        pytest.skip("no /proc: nothing to read")
    # the driver is a fresh process: a test worker's own threads (a full collection of its large heap
    # among them: 480 ms once in CI) would be charged to it while it sleeps
    driver = subprocess.run([sys.executable, "-c", _DRIVER, str(processes["busy"]), str(processes["idle"])],
                            capture_output=True, text=True, check=True, timeout=60)
    phases = json.loads(driver.stdout)
    assert phases["sleeping"]["busy"] > 30 and phases["sleeping"]["idle"] < 20
    assert phases["sleeping"]["busy"] > 3 * phases["sleeping"]["idle"]
    assert phases["sleeping"]["driver"] < phases["working"]["driver"]
    assert phases["working"]["driver"] > 20 and 0 < phases["marks_ms"] < 1000
    cpu = PhaseCpu(processes)
    for _ in range(3):
        cpu.mark()
    with pytest.raises(ValueError, match="need 4 marks, got 3"):
        cpu.phases(("one", "two", "three"))


def test_a_level_reports_the_median_split_and_the_busy_cores() -> None:
    def sample(prepare: float, commit: float) -> dict[str, object]:
        return {"prepare_ms": 10.0, "commit_ms": 50.0, "resume_ms": 5.0,
                "cpu_ms": {"prepare": {"env": prepare, "driver": 1.0}, "commit": {"env": commit, "driver": 0.0},
                           "resume": {"env": 2.0, "driver": 3.0}, "marks_ms": 0.5}}

    split = scale._phase_cpu_p50([sample(4.0, 100.0), sample(6.0, 60.0), sample(20.0, 90.0)])
    assert split["prepare"] == {"env": 6.0, "driver": 1.0, "total": 7.0, "busy_cores": 0.7}
    assert split["commit"]["env"] == 90.0 and split["commit"]["busy_cores"] == 1.8
    assert split["resume"]["total"] == 5.0 and split["resume"]["busy_cores"] == 1.0 and split["marks_ms"] == 0.5
