"""The commit's work: one export task feeding one write task (docs/protocol.md sections 4 and 6).

The export task iterates the adapter's records (keeping those in scope), encodes them and hands
batches of about 1 MB to the write task through a bounded queue; the write task appends each
batch in a worker thread (hashing and counting) and finally seals the records and links the
manifest. Either failing stops the other; a failure that is not a protocol error is a bug and
propagates as such. ``cancel_export`` stops the export at once (a resume must not let it read the
adapter's state again).
"""

from __future__ import annotations

import asyncio

from nemo_gym_ckpt.checkpoint.adapter import ParticipantAdapter
from nemo_gym_ckpt.checkpoint.records import Record, Scope
from nemo_gym_ckpt.checkpoint.store import Manifest, RecordWriter
from nemo_gym_ckpt.checkpoint.telemetry import ATTR, Telemetry
from nemo_gym_ckpt.errors import GymError

__all__ = ["BATCH_BYTES", "QUEUED_BATCHES", "ExportPipeline"]

BATCH_BYTES = 1 << 20
QUEUED_BATCHES = 4
Batches = asyncio.Queue[list[bytes] | None]


class ExportPipeline:
    """Export and write of one checkpoint, run once."""

    def __init__(
        self, adapter: ParticipantAdapter, scope: Scope | None, telemetry: Telemetry, checkpoint_id: str
    ) -> None:
        self.adapter, self.scope, self.telemetry, self.checkpoint_id = (
            adapter,
            scope,
            telemetry,
            checkpoint_id,
        )
        self._export: asyncio.Task[list[str]] | None = None

    def cancel_export(self) -> None:
        if self._export is not None:
            self._export.cancel()

    async def run(self, writer: RecordWriter, kind: str, instance: str) -> tuple[Manifest, list[str]]:
        """The manifest written and the capture keys exported; on failure the writer is aborted."""
        queue: Batches = asyncio.Queue(QUEUED_BATCHES)
        finished = False
        try:
            async with asyncio.TaskGroup() as group:
                export = self._export = group.create_task(self._produce(queue))
                write = group.create_task(self._consume(queue, writer, kind, instance))
            finished = True
        except ExceptionGroup as failure:
            raise _first_gym_error(failure) from None
        finally:
            if not finished:
                await asyncio.to_thread(writer.abort)
        return write.result(), export.result()

    async def _produce(self, queue: Batches) -> list[str]:
        with self.telemetry.span("export", **{ATTR.ID: self.checkpoint_id}) as span:
            keys: dict[str, None] = {}
            batch: list[bytes] = []
            size = 0
            async for item in self.adapter.export(self.scope):
                record = item if isinstance(item, Record) else Record.from_data(item)
                if self.scope is not None and record.episode not in self.scope:
                    continue
                keys.setdefault(record.episode.capture_key)
                batch.append(record.raw)
                size += len(record.raw)
                if size >= BATCH_BYTES:
                    await queue.put(batch)
                    batch, size = [], 0
            await queue.put(batch)
            await queue.put(None)
            span.set_attribute(ATTR.RECORDS, len(keys))
            return list(keys)

    async def _consume(self, queue: Batches, writer: RecordWriter, kind: str, instance: str) -> Manifest:
        while (batch := await queue.get()) is not None:
            await asyncio.to_thread(writer.write_lines, batch)
        return await asyncio.to_thread(writer.finish, kind, instance, self.checkpoint_id)


def _first_gym_error(group: ExceptionGroup[Exception]) -> Exception:
    """The first protocol error of a failed task group; the group itself if it holds only bugs."""
    matched: BaseException | None = group.subgroup(lambda error: isinstance(error, GymError))
    while isinstance(matched, BaseExceptionGroup):
        matched = matched.exceptions[0]
    return matched if isinstance(matched, Exception) else group
