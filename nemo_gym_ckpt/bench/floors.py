"""The disk's floors a commit's write speed is read against (the ``scale`` suite's).

- ``sequential_floor``: one new file of the checkpoint's size written and fsynced: the fsync'd
  sequential floor the issue's acceptance names.
- ``writes_at_once``: each participant's full commit written as its store writes it (records file,
  its fsync, rename and the directory's fsync, manifest written, fsynced and linked, the directory's
  fsync again), all of them at once from threads of this process, with nothing else running: what
  the commit's writes could reach here if they had the cores to themselves. The bytes of all of
  them over the longest.

Each is the median of ``FLOOR_SAMPLES`` measurements.
"""

from __future__ import annotations

import os
import shutil
import statistics
import threading
import time
from pathlib import Path

from nemo_gym_ckpt.checkpoint.store import CheckpointStore, StopSignal

__all__ = ["FLOOR_SAMPLES", "median_floor", "median_writes_at_once", "sequential_floor", "writes_at_once"]

FLOOR_SAMPLES = 5
"""A floor is the median of this many writes (one write alone read 416-855 MB/s in one session)."""
_LINE_BYTES = 1000
_START_TIMEOUT_S = 30.0


def median_floor(root: Path, size: int) -> float:
    """The median of ``FLOOR_SAMPLES`` sequential floors of ``size`` bytes."""
    return statistics.median(sequential_floor(root, size) for _ in range(FLOOR_SAMPLES))


def sequential_floor(root: Path, size: int) -> float:
    """MB/s of writing ``size`` bytes to one new file and fsyncing it (the disk's floor, right now)."""
    size = max(size, 1 << 20)
    path = root / f".floor-{os.getpid()}"
    chunk = os.urandom(1 << 20)
    began = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        left = size
        while left > 0:
            left -= os.write(fd, chunk[: min(left, len(chunk))])
        os.fsync(fd)
    finally:
        os.close(fd)
        elapsed = time.perf_counter() - began
        path.unlink()
    return size / elapsed / 1e6


def median_writes_at_once(root: Path, sizes: dict[str, int]) -> float:
    """The median of ``FLOOR_SAMPLES`` ``writes_at_once``."""
    return statistics.median(writes_at_once(root, sizes) for _ in range(FLOOR_SAMPLES))


def writes_at_once(root: Path, sizes: dict[str, int]) -> float:
    """MB/s of every participant's commit of ``sizes[name]`` bytes through the store, started together:
    the bytes of all over the longest write (each timed from its first record to its manifest's link)."""
    directory = root / f".writes-at-once-{os.getpid()}"
    start = threading.Barrier(len(sizes) + 1, timeout=_START_TIMEOUT_S)
    took: dict[str, float] = {}
    threads = [threading.Thread(target=_commit_of, args=(directory, name, size, start, took), daemon=True)
               for name, size in sizes.items()]
    try:
        for thread in threads:
            thread.start()
        start.wait()
        for thread in threads:
            thread.join(_START_TIMEOUT_S)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if len(took) != len(sizes):
        raise RuntimeError(f"the writes at once did not all finish: {sorted(set(sizes) - set(took))}")
    return sum(sizes.values()) / max(took.values()) / 1e6


def _commit_of(directory: Path, name: str, size: int, start: threading.Barrier, took: dict[str, float]) -> None:
    """One participant's full commit of about ``size`` bytes of 1 KB lines, timed as its writer times it."""
    line = b"x" * (_LINE_BYTES - 1)
    lines = [line] * max(1, size // _LINE_BYTES)
    writer = CheckpointStore(directory).open_writer(directory, "bench", name, StopSignal(), incremental=False)
    start.wait()
    began = time.perf_counter()
    writer.write_lines(lines)
    writer.finish("bench", name, "at-once")
    took[name] = time.perf_counter() - began
