"""Running an eop handler over the messages of one Spark partition, exactly once.

The workers' batch protocol (:mod:`eop.protocol.batch`) with a partition in place of a
fetched batch, and no acks:

- one transaction per partition, with eop's ``SET LOCAL`` timeouts, and one
  multi-row claim of its messages, with the workers' inbox key
  ``(handler name, stream, epoch, seq)`` and fingerprint. A message not
  claimed was processed before (same fingerprint: skipped) or its sequence
  was reused (another fingerprint: quarantined as a dead letter, alarm);
- the handlers run without savepoints first. If one fails, the transaction
  is rolled back and run again with a savepoint per message, so one failing
  message does not sink the others: :class:`eop.Reject` (or an undecodable
  payload) dead-letters it at once, any other error is retried in place with
  backoff up to ``max_attempts``, then dead-lettered; the dead letter and its
  inbox row (outcome ``dead_lettered``) commit with the partition;
- a conflict, a lock timeout or a lost connection retries the whole
  transaction, claims included; an ambiguous COMMIT fails the task, whose
  retry finds whatever did commit.

So a task retry, a speculative copy of a task, a replayed micro-batch or a
live worker on the same messages only ever finds claims and skips them.
Sync handlers run in the task's own thread on a sync ``Session`` with no
event loop; async handlers on an ``AsyncSession``, in an event loop kept for
the life of the Python worker process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from eop import backoff, errors, log
from eop.app import App
from eop.broker import consumers
from eop.contrib.spark import lease
from eop.contrib.spark.transaction import (
    AsyncPartitionTx,
    PartitionTx,
    SyncPartitionTx,
    drive,
    transient,
)
from eop.handler import HandlerSpec
from eop.message import Message
from eop.pg import contract, failures, models, session_guard, transactions
from eop.pg.sql import base as base_sql
from eop.pg.sql import inbox as inbox_sql

Sleep = Callable[[float], Awaitable[None]]


class RowOutcome(enum.Enum):
    """What became of one message of a partition."""

    PROCESSED = "processed"
    DUPLICATE = "duplicate"
    DEAD_LETTERED = "dead_lettered"
    QUARANTINED = "quarantined"
    SKIPPED = "skipped"
    """Another stream or subject than the handler's: a worker would never deliver it."""


# The waits before a partition's transaction runs again after a transient
# failure (``tx_retries`` of them at most, inside one Spark task).
_TX_RETRY_FIRST_S = 0.1
_TX_RETRY_MAX_S = 2.0

_COUNT_FIELD = {
    RowOutcome.PROCESSED: "processed",
    RowOutcome.DUPLICATE: "duplicates",
    RowOutcome.DEAD_LETTERED: "dead_lettered",
    RowOutcome.QUARANTINED: "quarantined",
    RowOutcome.SKIPPED: "skipped",
}


@dataclasses.dataclass
class Counts:
    """Outcomes of the messages of one or more partitions."""

    processed: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    quarantined: int = 0
    skipped: int = 0

    def add(self, outcome: RowOutcome, n: int = 1) -> None:
        """Count ``n`` messages with ``outcome``."""
        name = _COUNT_FIELD[outcome]
        setattr(self, name, getattr(self, name) + n)

    def __add__(self, other: Counts) -> Counts:
        return Counts(**{k: v + getattr(other, k) for k, v in self.as_dict().items()})

    @property
    def total(self) -> int:
        """Every message counted."""
        return sum(self.as_dict().values())

    def as_dict(self) -> dict[str, int]:
        """The counts by name."""
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        text = (
            f"{self.processed} processed, {self.duplicates} already done, "
            f"{self.dead_lettered} dead-lettered, {self.quarantined} quarantined"
        )
        return text + (f", {self.skipped} not for this handler" if self.skipped else "")


