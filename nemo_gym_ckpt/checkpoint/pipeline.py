"""The commit's work: capture the records in memory, then write them in one go (docs/protocol.md
sections 4 and 6).

The capture runs on the event loop and only collects: it iterates the adapter's records (keeping
those in scope) into one list, or takes the list an ``ExportAtOnce`` adapter hands over whole. A
record the adapter hands back unchanged (a ``Record`` it kept) costs nothing here; a new one is
encoded once (``Record.from_data``: orjson, and a byte search for token arrays). A list handed over
whole is taken in the commit's own turn of the loop, with no task between: on a busy server every
task, and every future a result passes through, is a turn of the loop later, and a turn there is
every callback that was ready when it began. Meanwhile a worker thread opens the writer (the
directories made and fsynced, the records file created: a few ms of system calls that need no
record). The write then runs in one worker thread, once: references to what the previous committed
checkpoint already holds (``incremental``), the other records inline, hashed and written in chunks
of about 1 MiB, then the records sealed and the manifest linked. Two thread hand-offs per commit,
whatever the number of records. The whole of it runs with prompt hand-offs of the interpreter's
lock (``prompt_switching``): the writer's threads make a dozen system calls beside a loop that is
capturing or serving.
``cancel_export`` stops the capture at once (a resume must not let it read the adapter's state
again); a write already in its thread stops at its next chunk through the store's ``StopSignal``. A
failure that is not a protocol error is a bug and propagates as such.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
import operator
import time
from collections.abc import Callable
from typing import Any, TypeVar

from nemo_gym_ckpt.checkpoint.adapter import ExportAtOnce, ParticipantAdapter
from nemo_gym_ckpt.checkpoint.incremental import refuse_reserved
from nemo_gym_ckpt.checkpoint.records import Record, Scope
from nemo_gym_ckpt.checkpoint.store import Manifest, RecordWriter
from nemo_gym_ckpt.checkpoint.switching import prompt_switching
from nemo_gym_ckpt.checkpoint.telemetry import ATTR, Telemetry
from nemo_gym_ckpt.errors import GymError

__all__ = ["ExportPipeline"]

T = TypeVar("T")

_IS_REFERENCE = operator.attrgetter("reference")
_RECORD_KEY = operator.attrgetter("episode.capture_key")
_KEY = operator.attrgetter("capture_key")


class ExportPipeline:
    """Capture and write of one checkpoint, run once."""

    def __init__(
        self, adapter: ParticipantAdapter, scope: Scope | None, telemetry: Telemetry, checkpoint_id: str
    ) -> None:
        self.adapter, self.scope, self.telemetry, self.checkpoint_id = (
            adapter,
            scope,
            telemetry,
            checkpoint_id,
        )
        self._export: asyncio.Task[list[Record]] | None = None
        self.timings: dict[str, Any] = {}
        """Once run: ``records``, ``bytes`` (``RecordWriter.bytes_written``: the records file, and the
        other files of a store that writes more), ``capture_ms`` (on the event loop), ``write_ms`` (in
        the worker thread, from the first byte to the manifest's link and the directory's fsync) and
        ``write_cpu_ms`` (that thread's CPU time meanwhile: the rest of ``write_ms`` it waited, for the
        disk, a core or the interpreter's lock), ``sync_ms`` (of ``write_ms``, the time in its fsyncs)
        and ``open_wait_ms`` (from the capture's end until the
        writer was open, in neither of the others)."""

    def cancel_export(self) -> None:
        if self._export is not None:
            self._export.cancel()

    async def run(
        self, open_writer: Callable[[], RecordWriter], kind: str, instance: str
    ) -> tuple[Manifest, list[str]]:
        """The manifest written and the capture keys exported. ``open_writer`` (directories made and
        fsynced, the records file created) runs in a thread while the capture runs on the loop; on
        failure the writer, once open, is aborted."""
        with prompt_switching():
            return await self._run(open_writer, kind, instance)

    async def _run(
        self, open_writer: Callable[[], RecordWriter], kind: str, instance: str
    ) -> tuple[Manifest, list[str]]:
        opening = _in_thread(open_writer)
        writer: RecordWriter | None = None
        try:
            began = time.perf_counter()
            records, exported = await self._capture()
            captured = time.perf_counter()
            writer = await asyncio.shield(opening)
            ready = time.perf_counter()
            manifest, write_s, cpu_s = await asyncio.to_thread(self._timed_write, writer, records, kind, instance)
            self.timings = {"records": writer.count, "bytes": writer.bytes_written,
                            "capture_ms": round(1000 * (captured - began), 2), "write_ms": round(1000 * write_s, 2),
                            "write_cpu_ms": round(1000 * cpu_s, 2), "sync_ms": round(1000 * writer.sync_s, 2),
                            "open_wait_ms": round(1000 * (ready - captured), 2)}
        except BaseException:
            opened = writer or await _opened(opening)
            if opened is not None:
                await asyncio.to_thread(opened.abort)
            raise
        return manifest, exported

    async def _capture(self) -> tuple[list[Record], list[str]]:
        """The records in scope, and the capture keys of their episodes (each once, in order): an
        ``ExportAtOnce`` adapter's list in the caller's turn of the loop, else the adapter's records
        streamed by a task of their own (``cancel_export`` stops it)."""
        with self.telemetry.span("export", **{ATTR.ID: self.checkpoint_id}) as span:
            taken = self._at_once()
            if taken is None:
                self._export = asyncio.ensure_future(self._streamed())
                records = await self._export
                taken = records, list(map(_RECORD_KEY, records))
            records, keys = taken
            exported = list(dict.fromkeys(keys))
            span.set_attribute(ATTR.RECORDS, len(exported))
            return records, exported

    def _at_once(self) -> tuple[list[Record], list[str]] | None:
        """The adapter's list (``ExportAtOnce``) less what is outside the scope, and each record's
        capture key; a reference in it is refused. Passes in C over the list instead of three checks
        in Python per record: the scope is compared by capture keys (one-to-one with identities; a
        string's hash is kept in the string, an identity's is a Python call)."""
        if not isinstance(self.adapter, ExportAtOnce):
            return None
        records = self.adapter.export_at_once(self.scope)
        if records is None:
            return None
        if any(map(_IS_REFERENCE, records)):
            for record in records:
                refuse_reserved(record)
        keys = list(map(_RECORD_KEY, records))
        if self.scope is not None:
            in_scope = frozenset(map(_KEY, self.scope))
            if not in_scope.issuperset(keys):
                kept = list(map(in_scope.__contains__, keys))
                records, keys = list(itertools.compress(records, kept)), list(itertools.compress(keys, kept))
        return records, keys

    async def _streamed(self) -> list[Record]:
        records: list[Record] = []
        keep, scope = records.append, self.scope  # locals: this loop runs once per record
        async for item in self.adapter.export(scope):
            record = item if isinstance(item, Record) else Record.from_data(item)
            if scope is not None and record.episode not in scope:
                continue
            if record.reference:
                refuse_reserved(record)
            keep(record)
        return records

    def _timed_write(
        self, writer: RecordWriter, records: list[Record], kind: str, instance: str
    ) -> tuple[Manifest, float, float]:
        began, began_cpu = time.perf_counter(), time.thread_time()
        writer.write_records(records)
        manifest = writer.finish(kind, instance, self.checkpoint_id)
        return manifest, time.perf_counter() - began, time.thread_time() - began_cpu


def _in_thread(work: Callable[[], T]) -> asyncio.Future[T]:
    """``work`` handed to the loop's default executor now, in a copy of the current context (as
    ``asyncio.to_thread`` does), as a future: no task to start first, so the thread begins in this
    turn of the event loop and its result is one turn away once it ends."""
    call = functools.partial(contextvars.copy_context().run, work)
    return asyncio.get_running_loop().run_in_executor(None, call)


async def _opened(opening: asyncio.Future[RecordWriter]) -> RecordWriter | None:
    """The writer ``opening`` opens, once its thread is done; ``None`` if opening it failed (the
    error that ends the commit is another one)."""
    try:
        return await asyncio.shield(opening)
    except (GymError, OSError):
        return None
