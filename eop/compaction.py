"""Keeping the inbox bounded: the watermark of design.md section 4.

Every stream sequence at or below the consumer's ack floor was acked (or
termed), and eop acks only after the message's outcome committed; sequences
below the stream's first sequence are gone from the stream. So the watermark
of a (subscription, stream, epoch) may rise to the larger of the two, never
fall, and inbox rows at or below it can be deleted: the claim treats any
sequence at or below the watermark as processed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any

import nats.errors

from eop import errors, inbox, log, sql
from eop.handler import HandlerSpec
from eop.jetstream import StreamEpochs


@dataclasses.dataclass(frozen=True)
class Compacted:
    """What one compaction round did."""

    epoch: str
    watermark: int
    deleted: int


class Compactor:
    """Advances one subscription's watermark and deletes the inbox rows below it."""

    def __init__(
        self,
        js: Any,
        store: inbox.PostgresStore,
        spec: HandlerSpec,
        epochs: StreamEpochs,
        *,
        chunk_rows: int = 5000,
    ) -> None:
        self.msg_id_retention_s = store.app.settings.msg_id_retention_s
        self.js = js
        self.store = store
        self.spec = spec
        self.epochs = epochs
        self.chunk_rows = chunk_rows
        self._logger = log.get_logger(handler=spec.name, stream=spec.stream)

    async def run_forever(self, interval_s: float, stopping: asyncio.Event) -> None:
        """Compact every ``interval_s`` until ``stopping`` is set; failures only log."""
        while not stopping.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopping.wait(), interval_s)
            if stopping.is_set():
                return
            try:
                await self.compact_once()
            except (errors.EopError, nats.errors.Error, OSError, asyncio.TimeoutError) as exc:
                self._logger.warning(log.Event.COMPACTION_FAILED, error=type(exc).__name__)
            except Exception as exc:
                if inbox.classify(exc) is inbox.DbFailure.OTHER:
                    raise
                self._logger.warning(log.Event.COMPACTION_FAILED, error=type(exc).__name__)

    async def compact_once(self) -> Compacted | None:
        """One round: read the floor, raise the watermark, delete below it in chunks."""
        stream = self.spec.stream
        epoch = await self.epochs.refresh(stream)
        info = await self.js.consumer_info(stream, self.spec.durable)
        # The floor must belong to the epoch we name: if the stream was recreated
        # between the two readings, skip this round.
        if await self.epochs.refresh(stream) != epoch:
            return None
        floor = int(info.ack_floor.stream_seq if info.ack_floor else 0)
        candidate = max(floor, self.epochs.first_seq(stream) - 1)
        if candidate <= 0:
            return None
        watermark = await self._advance(epoch, candidate)
        deleted = await self._delete_below(epoch, watermark)
        self._logger.debug(
            log.Event.INBOX_COMPACTED, epoch=epoch, watermark=watermark, deleted=deleted
        )
        return Compacted(epoch=epoch, watermark=watermark, deleted=deleted)

    async def _advance(self, epoch: str, candidate: int) -> int:
        """Raise the watermark in its own transaction, committed before any delete.

        The first round of an epoch only creates the row: a claim that started
        before the row existed locked nothing, so the raise waits a round for
        such claims to be long finished.
        """
        t, name, stream = self.store.tables, self.spec.name, self.spec.stream
        async with self.store.session() as session:
            created = (await session.execute(sql.create_watermark(t, name, stream, epoch))).all()
            await session.commit()
        if created:
            return 0
        async with self.store.session() as session:
            stmt = sql.advance_watermark(t, name, stream, epoch, candidate)
            value = (await session.execute(stmt)).scalar_one()
            await session.commit()
        return int(value)

    async def _delete_below(self, epoch: str, watermark: int) -> int:
        """Delete in bounded chunks, each its own short transaction (no long locks)."""
        total = 0
        while True:
            stmt = sql.delete_below_watermark(
                self.store.tables,
                self.spec.name,
                self.spec.stream,
                epoch,
                watermark,
                self.chunk_rows,
                self.msg_id_retention_s,
            )
            async with self.store.session() as session:
                deleted = len((await session.execute(stmt)).all())
                await session.commit()
            total += deleted
            if deleted < self.chunk_rows:
                return total