class Partition:
    """Runs one handler over partitions of messages; one per handler per process."""

    def __init__(self, app: App, spec: HandlerSpec, *, lease: str | None = None) -> None:
        self.app = app
        self.spec = spec
        self.lease = lease
        """The job's lease, checked in every transaction (:mod:`eop.contrib.spark.lease`)."""
        self.settings = app.settings
        self.tables = models.tables(app.settings.schema)
        s = app.settings
        self.timeouts = base_sql.set_local_timeouts(
            int(s.lock_timeout_s * 1000), int(s.statement_timeout_s * 1000)
        )
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def max_attempts(self) -> int:
        """Attempts of a failing message before it is dead-lettered."""
        return self.spec.max_attempts or self.settings.max_attempts

    def run(self, messages: Iterable[Message]) -> Counts:
        """Process the messages in one transaction (retried whole on transient errors)."""
        batch = list(messages)
        if not self.spec.is_async:
            return drive(self._run(batch, _blocking_sleep))
        if self._loop is None:
            # Kept for the process's life: the async engine's pooled connections
            # belong to the loop that opened them.
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(self._run(batch, asyncio.sleep))

    def close(self) -> None:
        """Dispose of the app's connection pools."""
        if self._loop is not None:
            self._loop.run_until_complete(self.app.dispose())
            self._loop.close()
            self._loop = None
        else:
            asyncio.run(self.app.dispose())

    async def _run(self, batch: list[Message], sleep: Sleep) -> Counts:
        attempt = 0
        isolate = False
        while True:
            try:
                return await _Pass(self, sleep, isolate=isolate).transaction(batch)
            except _NeedsIsolation:
                isolate = True
            except Exception as exc:
                if not transient(exc) or attempt >= self.settings.tx_retries:
                    raise
                attempt += 1
                log.get_logger(handler=self.spec.name).info(
                    log.Event.TRANSACTION_RETRY,
                    retry=attempt,
                    messages=len(batch),
                    error=_describe(exc),
                )
                await sleep(backoff.backoff_s(attempt, _TX_RETRY_FIRST_S, _TX_RETRY_MAX_S))

    @contextlib.asynccontextmanager
    async def open(self) -> AsyncIterator[PartitionTx]:
        """A transaction with eop's local timeouts; closed (and so rolled back) on exit."""
        if self.spec.is_async:
            async with self.app.sessionmaker() as session:
                atx = AsyncPartitionTx(session, self.tables, self.spec)
                try:
                    await _connected(atx.select(self.timeouts))
                    yield atx
                finally:
                    session_guard.unguard(session.sync_session)
            return
        sync_session = self.app.sync_sessionmaker()
        try:
            stx = SyncPartitionTx(sync_session, self.tables, self.spec)
            await _connected(stx.select(self.timeouts))
            yield stx
        finally:
            with contextlib.suppress(Exception):
                session_guard.end(sync_session, "close")


async def _blocking_sleep(seconds: float) -> None:
    # The sync path has no event loop: waiting blocks the task's thread, as it should.
    time.sleep(seconds)  # noqa: ASYNC251


async def _connected(awaitable: Awaitable[Any]) -> None:
    """The first statement opens the connection: 'cannot connect' is DatabaseUnavailable."""
    with failures.unavailable_when_unreachable(describe=lambda exc: _describe(exc)[:200]):
        await awaitable


class _NeedsIsolation(Exception):
    """A handler failed in the savepoint-less pass: run the partition again with savepoints."""


