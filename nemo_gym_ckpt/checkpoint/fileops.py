"""The file operations the checkpoint store uses, as one object: the seam for failure tests.

``FileOps`` does the real thing with ``os`` calls. Tests subclass it to fail at any one operation
(ENOSPC, EIO, a simulated crash) or to model which data a crash would lose. Nothing but the store
calls it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

__all__ = ["FileOps"]

_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


class FileOps:
    """Real file operations; every method is one system call (or one short loop of them)."""

    def mkdir(self, path: Path) -> None:
        os.mkdir(path)

    def open_new(self, path: Path) -> int:
        return os.open(path, _NEW_FLAGS, 0o644)

    def write(self, fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def rename(self, src: Path, dst: Path) -> None:
        os.rename(src, dst)

    def link(self, src: Path, dst: Path) -> None:
        os.link(src, dst)

    def unlink(self, path: Path) -> None:
        os.unlink(path)

    def fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def open_read(self, path: Path) -> BinaryIO:
        """Open a regular file for reading without following a symlink."""
        fd = os.open(path, _READ_FLAGS)
        return os.fdopen(fd, "rb")
