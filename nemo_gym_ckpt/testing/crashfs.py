"""A ``FileOps`` that models what a crash keeps, for the crash-point tests.

It performs every operation for real and also keeps a model of durability: a file's durable
content is what it held at its last ``fsync``; a directory's durable entries are what it held at
its last ``fsync_dir``. ``crash_at`` makes the n-th operation raise ``SimulatedCrash`` before (or
after) it runs; ``materialize`` writes the durable view (what survives a power loss) to a folder.
Optionally ``fail_at`` raises an ``OSError`` (ENOSPC, EIO) instead, as a disk would.
``fsync_all`` runs its fsyncs one after another here, in the order given (one of the orders the
real one's threads may finish in; the operations keep their numbers from run to run).
"""

from __future__ import annotations

import errno
import itertools
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from nemo_gym_ckpt.checkpoint.fileops import FileOps


class SimulatedCrash(Exception):
    """The process died here: nothing after this operation runs, no clean-up either."""


Entry = tuple[str, object]  # ("dir", Path) or ("file", inode)


class CrashFS(FileOps):
    def __init__(
        self,
        *,
        crash_at: int | None = None,
        after: bool = False,
        fail_at: int | None = None,
        fail_errno: int = errno.ENOSPC,
        skip_fsync: bool = False,
    ) -> None:
        self.crash_at, self.after = crash_at, after
        self.fail_at, self.fail_errno = fail_at, fail_errno
        self.skip_fsync = skip_fsync  # a broken store that forgets fsync: the model must catch it
        self.fail_next: str | None = None  # the next call of this operation fails (once)
        self.calls: list[str] = []
        self._inodes = itertools.count()
        self._fd_inode: dict[int, int] = {}
        self._data: dict[int, bytearray] = {}
        self._synced: dict[int, bytes] = {}
        self._entries: dict[Path, dict[str, Entry]] = defaultdict(dict)
        self._durable: dict[Path, dict[str, Entry]] = defaultdict(dict)

    # ---- bookkeeping ----
    def _begin(self, name: str) -> int:
        index = len(self.calls)
        self.calls.append(name)
        if index == self.fail_at or name == self.fail_next:
            self.fail_next = None
            raise OSError(self.fail_errno, os.strerror(self.fail_errno))
        if index == self.crash_at and not self.after:
            raise SimulatedCrash(f"before {name} (#{index})")
        return index

    def _end(self, index: int) -> None:
        if index == self.crash_at and self.after:
            raise SimulatedCrash(f"after {self.calls[index]} (#{index})")

    # ---- operations ----
    def mkdir(self, path: Path) -> None:
        index = self._begin("mkdir")
        super().mkdir(path)
        self._entries[path.parent][path.name] = ("dir", path)
        self._end(index)

    def open_new(self, path: Path) -> int:
        index = self._begin("open")
        fd = super().open_new(path)
        inode = next(self._inodes)
        self._fd_inode[fd], self._data[inode], self._synced[inode] = inode, bytearray(), b""
        self._entries[path.parent][path.name] = ("file", inode)
        self._end(index)
        return fd

    def write(self, fd: int, data: bytes | memoryview) -> None:
        index = self._begin("write")
        super().write(fd, data)
        self._data[self._fd_inode[fd]] += data
        self._end(index)

    def fsync(self, fd: int) -> None:
        index = self._begin("fsync")
        super().fsync(fd)
        if not self.skip_fsync:
            self._synced[self._fd_inode[fd]] = bytes(self._data[self._fd_inode[fd]])
        self._end(index)

    def fsync_all(self, files: Sequence[tuple[int, str]]) -> None:
        """Each fsync in turn (no threads: the crash points stay the same from run to run)."""
        for fd, name in files:
            try:
                self.fsync(fd)
            except OSError as error:
                error.filename = name
                raise

    def close(self, fd: int) -> None:
        index = self._begin("close")
        super().close(fd)
        self._end(index)

    def rename(self, src: Path, dst: Path) -> None:
        index = self._begin("rename")
        super().rename(src, dst)
        self._entries[dst.parent][dst.name] = self._entries[src.parent].pop(src.name)
        self._end(index)

    def link(self, src: Path, dst: Path) -> None:
        index = self._begin("link")
        super().link(src, dst)
        self._entries[dst.parent][dst.name] = self._entries[src.parent][src.name]
        self._end(index)

    def unlink(self, path: Path) -> None:
        index = self._begin("unlink")
        super().unlink(path)
        self._entries[path.parent].pop(path.name, None)
        self._end(index)

    def fsync_dir(self, path: Path) -> None:
        index = self._begin("fsync_dir")
        super().fsync_dir(path)
        self._durable[path] = dict(self._entries[path])
        self._end(index)

    # ---- the durable view ----
    def materialize(self, root: Path, out: Path, *, entries: str = "durable") -> None:
        """Write what survives a power loss under ``root`` (durable at the start) into ``out``.

        File contents are always what was fsynced. ``entries="durable"``: directory entries as of
        the last directory fsync; ``"live"``: every entry change kept (metadata reached the disk,
        data did not: the ``data=writeback`` worst case).
        """
        out.mkdir(parents=True, exist_ok=True)
        table = self._durable if entries == "durable" else self._entries
        for name, (kind, ref) in table.get(root, {}).items():
            if kind == "dir":
                assert isinstance(ref, Path)
                self.materialize(ref, out / name, entries=entries)
            else:
                assert isinstance(ref, int)
                (out / name).write_bytes(self._synced[ref])
