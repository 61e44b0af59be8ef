"""The commit's work: capture the records in memory, then write them in one go (docs/protocol.md
sections 4 and 6).

The capture runs on the event loop and only collects: it iterates the adapter's records (keeping
those in scope) into one list, or takes the list an ``ExportAtOnce`` adapter hands over whole. A
record the adapter hands back unchanged (a ``Record`` it kept) costs nothing here; a new one is
encoded once (``Record.from_data``: orjson, and a byte search for token arrays). A list handed over
whole is taken in the commit's own turn of the loop, with no task between: on a busy server every
task, and every future a result passes through, is a turn of the loop later, and a turn there is
every callback that was ready when it began. Meanwhile a worker thread, handed the work when the
commit began, opens the writer (the directories made and fsynced, the records file created: a few
ms of system calls that need no record). The write then runs in one worker thread, once: it takes
the writer from the opening thread (thread to thread, no turn of the loop between), writes
references to what the previous committed checkpoint already holds (``incremental``) and the
other records inline, hashed and written in chunks of about 1 MiB, then seals the records and
links the manifest. One thread result awaited on the loop per commit, whatever the number of
records. The whole of it runs with prompt hand-offs of the interpreter's lock
(``prompt_switching``): the writer's threads make a dozen system calls beside a loop that is
capturing or serving.
``cancel_export`` stops the capture at once (a resume must not let it read the adapter's state
again); a write already in its thread stops at its next chunk through the store's ``StopSignal``. A
failure that is not a protocol error is a bug and propagates as such.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import itertools
import operator
import time
from collections.abc import Callable
from typing import Any

from nemo_gym_ckpt.checkpoint.adapter import ExportAtOnce, ParticipantAdapter
from nemo_gym_ckpt.checkpoint.incremental import refuse_reserved
from nemo_gym_ckpt.checkpoint.records import Record, Scope
from nemo_gym_ckpt.checkpoint.store import Manifest, RecordWriter
from nemo_gym_ckpt.checkpoint.switching import prompt_switching
from nemo_gym_ckpt.checkpoint.telemetry import ATTR, Telemetry
from nemo_gym_ckpt.errors import GymError, Unavailable

__all__ = ["ExportPipeline"]

OPEN_WAIT_S = 60.0
"""How long the write's thread waits for the thread that opens the writer (directories and a file)."""

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
        and ``open_wait_ms`` (in the write's thread, before ``write_ms``: the time it waited for the
        writer's own thread to open it)."""

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
        opening = _Opening(open_writer)
        try:
            began = time.perf_counter()
            records, exported = await self._capture()
            captured = time.perf_counter()
            manifest, writer, open_wait_s, write_s, cpu_s = await asyncio.to_thread(
                self._timed_write, opening, records, kind, instance)
            self.timings = {"records": writer.count, "bytes": writer.bytes_written,
                            "capture_ms": round(1000 * (captured - began), 2), "write_ms": round(1000 * write_s, 2),
                            "write_cpu_ms": round(1000 * cpu_s, 2), "sync_ms": round(1000 * writer.sync_s, 2),
                            "open_wait_ms": round(1000 * open_wait_s, 2)}
        except BaseException:
            opened = await opening.outcome()
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
        self, opening: _Opening, records: list[Record], kind: str, instance: str
    ) -> tuple[Manifest, RecordWriter, float, float, float]:
        """In the write's thread: the writer, once its own thread has opened it, then the records
        written and the manifest linked; with the time waited for the opening and the write's."""
        writer, open_wait_s = opening.take()
        began, began_cpu = time.perf_counter(), time.thread_time()
        writer.write_records(records)
        manifest = writer.finish(kind, instance, self.checkpoint_id)
        return manifest, writer, open_wait_s, time.perf_counter() - began, time.thread_time() - began_cpu


class _Opening:
    """The writer, opened by a worker thread handed the work at once (in a copy of the current
    context, as ``asyncio.to_thread`` does); the write's thread takes it from there. Neither waits
    for a turn of the event loop in between: a thread's result reaches a coroutine only turns later,
    and on a busy server a turn is every callback that was ready when it began."""

    def __init__(self, open_writer: Callable[[], RecordWriter]) -> None:
        self._writer: concurrent.futures.Future[RecordWriter] = concurrent.futures.Future()
        call = functools.partial(contextvars.copy_context().run, self._open, open_writer)
        asyncio.get_running_loop().run_in_executor(None, call)

    def _open(self, open_writer: Callable[[], RecordWriter]) -> None:
        if not self._writer.set_running_or_notify_cancel():
            return
        try:
            self._writer.set_result(open_writer())
        except BaseException as error:  # noqa: BLE001 - raised by whoever takes the writer
            self._writer.set_exception(error)

    def take(self) -> tuple[RecordWriter, float]:
        """In a worker thread: the writer once open (its error if opening failed), and the seconds
        waited for it."""
        began = time.perf_counter()
        try:
            writer = self._writer.result(timeout=OPEN_WAIT_S)
        except concurrent.futures.TimeoutError:
            raise Unavailable(f"the checkpoint's directory was not open after {OPEN_WAIT_S:.0f} s") from None
        return writer, time.perf_counter() - began

    async def outcome(self) -> RecordWriter | None:
        """On the loop, after a failure: the writer once its thread is done, to abort it; ``None`` if
        opening it failed or never began (the error that ends the commit is another one)."""
        try:
            return await asyncio.shield(asyncio.wrap_future(self._writer))
        except (GymError, OSError, asyncio.CancelledError):
            return None