class _Pass:
    """One attempt at a partition's transaction."""

    def __init__(self, partition: Partition, sleep: Sleep, *, isolate: bool) -> None:
        self.p = partition
        self.spec = partition.spec
        self.sleep = sleep
        self.isolate = isolate
        self._committed_lines: list[Callable[[], None]] = []
        """Lines that tell of what commits with the partition (its dead letters): logged
        after COMMIT, so that a transaction retried, or a task that fails, tells of none."""

    async def transaction(self, batch: list[Message]) -> Counts:
        counts = Counts()
        mine = self._select(batch, counts)
        async with self.p.open() as tx:
            if self.p.lease is not None:
                await lease.check(tx, self.spec, self.p.settings.schema, self.p.lease)
            todo: list[Message] = []
            for group in _by_epoch(mine):
                claimed = await tx.claim_many(group, models.OUTCOME_PROCESSED)
                todo += [m for m in group if m.seq in claimed]
                taken = [m for m in group if m.seq not in claimed]
                for msg, existing in await _existing(tx, self.p.tables, taken):
                    counts.add(await self._not_claimed(tx, msg, existing))
            if self.isolate:
                for outcome in await self._isolated(tx, todo):
                    counts.add(outcome)
            else:
                await self._optimistic(tx, todo)
                counts.add(RowOutcome.PROCESSED, len(todo))
            await tx.commit()
        for line in self._committed_lines:
            line()
        return counts

    def _select(self, batch: list[Message], counts: Counts) -> list[Message]:
        """The handler's messages, each once (a DataFrame may hold a row twice)."""
        seen: set[tuple[str, int]] = set()
        mine = []
        for msg in batch:
            theirs = msg.stream != self.spec.stream
            if theirs or not consumers.subject_matches(self.spec.subject, msg.subject):
                counts.add(RowOutcome.SKIPPED)
            elif (msg.stream_epoch, msg.seq) in seen:
                counts.add(RowOutcome.DUPLICATE)
            else:
                seen.add((msg.stream_epoch, msg.seq))
                mine.append(msg)
        return mine

    async def _optimistic(self, tx: transactions.SqlTransaction, todo: list[Message]) -> None:
        try:
            # Writes go out together, a statement per run of one statement (eop.writes).
            if self.spec.batch:
                for chunk in _chunks(todo, self.p.settings.batch):
                    await tx.run_many(chunk, flush=False)
            else:
                for msg in todo:
                    await tx.run(msg, flush=False)
            await tx.flush()
        except Exception as exc:
            if transient(exc):
                raise
            raise _NeedsIsolation() from exc

    async def _isolated(
        self, tx: transactions.SqlTransaction, todo: list[Message]
    ) -> list[RowOutcome]:
        outcomes: list[RowOutcome] = []
        if self.spec.batch:
            singles: list[Message] = []
            for chunk in _chunks(todo, self.p.settings.batch):
                error = await tx.run_isolated(chunk)
                if error is None:
                    outcomes += [RowOutcome.PROCESSED] * len(chunk)
                elif transient(error):
                    raise error
                else:
                    # Which message the batch handler choked on is unknown: one by one.
                    singles += chunk
            todo = singles
        for msg in todo:
            outcomes.append(await self._one(tx, msg))
        return outcomes

    async def _one(self, tx: transactions.SqlTransaction, msg: Message) -> RowOutcome:
        """One claimed message in its own savepoint: retried in place, else dead-lettered."""
        logger = log.get_logger(handler=self.spec.name, stream=msg.stream, seq=msg.seq)
        attempt = 1
        while True:
            # num_delivered counts this run's attempts (the inbox's delivery_count).
            msg = dataclasses.replace(msg, num_delivered=attempt)
            error = await tx.run_isolated([msg])
            if error is None:
                return RowOutcome.PROCESSED
            if transient(error):
                raise error
            if isinstance(error, errors.Reject) or attempt >= self.p.max_attempts:
                return await self._dead_letter(tx, msg, error, logger)
            logger.info(log.Event.MESSAGE_RETRY, attempt=attempt, error=_describe(error))
            await self.sleep(self._delay(error, attempt))
            attempt += 1

    def _delay(self, exc: Exception, attempt: int) -> float:
        s = self.p.settings
        if isinstance(exc, errors.Retry) and exc.delay_s is not None:
            # Waited inside the partition's transaction: never longer than the backoff cap.
            return min(exc.delay_s, s.backoff_max_s)
        return backoff.backoff_s(attempt, s.backoff_base_s, s.backoff_max_s)

    async def _dead_letter(
        self, tx: transactions.SqlTransaction, msg: Message, exc: Exception, logger: log.Logger
    ) -> RowOutcome:
        if isinstance(exc, errors.UndecodableMessage):
            reason = models.REASON_UNDECODABLE
        elif isinstance(exc, errors.Reject):
            reason = models.REASON_REJECTED
        else:
            reason = models.REASON_ATTEMPTS_EXHAUSTED
        # The claim says "processed": replace it, in this transaction, by a dead letter's.
        await tx.unclaim(msg)
        if not await tx.claim(msg, models.OUTCOME_DEAD_LETTERED):
            return await self._not_claimed(tx, msg, await tx.find(msg))
        tb = log.format_traceback(exc)
        await tx.add_dead_letter(
            msg, contract.DeadLetter(reason=reason, error=_describe(exc), traceback=tb)
        )
        self._committed_lines.append(
            functools.partial(
                logger.warning,
                log.Event.MESSAGE_DEAD_LETTERED,
                reason=reason,
                error=_describe(exc)[:500],
            )
        )
        return RowOutcome.DEAD_LETTERED

    async def _not_claimed(
        self, tx: transactions.SqlTransaction, msg: Message, existing: contract.Existing | None
    ) -> RowOutcome:
        """A message whose claim found the key (or its msg-id, or the watermark) taken."""
        if existing is None:
            # The conflicting claim rolled back between our claim and the look-up.
            raise errors.TransactionConflict()
        if existing.by == "key" and existing.fingerprint != msg.fingerprint:
            dead = contract.DeadLetter(
                reason=models.REASON_SEQUENCE_REUSED,
                error=f"stream {msg.stream} sequence {msg.seq} (epoch {msg.stream_epoch}) was "
                "already processed with a different fingerprint: the stream was recreated "
                "without a new epoch, or the server lost its tail",
            )
            await tx.add_dead_letter(msg, dead)
            logger = log.get_logger(handler=msg.subscription, stream=msg.stream, seq=msg.seq)
            self._committed_lines.append(
                functools.partial(logger.error, log.Event.MESSAGE_QUARANTINED, alarm=True)
            )
            return RowOutcome.QUARANTINED
        return RowOutcome.DUPLICATE


