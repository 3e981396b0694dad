"""Keeping the inbox bounded: the watermark (docs/design.md, 'The watermark').

Every stream sequence at or below the consumer's ack floor was acked (or
termed), and eop acks only after the message's outcome committed; sequences
below the stream's first sequence are gone from the stream. So the watermark
of a (subscription, stream, epoch) may rise to the larger of the two, never
fall, and inbox rows at or below it can be deleted: the claim treats any
sequence at or below the watermark as processed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncSession

from eop import log
from eop.broker.jetstream import StreamEpochs
from eop.handler import HandlerSpec
from eop.pg import failures, store
from eop.pg.sql import base as base_sql
from eop.pg.sql import inbox as inbox_sql
from eop.pg.sql import retries as retries_sql
from eop.protocol import background

SWEPT = 2**63 - 1
"""The watermark of an epoch whose stream is gone: past every sequence (PostgreSQL's
largest ``bigint``)."""


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
        js: JetStreamContext,
        store: store.PostgresStore,
        spec: HandlerSpec,
        epochs: StreamEpochs,
        *,
        chunk_rows: int = 5000,
        settle_lock_ms: int = 250,
        floor: Callable[[], Awaitable[int | None]] | None = None,
        noted: background.Noted | None = None,
    ) -> None:
        self.settle_lock_ms = settle_lock_ms
        self._noted = noted
        self._floor = floor
        """Where the floor comes from when it is not the handler's durable's ack floor
        (an ordered handler's partitions: :meth:`eop.ordering.share.OrderedRunner.floor`)."""
        self.msg_id_retention_s = store.app.settings.msg_id_retention_s
        self.epoch_sweep_after_s = store.app.settings.epoch_sweep_after_s
        self.js = js
        self.store = store
        self.spec = spec
        self.epochs = epochs
        self.chunk_rows = chunk_rows
        self.after_messages = store.app.settings.compaction_after_messages
        self._logger = log.get_logger(handler=spec.name, stream=spec.stream)
        self._since_round = 0
        # Not knowing yet how many processes share the consumer, the first round comes
        # after a quarter of the batch (eop worker starts at most 4 by default).
        self._threshold = max(1, self.after_messages // 4)
        """This process's messages that start a round: see :meth:`_adapt`."""
        self._wake = asyncio.Event()
        self._created: dict[str, float] = {}
        """Epochs whose watermark row this compactor created, and when (monotonic)."""
        self._known: set[str] = set()
        """Epochs whose watermark row is known to exist."""
        self._interval_s = store.app.settings.compaction_interval_s
        self._swept: dict[str, int] = {}
        self._deferrals = 0
        """Rounds in a row that gave way to claims (:meth:`_advance`)."""
        """Per epoch, the watermark of this compactor's last completed delete: the next
        round's delete starts above it (see :meth:`_delete_below`)."""
        self._raised_to: dict[str, int] = {}
        """Per epoch, the watermark this compactor's last round raised it to."""
        self._full_sweep_at: float | None = None
        """When (monotonic) the last delete from an epoch's first sequence started."""
        self._superseded_at: float | None = None
        """When (monotonic) the last sweep of the stream's earlier epochs started."""

    def processed(self, count: int) -> None:
        """Count messages processed; enough of them since the last round start one now."""
        self._since_round += count
        if self.after_messages and self._since_round >= self._threshold:
            self._wake.set()

    async def prepare(self) -> None:
        """Create the watermark row of the stream's current epoch (when a subscription binds).

        Claims lock the row FOR SHARE only once it exists; creating it before
        this worker fetches anything means the first raise need not wait for
        this worker's claims, only (for one interval) for those of workers
        that started earlier.
        """
        epoch = await self.epochs.refresh(self.spec.stream)
        await self._ensure_row(epoch)

    async def run_forever(self, interval_s: float, stopping: asyncio.Event) -> None:
        """Compact every ``interval_s``, or after :attr:`after_messages` processed messages,
        until ``stopping`` is set (or the task is cancelled); failures only log."""
        self._interval_s = interval_s
        stop = asyncio.ensure_future(stopping.wait())
        wake: asyncio.Future[Any] | None = None
        try:
            while not stopping.is_set():
                wake = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait(
                    {stop, wake}, timeout=interval_s, return_when=asyncio.FIRST_COMPLETED
                )
                wake.cancel()
                if stopping.is_set():
                    return
                self._wake.clear()
                own, self._since_round = self._since_round, 0
                await self._round(own)
        finally:
            # A stopping worker cancels this task, maybe in the wait: leave no waiter behind.
            stop.cancel()
            if wake is not None:
                wake.cancel()

    async def _round(self, own: int) -> None:
        done: list[Compacted | None] = []

        async def step() -> None:
            done.append(await self.compact_once())

        await self.quietly(step)
        if done and done[0] is not None:
            compacted = done[0]
            previous = self._raised_to.get(compacted.epoch)
            rose = compacted.deleted
            if compacted.watermark > 0:
                self._raised_to[compacted.epoch] = compacted.watermark
                if previous is not None:
                    rose = compacted.watermark - previous
            self._adapt(own, rose)

    def _adapt(self, own: int, rose: int) -> None:
        """Set the next round's message count from this round's: ``own`` messages of this
        process started it, and the watermark rose by ``rose`` since this process's
        previous round (at its first round: the rows it deleted).

        Each process counts only its own messages, but the watermark follows
        every process's. N processes sharing a consumer reach their counts
        together, so with a fixed count the inbox held N batches (2,559 rows at
        1,000 a batch with two processes, in the long run of ``eop bench
        --big``). The next round comes after this process's share of the batch
        (``own / rose`` of it), so that the floor runs about one batch ahead of
        the watermark whatever the process count. (Counting the rows the round
        deleted instead let a process whose round came just after the other's,
        and found its rows gone, go back to a whole batch of its own: when the
        two fell together the rounds deleted two batches.) At least an eighth
        of the batch: a restart's leftover rows do not make rounds run for
        every few messages.
        """
        if own <= 0 or rose <= own:
            self._threshold = self.after_messages
        else:
            share = self.after_messages * own // rose
            self._threshold = max(1, self.after_messages // 8, share)

    async def quietly(self, step: Callable[[], Awaitable[object]]) -> None:
        """Run ``step``, logging (not raising) the I/O failures a later round recovers from."""
        await background.quietly(step, self._logger, log.Event.COMPACTION_FAILED, self._noted)

    async def compact_once(self) -> Compacted | None:
        """One round: read the floor, raise the watermark, delete below it in chunks."""
        stream = self.spec.stream
        epoch = await self.epochs.refresh(stream)
        floor = await self._read_floor()
        superseded = await self._superseded(epoch)
        # The floor must belong to the epoch we name, and the epochs read as superseded
        # must be earlier ones: if the stream was recreated between the two readings,
        # skip this round.
        if floor is None or await self.epochs.refresh(stream) != epoch:
            return None
        for old, old_watermark in superseded:
            await self._sweep_superseded(old, old_watermark)
        candidate = max(floor, self.epochs.first_seq(stream) - 1)
        if candidate <= 0:
            return None
        watermark = await self._advance(epoch, candidate)
        full = self._full_round_due()
        deleted = await self._delete_below(epoch, watermark, full=full)
        forgotten = await self._forget_runs_below(epoch, watermark) if full else 0
        self._logger.debug(
            log.Event.INBOX_COMPACTED,
            epoch=epoch,
            watermark=watermark,
            deleted=deleted,
            runs_forgotten=forgotten,
        )
        return Compacted(epoch=epoch, watermark=watermark, deleted=deleted)

    def _full_round_due(self) -> bool:
        """Whether this round starts from the epoch's first sequence: this compactor's first,
        then one per compaction interval (:meth:`_delete_below`)."""
        return self._interval_passed(self._full_sweep_at)

    def _interval_passed(self, since: float | None) -> bool:
        """Whether a compaction interval has passed since ``since`` (monotonic; None: never)."""
        return since is None or time.monotonic() - since >= self._interval_s

    async def _superseded(self, epoch: str) -> list[tuple[str, int]]:
        """The stream's epochs other than ``epoch`` (read as current) and their watermarks,
        once per compaction interval and only when ``epoch`` has been the stream's for
        :attr:`epoch_sweep_after_s`; else none.

        Read between two readings of the stream that both name ``epoch``
        (:meth:`compact_once`): a watermark row is made only for an epoch read
        from the server, so at the second reading no later incarnation had
        existed, and every epoch listed here is an earlier one.
        """
        if not self._interval_passed(self._superseded_at):
            return []
        current_for = self.epochs.current_for(self.spec.stream, epoch)
        if current_for is None or current_for.total_seconds() < self.epoch_sweep_after_s:
            return []
        self._superseded_at = time.monotonic()
        t, name, stream = self.store.tables, self.spec.name, self.spec.stream
        async with self.store.session() as session:
            rows = await session.execute(*inbox_sql.superseded_epochs(t, name, stream, epoch))
            return [(str(e), int(w)) for e, w in rows.all()]

    async def _sweep_superseded(self, epoch: str, watermark: int) -> None:
        """Empty an earlier incarnation's inbox of the rows that may go, and forget its run
        counts: its messages are gone from the stream, so its watermark may rise past
        every sequence (docs/design.md, 'The watermark').

        The raise comes first, committed before any delete, as in a round: a
        delivery of that incarnation fetched before the stream was deleted and
        claimed now is taken as processed, never run again after its row went.
        It waits for claims of the epoch as a round's does, and a sweep that
        gave way leaves the epoch to the next one. Rows carrying a msg-id stay
        :attr:`msg_id_retention_s` (the guard spans epochs), retrying rows
        until their parked retry ends, then a later sweep takes them.
        """
        raising = watermark < SWEPT
        if raising:
            raised = await self._raise(epoch, SWEPT)
            if raised is None or raised < SWEPT:
                return
        deleted = await self._delete_chunks(epoch, SWEPT, after=0, look=True)
        forgotten = await self._forget_runs_below(epoch, SWEPT)
        if raising or deleted or forgotten:
            self._logger.info(
                log.Event.SUPERSEDED_EPOCH_SWEPT,
                epoch=epoch,
                raised=raising,
                deleted=deleted,
                runs_forgotten=forgotten,
            )

    async def _forget_runs_below(self, epoch: str, watermark: int) -> int:
        """Delete the run counts no settlement forgot at or below the watermark, in one
        statement that is its own transaction; how many.

        A redelivery counts its run before it starts, and the settlement that
        gives its message an outcome forgets the count; but the outcome may come
        through another delivery that knows nothing of it (a first delivery whose
        owner was frozen past its lease, committing after the redelivery gave up
        on its claim), or the forgetting may fail. Such a row would stay for ever,
        with its copy of the payload. At or below the watermark every message was
        acked or termed, and a row not parked belongs to a delivery not acked
        yet: those rows count nothing any more
        (:func:`eop.pg.sql.retries.forget_runs_below`). Only in the rounds that
        start from the first sequence: at most once per compaction interval,
        never per message.
        """
        if watermark <= 0:
            return 0
        t, name, stream = self.store.tables, self.spec.name, self.spec.stream
        async with self.store.autocommit() as session:
            stmt, params = retries_sql.forget_runs_below(t, name, stream, epoch, watermark)
            result: Any = await session.execute(stmt, params)  # DML: a rowcount
        return int(result.rowcount)

    async def _read_floor(self) -> int | None:
        if self._floor is not None:
            return await self._floor()
        info = await self.js.consumer_info(self.spec.stream, self.spec.durable)
        return int(info.ack_floor.stream_seq if info.ack_floor else 0)

    async def _ensure_row(self, epoch: str) -> None:
        if epoch in self._known:
            return
        t, name, stream = self.store.tables, self.spec.name, self.spec.stream
        async with self.store.session() as session:
            created = (
                await session.execute(*inbox_sql.create_watermark(t, name, stream, epoch))
            ).all()
            await session.commit()
        if created:
            self._created[epoch] = time.monotonic()
            await self._settle_creation(epoch)
        self._known.add(epoch)

    async def _settle_creation(self, epoch: str) -> None:
        """Wait (briefly) until no claim that could have missed the new row is still open.

        A claim statement locks the inbox table before it takes its snapshot,
        so once a SHARE lock on the table is granted after the row's COMMIT,
        every transaction whose claim may have read "no watermark row" has
        ended. At a subscription's bind that is at once (this worker claims
        nothing yet); if other workers keep it busy past the lock timeout, the
        first raise waits one compaction interval instead.
        """
        async with self.store.session() as session:
            try:
                await session.execute(base_sql.set_local_timeouts(self.settle_lock_ms, 10_000))
                await session.execute(inbox_sql.lock_inbox_shared(self.store.tables))
                await session.rollback()
            except Exception as exc:
                if failures.classify(exc) is not failures.DbFailure.LOCK_TIMEOUT:
                    raise
                return
        self._created.pop(epoch, None)

    async def _advance(self, epoch: str, candidate: int) -> int:
        """Raise the watermark in a statement of its own, committed before any delete; 0
        when it waited ``settle_lock_ms`` for the claims sharing the row and gave way.

        The statement is its own transaction (:meth:`eop.pg.store.PostgresStore.autocommit`):
        every claim of the epoch waits while the raise holds the row, and the raise
        holds it no longer than PostgreSQL takes to update it
        (:func:`eop.pg.sql.inbox.advance_watermark`).

        A claim that started before the row existed locked nothing: when this
        compactor created the row, the first raise waits one compaction
        interval after the creation, for such claims to be long finished
        (rounds started by the message count come sooner than that).
        """
        await self._ensure_row(epoch)
        created = self._created.get(epoch)
        if created is not None:
            if time.monotonic() - created < self._interval_s:
                return 0
            del self._created[epoch]
        value = await self._raise(epoch, candidate)
        if value is None:
            # Claims held up on hot rows share the row: this round deletes nothing, and
            # gives its connection back to them.
            self._deferrals += 1
            # A storm of hot rows defers every round: the 1st, 2nd, 4th, 8th... say so,
            # with the count, rather than a line every interval.
            if self._deferrals & (self._deferrals - 1) == 0:
                self._logger.info(
                    log.Event.COMPACTION_DEFERRED,
                    epoch=epoch,
                    watermark=candidate,
                    rounds=self._deferrals,
                )
            return 0
        self._deferrals = 0
        if value == 0:
            # The row is gone (deleted by hand): create it again next round.
            self._known.discard(epoch)
        return value

    async def _raise(self, epoch: str, value: int) -> int | None:
        """Raise the epoch's watermark to ``value`` in a statement of its own; the watermark
        now, 0 if the row is gone, None if the claims sharing the row held it past
        ``settle_lock_ms`` (:func:`eop.pg.sql.inbox.advance_watermark`)."""
        t, name, stream = self.store.tables, self.spec.name, self.spec.stream
        stmt, params = inbox_sql.advance_watermark(
            t, name, stream, epoch, value, self.settle_lock_ms
        )
        try:
            async with self.store.autocommit() as session:
                raised = (await session.execute(stmt, params)).scalar_one_or_none()
        except Exception as exc:
            if failures.classify(exc) is not failures.DbFailure.LOCK_TIMEOUT:
                raise
            return None
        return 0 if raised is None else int(raised)

    async def _delete_below(self, epoch: str, watermark: int, *, full: bool | None = None) -> int:
        """Delete in bounded chunks, each its own short transaction (no long locks).

        A round deletes only above the watermark of this compactor's previous
        round: the index entries of rows deleted before stay until a VACUUM,
        and a scan from the epoch's first sequence walks them all, in every
        round (autovacuum wakes once a minute; at 20,000 messages a second the
        rounds then cost more each as the run goes on). The rows a round must
        leave behind (carrying a msg-id, or retrying) are deleted by the round
        that starts from the first sequence, at most once per compaction
        interval (and at this compactor's first round of an epoch).

        A chunk is a range of :attr:`chunk_rows` sequences, deleted in one pass
        of the index (:func:`eop.pg.sql.inbox.delete_below_watermark`). The
        first chunk of a round counted by messages starts where the previous
        round ended, where the rows of the messages since usually start; every
        other chunk starts at the lowest row above the previous chunk that may
        go, looked up in the chunk's transaction
        (:func:`eop.pg.sql.inbox.first_to_delete`). Ranges alone would take a
        statement for every :attr:`chunk_rows` sequences of a gap: the round
        from the first sequence spans the whole epoch, deleted long ago, and
        within a round the rows that stay, the sequences of other subjects and
        those another process's round deleted leave gaps too. The look-up
        passes over what the delete would have (the rows that stay, the index
        entries of deleted rows until a VACUUM), once; it costs a statement
        (about 340 instructions a message at a round per 1,024, so the usual
        round of one chunk goes without). A round takes at most one chunk per
        row that may go and per :attr:`chunk_rows` sequences, whichever is
        fewer, one more, and a look-up each but the first.

        ``full``: whether this round starts from the first sequence (None: decided
        here, by :meth:`_full_round_due`).
        """
        now = time.monotonic()
        if full is None:
            full = self._full_round_due()
        total = await self._delete_chunks(
            epoch, watermark, after=0 if full else self._swept.get(epoch, 0), look=full
        )
        self._swept[epoch] = max(watermark, self._swept.get(epoch, 0))
        if full:
            self._full_sweep_at = now
        return total

    async def _delete_chunks(self, epoch: str, watermark: int, *, after: int, look: bool) -> int:
        """Delete the rows that may go above ``after`` up to ``watermark``, a chunk a
        transaction, the first chunk's start looked up when ``look``; how many."""
        total = 0
        while after < watermark:
            async with self.store.session() as session:
                start = await self._first_to_delete(session, epoch, watermark, after, look)
                if start is not None:
                    after = start - 1
                    stmt, params = inbox_sql.delete_below_watermark(
                        self.store.tables,
                        self.spec.name,
                        self.spec.stream,
                        epoch,
                        watermark,
                        self.chunk_rows,
                        self.msg_id_retention_s,
                        after,
                    )
                    result: Any = await session.execute(stmt, params)  # DML: a rowcount
                    total += int(result.rowcount)
                await session.commit()
            if start is None:
                break
            after = min(watermark, after + self.chunk_rows)
            look = True
        return total

    async def _first_to_delete(
        self, session: AsyncSession, epoch: str, watermark: int, after: int, look: bool
    ) -> int | None:
        """Where the next chunk starts: the lowest sequence above ``after`` whose row may go
        (None: none up to ``watermark``), looked up when ``look``, else ``after + 1``."""
        if not look:
            return after + 1
        stmt, params = inbox_sql.first_to_delete(
            self.store.tables,
            self.spec.name,
            self.spec.stream,
            epoch,
            watermark,
            self.msg_id_retention_s,
            after,
        )
        first = (await session.execute(stmt, params)).scalar_one_or_none()
        return None if first is None else int(first)
