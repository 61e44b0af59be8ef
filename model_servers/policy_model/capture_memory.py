"""Where the token lines of the capture ledger live: memory, bounded, then files.

The ledger keeps one sidecar line (``token_sidecar.CallTokens``) per delivered call that carried
token ids, until the rollout is forgotten. Held in memory, thousands of long rollouts would hold
gigabytes, so a line lives in one of three places:

- **memory**, from delivery until it is durable, while the lines held add up to at most
  ``capture_memory_max_bytes`` (the policy model's setting);
- a **spill file**, when that bound is reached: the line is appended to an unlinked temporary file
  under ``capture_spill_dir`` (or the system's temporary directory) and read back when needed (a
  commit writing the sidecar, the capture route, a continued call's prompt). Spill files are not
  durable and vanish with the process; a new one is started every 256 MiB, and one is closed
  (its disk space freed) once no line points into it. A spill that fails (a full disk) is 503
  ``unavailable`` naming the bound: the call is answered with that error, not delivered half-kept;
- a **sidecar file**: once a commit has made the line durable (written or linked into its
  directory, docs/protocol.md section 6), it leaves memory and is read back from that file through
  a descriptor kept open, so pruning the checkpoint directory cannot take it away. A restore keeps
  the lines it reads in the restored-from sidecar the same way.

A line read back is checked against its digest (``LineFile.read``; lines next to each other in one
file are read back with one read into a buffer given, ``LineFile.read_run_into``, each line still
checked). A commit copying lines into a new sidecar checks each against the CRC-32 taken when its
bytes were last known good (made here, or read back and checked against its digest), where that is
known: it guards the copy against damage on the disk at a quarter of the cost of SHA-256 (4 GB/s
against 1.1 here), and a restore still checks every line it installs against its digest.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import zlib
from itertools import accumulate
from pathlib import Path

from nemo_gym_ckpt.errors import InvalidCheckpointState, Unavailable

__all__ = ["SPILL_FILE_BYTES", "CaptureMemory", "LineFile"]

SPILL_FILE_BYTES = 256 << 20


class LineFile:
    """An open file of lines, read by offset; the descriptor closes when the last user drops it."""

    def __init__(self, fd: int, name: str) -> None:
        self._fd = fd
        self.name = name

    @classmethod
    def open(cls, path: Path) -> LineFile:
        return cls(os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)), path.name)

    def read(self, offset: int, size: int, digest: str) -> bytes:
        """The ``size`` bytes at ``offset``, which must hash to ``digest``."""
        data = os.pread(self._fd, size, offset)
        if len(data) != size:
            raise self._shorter()
        self._check(memoryview(data), [size], [digest])
        return data

    def read_run_into(
        self, into: memoryview, offset: int, sizes: list[int], digests: list[str], crcs: list[int] | None = None
    ) -> None:
        """Lines next to each other from ``offset`` (of ``sizes``, a newline after each), read with one
        read into ``into`` (exactly as long as the lines and the newlines between them), each line
        checked against its CRC-32 (``crcs``) when given, else against its digest (``digests``), in
        the same order."""
        if os.preadv(self._fd, [into], offset) != len(into):
            raise self._shorter()
        if crcs is None:
            self._check(into, sizes, digests)
        else:
            self._check_crcs(into, sizes, crcs)

    def _check_crcs(self, view: memoryview, sizes: list[int], crcs: list[int]) -> None:
        crc32 = zlib.crc32
        starts = accumulate((size + 1 for size in sizes[:-1]), initial=0)
        if [crc32(view[start : start + size]) for start, size in zip(starts, sizes, strict=True)] != crcs:
            raise InvalidCheckpointState(f"a token line kept in {self.name} no longer matches its checksum")

    def _check(self, view: memoryview, sizes: list[int], digests: list[str]) -> None:
        sha256 = hashlib.sha256
        starts = accumulate((size + 1 for size in sizes[:-1]), initial=0)
        hashed = [sha256(view[start : start + size]).digest() for start, size in zip(starts, sizes, strict=True)]
        if b"".join(hashed) != bytes.fromhex("".join(digests)):
            raise InvalidCheckpointState(f"a token line kept in {self.name} no longer matches its digest")

    def _shorter(self) -> InvalidCheckpointState:
        return InvalidCheckpointState(f"token lines kept in {self.name} are shorter than when written")

    def __del__(self) -> None:
        fd, self._fd = getattr(self, "_fd", -1), -1
        if fd >= 0:
            os.close(fd)


class _Spill(LineFile):
    """An unlinked temporary file that lines are appended to."""

    def __init__(self, directory: str | None) -> None:
        with tempfile.TemporaryFile(dir=directory, prefix="ngc-capture-spill-", buffering=0) as handle:
            super().__init__(os.dup(handle.fileno()), "a capture spill file")  # unlinked: ours alone
        self.end = 0

    def append(self, line: bytes) -> int:
        offset = self.end
        written = os.pwrite(self._fd, line, offset)
        if written != len(line):
            raise OSError(28, "short write to the capture spill file")
        self.end += written
        return offset


class CaptureMemory:
    """The bound on token lines held in memory, and the spill file past it."""

    def __init__(self, max_bytes: int, spill_dir: str | None = None) -> None:
        if max_bytes < 0:
            raise ValueError("capture_memory_max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self.spill_dir = spill_dir
        self.held = 0
        self.spilled = 0
        self._spill: _Spill | None = None
        self._lock = threading.Lock()

    def take(self, size: int) -> bool:
        """Count ``size`` more bytes held in memory; ``False`` (nothing counted) past the bound."""
        with self._lock:
            if self.held + size > self.max_bytes:
                return False
            self.held += size
            return True

    def release(self, size: int) -> None:
        with self._lock:
            self.held = max(0, self.held - size)

    def spill(self, line: bytes) -> tuple[LineFile, int]:
        """Append ``line`` to the spill file: the file and the offset it is at."""
        with self._lock:
            try:
                if self._spill is None or self._spill.end >= SPILL_FILE_BYTES:
                    self._spill = _Spill(self.spill_dir)
                offset = self._spill.append(line)
            except OSError as error:
                raise Unavailable(f"the capture ledger holds {self.held} bytes of token lines in memory "
                                  f"(capture_memory_max_bytes {self.max_bytes}) and spilling to "
                                  f"{self.spill_dir or tempfile.gettempdir()} failed: {error.strerror or error}; "
                                  "commit a checkpoint or forget finished rollouts") from error
            self.spilled += 1
            return self._spill, offset