async def _existing(
    tx: PartitionTx, tables: models.Tables, taken: list[Message]
) -> list[tuple[Message, contract.Existing | None]]:
    """What the inbox holds for messages not claimed, in two queries for most of them.

    A backfill over what workers processed finds every message taken, by its
    key or, once compaction deleted the inbox rows, below the watermark; a
    look-up each would be most of its work. The rest (taken by msg-id, or gone
    meanwhile) go through :meth:`SqlTransaction.find`.
    """
    if not taken:
        return []
    first = taken[0]
    seqs = [m.seq for m in taken]
    stmt = inbox_sql.find_by_keys(
        tables, first.subscription, first.stream, first.stream_epoch, seqs
    )
    by_key = {int(seq): (fp, outcome) for seq, fp, outcome in await tx.select(stmt)}
    mark = await tx.select(
        inbox_sql.watermark(tables, first.subscription, first.stream, first.stream_epoch)
    )
    watermark = int(mark[0][0]) if mark else 0
    found: list[tuple[Message, contract.Existing | None]] = []
    for msg in taken:
        if msg.seq in by_key:
            fingerprint, outcome = by_key[msg.seq]
            found.append(
                (msg, contract.Existing(by="key", fingerprint=fingerprint, outcome=outcome))
            )
        elif msg.seq <= watermark:
            # Compacted: its outcome committed before the consumer's ack floor passed it.
            outcome = models.OUTCOME_PROCESSED
            found.append(
                (msg, contract.Existing(by="watermark", fingerprint=None, outcome=outcome))
            )
        else:
            found.append((msg, await tx.find(msg)))
    return found


def _by_epoch(messages: list[Message]) -> list[list[Message]]:
    """Groups of one stream epoch each: a multi-row claim answers with sequences only."""
    groups: dict[str, list[Message]] = {}
    for msg in messages:
        groups.setdefault(msg.stream_epoch, []).append(msg)
    return list(groups.values())


def _chunks(items: list[Message], size: int) -> list[list[Message]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _describe(exc: BaseException) -> str:
    return log.bounded_error(exc)
