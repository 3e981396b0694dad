"""The outbox relay: publishes committed outbox rows, in order, exactly once.

One relay at a time publishes: the one holding the lease (a row of
``relay_leases``, renewed on the database's clock). The others stand by and
take the lease over when it expires, so any number of relays may run (one in
each ``eop worker`` process, ``eop relay`` beside them) and the rows still go
out in ``id`` order. A round:

1. marks what an earlier round published but could not mark (the database
   was away), so a recovered database does not cause a second send;
2. reads the oldest pending rows (``outbox_batch``), skipping the subjects
   held back after a refusal;
3. hands them to its publisher (:mod:`eop.outbox.publishing`; JetStream's,
   :mod:`eop.outbox.jetstream_publisher`, sends them all at once and waits for
   their PubAcks); every send of a row carries its ``Nats-Msg-Id``, so a re-send is
   dropped by the stream inside its duplicate window and by an eop
   consumer's msg-id guard after it;
4. marks the acknowledged rows published, with their stream sequence. When
   the round was a full batch (a backlog) and every row was acknowledged, the
   mark runs while the next round reads and publishes, at most one mark in
   flight: the order of the sends does not depend on it, and the next read
   skips the rows it marks.

A row the server refuses for good (too large, a header it rejects) is parked
at once; one whose subject no stream holds, as JetStream itself answers, is
parked after ``outbox_max_attempts`` such answers, its subject held back in
between so later rows of the subject do not overtake it. An outage of NATS
or PostgreSQL never counts: the round is tried again, with backoff, until it
goes through. See docs/design.md, 'The outbox'.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import time
import uuid
from collections.abc import Awaitable

import sqlalchemy as sa
import tenacity
from sqlalchemy.ext.asyncio import AsyncEngine

from eop import backoff, errors, faults, log
from eop.observe.observer import NOOP, Observer
from eop.outbox import notifications, sql
from eop.outbox.publishing import Fate, Publisher, Receipt, Row
from eop.pg import failures, models
from eop.protocol import background, misconfiguration
from eop.settings import Settings

# The waits after failed rounds: 0.2 s doubling to 5 s (an outage is retried for ever).
_FAILED_FIRST_S = 0.2
_FAILED_MAX_S = 5.0
# A subject no stream holds is asked again after 1 s, doubling to 60 s: with the default
# outbox_max_attempts (10), parked only after about 4 minutes of refusals.
_HELD_FIRST_S = 1.0
_HELD_MAX_S = 60.0
# Published rows deleted per statement, and how often the leader purges and reports lag.
_PURGE_ROWS = 10_000
_HOUSEKEEPING_S = 5.0


@dataclasses.dataclass
class _Round:
    """What one round's publishes came to."""

    published: list[tuple[int, str, int]] = dataclasses.field(default_factory=list)
    parked: dict[str, list[tuple[int, str]]] = dataclasses.field(default_factory=dict)
    refused: list[tuple[Row, Receipt]] = dataclasses.field(default_factory=list)
    """Rows refused: to count an attempt for (then park at the limit), or to hold back."""
    unanswered: int = 0
    unsent: int = 0
    """Rows not sent: the target was not connected."""

    @classmethod
    def of(cls, rows: list[Row], receipts: list[Receipt]) -> _Round:
        """The receipts of ``rows``, by what the relay does with them."""
        result = cls()
        for row, receipt in zip(rows, receipts, strict=True):
            if receipt.fate is Fate.PUBLISHED:
                result.published.append((row.id, receipt.stream, receipt.seq))
            elif receipt.fate is Fate.PARKED:
                result.parked.setdefault(receipt.reason, []).append((row.id, receipt.error))
            elif receipt.fate in (Fate.REFUSED, Fate.HELD):
                result.refused.append((row, receipt))
            elif receipt.fate is Fate.UNSENT:
                result.unsent += 1
            else:
                result.unanswered += 1
        return result


