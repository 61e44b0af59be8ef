"""The launcher reads each child's output line by line with a bound: a line longer than
``MAX_LINE_BYTES`` (a server printing a huge request, a progress bar that only writes ``\\r``) reaches
the sink and the tail cut there and marked, the rest of it is read and dropped, and the lines after
it come through whole; a last line without a newline is not taken for a cut one.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from nemo_gym_ckpt.launch.launcher import CUT_MARKER, MAX_LINE_BYTES, _Child

pytestmark = pytest.mark.unit

WAIT_S = 30.0
LONG_LINE_BYTES = 8 * 1024 * 1024
CHILD = f"""\
import sys
out = sys.stdout.buffer
out.write(b"before\\n")
for _ in range({LONG_LINE_BYTES // (1 << 20)}):
    out.write(b"x" * (1 << 20)); out.flush()
out.write(b"\\n")
out.write(b"y" * {MAX_LINE_BYTES} + b"\\n")
out.write(b"after\\nlast words")
"""


def test_an_over_long_line_is_cut_marked_and_the_rest_dropped() -> None:
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen: list[tuple[str, str]] = []
    child = _Child("srv", proc, "token")
    child.start_reader(lambda name, line: seen.append((name, line)))
    assert proc.wait(WAIT_S) == 0
    assert child.reader is not None
    child.reader.join(WAIT_S)
    lines = [line for _, line in seen]
    assert [len(line) for line in lines] == [6, MAX_LINE_BYTES + len(CUT_MARKER), MAX_LINE_BYTES, 5, 10], \
        [line[:40] for line in lines]
    assert lines[1] == "x" * MAX_LINE_BYTES + CUT_MARKER
    assert lines[2:] == ["y" * MAX_LINE_BYTES, "after", "last words"]
    assert list(child.tail) == lines and {name for name, _ in seen} == {"srv"}