class Relay:
    """Publishes the outbox of ``settings.schema`` through ``publisher`` while it holds the
    lease."""

    def __init__(
        self,
        engine: AsyncEngine,
        publisher: Publisher,
        settings: Settings,
        *,
        observer: Observer = NOOP,
        holder: str | None = None,
        misconfigured: misconfiguration.Watch | None = None,
    ) -> None:
        self.engine = engine
        self.misconfigured = misconfigured or misconfiguration.Watch()
        """Counts the failures only a change of configuration ends (the worker's, in one)."""
        self.publisher = publisher
        self.settings = settings
        self.tables = models.tables(settings.schema)
        self.observer = observer
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        """This relay's name in the lease (host, pid and a random part)."""
        self.published = 0
        """Rows this relay published (PubAck received and marked)."""
        self.parked = 0
        self.notifications = 0
        """NOTIFYs received (each wakes a round)."""
        self._wake = asyncio.Event()
        self._held: dict[str, tuple[float, int]] = {}
        self._unmarked: list[tuple[int, str, int]] = []
        self._marking: asyncio.Task[None] | None = None
        """The previous round's mark, while it runs beside this round's read and publish."""
        self._marking_ids: list[int] = []
        """The ids that mark covers, sorted: the next read skips them."""
        self._lease_until = 0.0
        self._holding = False
        self._renew_at = 0.0
        self._housekeeping_at = 0.0
        self._logger = log.get_logger(relay=self.holder)
        self._listener = notifications.Listener(
            engine, settings, self._notified, logger=self._logger
        )

    @property
    def leading(self) -> bool:
        """True while this relay holds the lease (by its own, cautious, clock)."""
        return time.monotonic() < self._lease_until

    def wake(self) -> None:
        """Look for rows now (a NOTIFY arrived, or a test wants a round)."""
        self._wake.set()

    def _notified(self) -> None:
        self.notifications += 1
        self._wake.set()

    async def run(self, stopping: asyncio.Event) -> None:
        """Publish while leading, stand by otherwise, until ``stopping`` is set.

        Failures of the target (NATS) or PostgreSQL are logged (once per outage) and the
        round is tried again with backoff; the lease is given up on the way out.
        """
        failures_in_row = 0
        try:
            while not stopping.is_set():
                try:
                    # A step waits on PostgreSQL (a lock, a connection that does not
                    # come) and NATS for as long as they take: a stop must not. An
                    # abandoned round's rows are sent again by the next holder, with
                    # their msg-ids, as after a crash.
                    wait_s = await background.before_stop(
                        self._step(), stopping, self.settings.publish_timeout_s
                    )
                    failures_in_row = 0
                except background.Abandoned:
                    self._logger.warning(
                        log.Event.RELAY_ABANDONED, waited_s=self.settings.publish_timeout_s
                    )
                    break
                except Exception as exc:
                    failures_in_row += 1
                    self.misconfigured.note(exc, "the outbox relay", self.settings)
                    (self._logger.warning if failures_in_row == 1 else self._logger.debug)(
                        log.Event.RELAY_FAILED,
                        failures=failures_in_row,
                        error=log.brief_error(exc),
                    )
                    await self._listener.close()
                    wait_s = backoff.backoff_s(failures_in_row, _FAILED_FIRST_S, _FAILED_MAX_S)
                await self._sleep(stopping, wait_s)
        finally:
            await self._leave()

    async def _step(self) -> float:
        """One pass: keep (or try for) the lease, then a round if leading; how long to wait."""
        now = time.monotonic()
        if now >= self._renew_at:
            await self._take_lease()
        if not self.leading:
            return self.settings.relay_lease_s / 3
        await self._listener.listen()
        if time.monotonic() >= self._housekeeping_at:
            await self._housekeeping()
        self._wake.clear()
        sent = await self.round()
        if sent >= self.settings.outbox_batch:
            return 0.0
        until_renew = max(self._renew_at - time.monotonic(), 0.0)
        return min(self.settings.outbox_poll_s, until_renew, self._next_release())

    async def _sleep(self, stopping: asyncio.Event, wait_s: float) -> None:
        if wait_s <= 0:
            return
        waiters = [asyncio.ensure_future(stopping.wait()), asyncio.ensure_future(self._wake.wait())]
        try:
            await asyncio.wait(waiters, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    # -- the lease

    async def _take_lease(self) -> None:
        lease_s = self.settings.relay_lease_s
        asked_at = time.monotonic()
        try:
            async with self.engine.begin() as conn:
                got = (
                    await conn.execute(sql.take_lease(self.tables, self.holder, lease_s))
                ).first()
        except Exception:
            # Unknown whether it was renewed: assume the worst, stop publishing at expiry.
            self._renew_at = time.monotonic() + 1.0
            raise
        if got is None:
            self._lease_until = 0.0
            self._renew_at = time.monotonic() + lease_s / 3
            if self._holding:
                # Another relay holds it now: this one was frozen, or cut off, past it.
                self._holding = False
                self._logger.warning(log.Event.RELAY_STANDING_BY)
                await self._listener.close()
            return
        # Counted from before the request: the database's expiry is at least this late.
        # A quarter of the lease is left as a margin for the clocks' drift and a slow round.
        self._lease_until = asked_at + lease_s * 0.75
        self._renew_at = asked_at + lease_s / 3
        if not self._holding:
            self._holding = True
            self._logger.info(log.Event.RELAY_LEADING, lease_s=lease_s)
            self._housekeeping_at = 0.0

    async def _leave(self) -> None:
        """On the way out: mark what was published, give the lease up, stop listening.

        All of it within ``publish_timeout_s``: what is not done by then (PostgreSQL does
        not answer) is done by the next holder, once the lease has run out.
        """
        await self._listener.close()
        deadline = time.monotonic() + self.settings.publish_timeout_s

        async def bounded(work: Awaitable[None]) -> None:
            with contextlib.suppress(Exception):
                await background.bounded(work, max(deadline - time.monotonic(), 0.0))

        # A mark that failed put its rows back into _unmarked, marked just below.
        await bounded(self.marked())
        if not self._holding and not self._unmarked:
            self._logger.info(log.Event.RELAY_STOPPED, published=self.published)
            return
        await bounded(self._mark_unmarked())
        await bounded(self._release_lease())
        self._lease_until = 0.0
        self._holding = False
        self._logger.info(log.Event.RELAY_STOPPED, published=self.published)

    async def _release_lease(self) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(sql.release_lease(self.tables, self.holder))

    # -- a round

    async def round(self) -> int:
        """Publish the oldest pending rows once; how many were sent.

        When they were a full batch, every row acknowledged, their mark is left running
        (:meth:`marked` waits for it) while the next round reads and publishes. A
        smaller round marks before it returns: nothing follows it at once, and its
        rows' latency would pay for the next read's skipping them.
        """
        if self._marking is None:
            await self._mark_unmarked()
        rows = await self._read()
        if not rows or not self.leading:
            # Not leading any more (the read outlived the lease): the new holder sends them.
            await self.marked()
            return 0
        result = _Round.of(rows, await self.publisher.publish(rows))
        await faults.point("relay_after_publish")
        self._unmarked.extend(result.published)
        # One mark in flight at most; a failed one put its rows back into _unmarked.
        await self.marked()
        if len(result.published) == len(rows) >= self.settings.outbox_batch:
            self._start_marking()
            return len(rows)
        await self._mark_unmarked()
        await faults.point("relay_after_mark")
        await self._settle_refusals(result)
        target = self.publisher.target
        if result.unsent:
            raise errors.ServiceUnavailable(
                f"{result.unsent} of {len(rows)} outbox messages not sent: {target} is not "
                "connected; sending them once it is"
            )
        if result.unanswered:
            raise errors.ServiceUnavailable(
                f"{result.unanswered} of {len(rows)} outbox messages not confirmed by "
                f"{target} within {self.settings.publish_timeout_s} s; sending them again"
            )
        return len(rows)

    async def marked(self) -> None:
        """Wait for the mark in flight, if any; raises what failed it (its rows are kept)."""
        marking, self._marking = self._marking, None
        self._marking_ids = []
        if marking is not None:
            await marking

    def _start_marking(self) -> None:
        """Mark what was published in a task of its own, to overlap the next round."""
        if not self._unmarked:
            return
        done, self._unmarked = self._unmarked, []
        self._marking_ids = sorted(row_id for row_id, _, _ in done)
        self._marking = asyncio.create_task(self._mark_then_point(done))

    async def _mark_then_point(self, done: list[tuple[int, str, int]]) -> None:
        await self._mark(done)
        await faults.point("relay_after_mark")

    async def _read(self) -> list[Row]:
        held = self._held_subjects()
        stmt = sql.pending(self.tables, self.settings.outbox_batch, held, self._marking_ids)
        async with self.engine.connect() as conn:
            result = await failures.connected(conn.execute(stmt))
            records = result.all()
        return [
            Row(
                id=int(r[0]),
                msg_id=str(r[1]),
                subject=str(r[2]),
                headers=json.loads(bytes(r[3])),
                payload=bytes(r[4]),
                attempts=int(r[5]),
            )
            for r in records
        ]

    async def _mark_unmarked(self) -> None:
        if not self._unmarked:
            return
        done, self._unmarked = self._unmarked, []
        await self._mark(done)

    async def _mark(self, done: list[tuple[int, str, int]]) -> None:
        """Mark the published rows ``done``; on failure they go back to ``_unmarked``."""
        ids, streams, seqs = (list(column) for column in zip(*done, strict=True))
        try:
            async for attempt in _retrying():
                with attempt:
                    async with self.engine.begin() as conn:
                        await conn.execute(sql.mark_published(self.tables, ids, streams, seqs))
        except BaseException:
            # Published: kept, to be marked before anything else is sent (not sent again).
            self._unmarked = done + self._unmarked
            raise
        self.published += len(done)
        self.observer.outbox_published(len(done))
        self._logger.debug(log.Event.OUTBOX_PUBLISHED, rows=len(done))

    async def _settle_refusals(self, result: _Round) -> None:
        for reason, parked in result.parked.items():
            for row_id, error in parked:
                await self._park(sql.park(self.tables, [row_id], reason, error), reason, error)
        by_subject: dict[tuple[str, Fate, str, str], list[Row]] = {}
        for row, receipt in result.refused:
            key = (row.subject, receipt.fate, receipt.reason, receipt.error)
            by_subject.setdefault(key, []).append(row)
        for (subject, fate, reason, error), rows in by_subject.items():
            if fate is Fate.HELD:
                # Refused without the target's word for it (no responders while JetStream
                # restarts): held back a while, nothing counted.
                self._hold(subject, 1)
            else:
                await self._refused(subject, rows, reason, error)

    async def _refused(self, subject: str, rows: list[Row], reason: str, error: str) -> None:
        """Count a refusal of ``rows``, hold their subject back, park those at the limit."""
        async with self.engine.begin() as conn:
            stmt = sql.count_attempt(self.tables, [r.id for r in rows], error)
            counted = (await conn.execute(stmt)).all()
        attempts = max((int(a) for _, a in counted), default=1)
        self._logger.warning(
            log.Event.OUTBOX_REFUSED,
            subject=subject,
            rows=len(rows),
            attempts=attempts,
            reason=reason,
        )
        if attempts >= self.settings.outbox_max_attempts:
            # The subject's refusals are spent: park all its pending rows at once, or a
            # backlog would take its full course of refusals one round at a time.
            await self._park(sql.park_subject(self.tables, subject, reason, error), reason, error)
        self._hold(subject, attempts)

    async def _park(self, stmt: sa.Executable, reason: str, error: str) -> None:
        async with self.engine.begin() as conn:
            parked = (await conn.execute(stmt)).all()
        if parked:
            self.parked += len(parked)
            self.observer.outbox_parked(len(parked), reason)
            self._logger.error(
                log.Event.OUTBOX_PARKED,
                rows=len(parked),
                ids=[int(r[0]) for r in parked][:20],
                reason=reason,
                error=error,
                alarm=True,
            )

    # -- held subjects

    def _hold(self, subject: str, attempts: int) -> None:
        delay = backoff.backoff_s(attempts, _HELD_FIRST_S, _HELD_MAX_S)
        self._held[subject] = (time.monotonic() + delay, attempts)

    def _held_subjects(self) -> list[str]:
        now = time.monotonic()
        for subject in [s for s, (until, _) in self._held.items() if until <= now]:
            del self._held[subject]
        return sorted(self._held)

    def _next_release(self) -> float:
        if not self._held:
            return float("inf")
        return max(min(until for until, _ in self._held.values()) - time.monotonic(), 0.0)

    # -- housekeeping

    async def _housekeeping(self) -> None:
        """Delete published rows past ``outbox_keep_s`` (bounded) and report the backlog."""
        self._housekeeping_at = time.monotonic() + _HOUSEKEEPING_S
        deleted = 0
        for _ in range(10):
            async with self.engine.begin() as conn:
                result = await conn.execute(
                    sql.purge_published(self.tables, self.settings.outbox_keep_s, _PURGE_ROWS)
                )
            count = result.rowcount or 0
            deleted += count
            if count < _PURGE_ROWS:
                break
        if deleted:
            self._logger.debug(log.Event.OUTBOX_PURGED, rows=deleted)
        if self.observer is NOOP:
            return  # nobody to report the backlog to
        async with self.engine.connect() as conn:
            row = (await conn.execute(sql.summary(self.tables))).one()
        self.observer.outbox_backlog(int(row[0]), float(row[1] or 0.0), int(row[2]))


def _retrying() -> tenacity.AsyncRetrying:
    """Marks retried in place a few times (a dropped connection), then the round fails."""
    return backoff.retrying(
        stop=tenacity.stop_after_attempt(3),
        retry=tenacity.retry_if_exception(failures.transient),
        base_s=0.1,
        max_s=1.0,
        before_sleep=lambda state: None,
    )
