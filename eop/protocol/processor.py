"""The per-message protocol.

Claim first, run the handler in the same transaction, COMMIT, then the
confirmed ack; every failure lands in exactly one committed outcome (the
handler's writes or a dead letter, each with its inbox row), in a parked
retry (:mod:`eop.pg.retries`), or in a redelivery that will find one.

Attempts are the handler's failures, counted in the database. Failures of
the database itself (:data:`eop.pg.failures.INFRASTRUCTURE`: an outage, read-only,
lock and statement timeouts, deadlocks, an exhausted pool) are retried here,
in the process, with jittered backoff, for as long as the worker runs: they
never count, so no outage is long enough to dead-letter a good message. Those
only a change of configuration ends (a mismatched pooler, a missing table)
stop the worker instead (:mod:`eop.protocol.misconfiguration`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from eop import backoff, errors, faults, log, message
from eop.broker import ack, leases
from eop.handler import HandlerSpec
from eop.observe import observer as observe
from eop.pg import failures, inbox, models, retries
from eop.protocol import misconfiguration
from eop.settings import Settings
from eop.types import Delivery, Outcome

T = TypeVar("T")


class Epochs(Protocol):
    """Where the processor learns which epoch of a stream a message belongs to.

    :class:`eop.broker.jetstream.StreamEpochs` is the one a worker uses.
    """

    async def epoch_of(self, stream: str, stored_at: datetime.datetime | None) -> str | None:
        """The epoch of the message stored at ``stored_at``; None if its stream is gone."""

    async def refresh(self, stream: str) -> str:
        """Re-read the epoch of ``stream`` from the server."""


class Critical:
    """Sections that cancellation must not cut (COMMIT and the ack that follows).

    A section runs as its own task behind :func:`asyncio.shield`; a stopping
    worker waits for :meth:`drain` before it closes its connections.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    async def run(self, coro: Awaitable[T]) -> T:
        """Run ``coro`` to its end even if the caller is cancelled."""
        task: asyncio.Task[T] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # Let the section end before the caller's cleanup runs: that cleanup
            # closes the session the section is committing on.
            await asyncio.wait({task})
            raise

    async def drain(self) -> None:
        """Wait for every running section."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


class _EpochChanged(Exception):
    """The stream was recreated under the message: retry with the new epoch."""

    def __init__(self, epoch: str) -> None:
        super().__init__(epoch)
        self.epoch = epoch


class _CommitRejected(Exception):
    """COMMIT failed for a reason of the handler's writes, not of the connection."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


@dataclasses.dataclass
class Processor:
    """Runs the protocol for the deliveries of one handler subscription.

    Besides :meth:`handle` and :meth:`retry_parked`, the batch path
    (:class:`eop.protocol.batch.BatchProcessor`) settles what its shared
    transaction cannot through a small API of this class's: :meth:`handler_failed`
    (a handler failed in the batch's savepoint), :meth:`resolve_ambiguous` (the
    batch's COMMIT may or may not have gone through), :meth:`ack_processed` (the
    acks of a committed batch), :attr:`in_contention` and :meth:`note_contention`
    (run one message at a time after a deadlock), and the module's
    :func:`transient` and :func:`contention`, which classify its failures. The
    due retries of one poll (:class:`eop.protocol.retry_batch.RetryBatch`) use
    :meth:`retry_delay`, :meth:`settle`, :meth:`parked_again`, :meth:`left` and
    :meth:`nak` to settle what their shared transaction decided.
    """

    spec: HandlerSpec
    settings: Settings
    store: inbox.Store
    epochs: Epochs
    critical: Critical = dataclasses.field(default_factory=Critical)
    clock: Callable[[], float] = time.monotonic
    observer: observe.Observer = observe.NOOP
    acker: ack.Acker | None = None
    """Confirms a batch's acks together; None: one ``ack_sync`` per message."""
    leases: leases.Leases = dataclasses.field(default_factory=leases.Leases)
    """Where the leases of the deliveries it holds are renewed: the worker's, which holds
    them from their fetch (a processor of its own otherwise, on the default :attr:`clock`)."""
    suspects: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    """Held by a redelivered message while it runs: one at a time in the process (the
    worker shares one among its handlers), so a message that kills the process is the
    only one whose run that death counts."""
    stopping: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    """Set when the worker stops: a message waiting to retry is handed back at once."""
    misconfigured: misconfiguration.Watch = dataclasses.field(
        default_factory=misconfiguration.Watch
    )
    """The process's count of failures only a change of configuration ends (one per worker)."""
    contended: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    """Held by a transaction retried after a deadlock or lock timeout (see :meth:`_retrying`)."""
    contention_until: float = 0.0
    """Until then (on :attr:`clock`), every transaction runs under :attr:`contended`."""
    batches_failing: bool = False
    """Whether the last batch had a handler fail: the next batch runs with savepoints at
    once (:class:`eop.protocol.batch.BatchProcessor`, made anew for each batch, keeps it
    here). In a flood of failing messages every batch would otherwise run twice (without
    savepoints, rolled back, then with them); a batch whose handlers all succeed goes
    back to the cheaper first pass."""

    @property
    def in_contention(self) -> bool:
        """Whether a deadlock or lock timeout happened within the last few seconds."""
        return self.clock() < self.contention_until

    def note_contention(self) -> None:
        """A transaction deadlocked or timed out on a lock: run one at a time for a while."""
        self.contention_until = self.clock() + _CONTENTION_WINDOW_S

    @property
    def max_attempts(self) -> int:
        """Handler failures before a failing message is dead-lettered."""
        return self.spec.max_attempts or self.settings.max_attempts

    @property
    def parks(self) -> bool:
        """Whether failed messages wait for their retry in the database (not ordered ones:
        a key's later messages must wait behind its retried one: :mod:`eop.protocol.ordering`)."""
        return self.spec.order_by is None

    @property
    def ack_wait_s(self) -> float:
        """The lease of one delivery."""
        return self.spec.ack_wait_s or self.settings.ack_wait_s

    async def handle(self, delivery: Delivery, received_at: float) -> Outcome:
        """Process one delivery fetched at ``received_at`` (on :attr:`clock`)."""
        await faults.point("after_fetch")
        meta = delivery.metadata
        logger = log.LazyLogger(
            handler=self.spec.name,
            stream=meta.stream,
            seq=meta.sequence.stream,
            delivered=meta.num_delivered,
        )
        epoch = await self.epochs.epoch_of(meta.stream, meta.timestamp)
        if epoch is None:
            # Stored before the stream's current incarnation: that stream, and
            # this message with it, were deleted; it cannot even be acked.
            logger.warning(log.Event.MESSAGE_STREAM_GONE, action=log.Action.LEFT)
            return self.left(delivery)
        msg = message.from_nats(delivery, subscription=self.spec.name, stream_epoch=epoch)
        remaining = self.ack_wait_s - (self.clock() - self.leases.renewed_at(delivery, received_at))
        if remaining < self.settings.lease_margin_s:
            # The server may already have handed this message to someone else.
            logger.info(log.Event.MESSAGE_LEASE_SPENT, action=log.Action.LEFT, lease_s=remaining)
            return self.left(delivery)
        problem = message.undecodable(delivery)
        if problem is not None:
            # Bytes that are not UTF-8 in its subject or a header: no handler can
            # be given the message as it was published, on this or any delivery.
            dead = inbox.DeadLetter(reason=models.REASON_UNDECODABLE, error=problem)
            return await self._retrying(
                delivery, lambda m: self._dead_letter(delivery, m, dead, logger), msg, logger
            )
        if msg.num_delivered > 1:
            # Maybe a crash loop: its run is counted before it starts, and it runs
            # alone, so that a message killing its process does not take the runs
            # of others with it (docs/design.md, 'Crash loops').
            counted: list[int] = []
            return await self._claiming(
                delivery,
                lambda m: self._suspect(delivery, m, logger, counted),
                msg,
                logger,
                contended=self.in_contention,
            )
        return await self._claiming(
            delivery,
            lambda m: self._attempt(delivery, m, logger),
            msg,
            logger,
            contended=self.in_contention,
        )

    async def retry_parked(self, delivery: retries.ParkedDelivery) -> Outcome:
        """Run a parked message again (taken from the retries table by the retry loop)."""
        msg = delivery.message
        logger = log.LazyLogger(
            handler=self.spec.name, stream=msg.stream, seq=msg.seq, attempt=msg.num_delivered
        )
        return await self._retrying(
            delivery, lambda m: self._rerun(delivery, m, logger), msg, logger
        )

    async def _claiming(
        self,
        delivery: Delivery,
        step: Callable[[message.Message], Awaitable[Outcome]],
        msg: message.Message,
        logger: log.Logger,
        *,
        contended: bool = False,
    ) -> Outcome:
        """:meth:`_retrying`; a message whose inbox row is refused is dead-lettered on its own."""
        try:
            return await self._retrying(delivery, step, msg, logger, contended=contended)
        except errors.UnclaimableMessage as exc:
            dead = inbox.DeadLetter(reason=models.REASON_UNDECODABLE, error=str(exc))
            # Not caught again: if even the row without the msg-id is refused, the
            # message cannot have an outcome, and the worker naks it.
            return await self._retrying(
                delivery,
                lambda m: self._dead_letter(delivery, m, dead, logger, msg_id_guard=False),
                msg,
                logger,
            )

    async def _retrying(
        self,
        delivery: Delivery,
        step: Callable[[message.Message], Awaitable[Outcome]],
        msg: message.Message,
        logger: log.Logger,
        *,
        contended: bool = False,
    ) -> Outcome:
        """Run a transactional step, retrying it whole after a failure of the database.

        The retries go on, with jittered backoff, until the step succeeds or
        the worker stops (then the message is handed back at once, for
        another worker): none of them counts as an attempt of the message.

        A step that deadlocked or timed out on a lock is retried under
        :attr:`contended`, one at a time in this process: handlers that lock
        the same rows in different orders would otherwise keep deadlocking
        each other (PostgreSQL needs ``deadlock_timeout``, one second by
        default, to break each cycle), and hot rows admit one writer anyway.
        """
        attempt = 0
        while True:
            try:
                if not contended:
                    return await step(msg)
                async with self.contended:
                    return await step(msg)
            except _EpochChanged as changed:
                msg = dataclasses.replace(msg, stream_epoch=changed.epoch)
                continue
            except errors.ClaimTimeout:
                # Another delivery of this message holds its key: it settles it.
                logger.info(log.Event.MESSAGE_CLAIM_TIMEOUT, action=log.Action.NAK)
                return await self.nak(delivery, msg, None, logger)
            except Exception as exc:
                if not transient(exc):
                    raise
                # A misconfiguration retried for ever would stall without a word.
                self.misconfigured.note(exc, f"handler {self.spec.name!r}", self.settings)
                if contention(exc):
                    contended = True
                    self.note_contention()
                attempt += 1
                delay_s = backoff.jittered_s(
                    attempt, self.settings.backoff_base_s, self.settings.backoff_max_s
                )
                # Quiet while it is a blip, loud once it lasts.
                level = logger.info if attempt < 5 else logger.warning
                level(log.Event.TRANSACTION_RETRY, attempt=attempt, error=describe(exc)[:500])
                # The lease is renewed while the message waits: an outage of any
                # length costs it no redelivery.
                async with self.leases.keep([delivery], self.ack_wait_s):
                    stopped = await backoff.stopped_within(self.stopping, delay_s)
                if stopped:
                    return await self.nak(delivery, msg, 0.0, logger)

    async def _suspect(
        self, delivery: Delivery, msg: message.Message, logger: log.Logger, counted: list[int]
    ) -> Outcome:
        """A redelivered message: count its run (once, however often the step is retried
        for the database), committed before the handler starts; dead-letter it as a crash
        loop past ``max_deliveries`` runs without an outcome, else attempt it."""
        if not counted:
            # Most redeliveries are done already (acked out of order above the ack floor
            # before a handover or a crash): settled without a count or the wait.
            async with self.store.transaction(self.spec) as tx:
                existing = await tx.find(msg)
                await tx.rollback()
            if existing is not None:
                return await self._not_claimed(delivery, msg, existing, logger)
        # Held for the run only: a retry's backoff (an outage, a lock held elsewhere)
        # must not keep the process's other redeliveries waiting.
        async with self.suspects:
            if not counted:
                async with self.store.transaction(self.spec) as tx:
                    runs = await tx.count_run(msg)
                    await tx.commit()
                counted.append(runs)
            if counted[0] > self.settings.max_deliveries:
                dead = crash_loop(counted[0], self.settings.max_deliveries)
                return await self._dead_letter(delivery, msg, dead, logger)
            return await self._attempt(delivery, msg, logger)

    async def _attempt(
        self, delivery: Delivery, msg: message.Message, logger: log.Logger
    ) -> Outcome:
        async with self.store.transaction(self.spec) as tx:
            if not await _claim(tx, msg, models.OUTCOME_PROCESSED):
                existing = await tx.find(msg)
                await tx.rollback()
                return await self._not_claimed(delivery, msg, existing, logger)
            await faults.point("after_claim")

            async def run() -> None:
                async with self.leases.keep([delivery], self.ack_wait_s):
                    await tx.run(msg)
                    await faults.point("mid_handler")
                if msg.num_delivered > 1:
                    # Its runs were counted (and an ordered handler's failures, for its
                    # nak'ed retries).
                    await tx.forget_failures(msg)

            result = await self._run_and_commit(tx, delivery, msg, run, logger)
        if isinstance(result, Outcome):
            return result
        return await self.handler_failed(delivery, msg, result, logger)

    async def _rerun(
        self, delivery: retries.ParkedDelivery, msg: message.Message, logger: log.Logger
    ) -> Outcome:
        """A parked message's run: the ``retrying`` row is its claim, locked for this run.

        The handler runs in a savepoint: when it fails (as a parked message
        mostly does), its failure is counted, and the message parked again or
        dead-lettered, in this same transaction, still holding the run's lock,
        instead of in a second one. Only once it succeeded does the
        ``retrying`` row take its outcome.
        """
        async with self.store.transaction(self.spec) as tx:
            if not await tx.lock_run(msg, delivery.runs):
                # A later run took it (this one outlived its lease), or it settled.
                await tx.rollback()
                return self.left(delivery)
            if delivery.runs > delivery.failures + self.settings.max_deliveries:
                await tx.rollback()
                dead = crash_loop(delivery.runs - delivery.failures, self.settings.max_deliveries)
                return await self._dead_letter(delivery, msg, dead, logger)
            failed = await tx.run_isolated([msg])
            if failed is not None:
                self.observer.failed(self.spec, delivery, failed)
                return await self._settle_failure(tx, delivery, msg, failed, logger)
            if not await tx.settle_retrying(msg, models.OUTCOME_PROCESSED):
                await tx.rollback()
                return self.left(delivery)
            await tx.forget_failures(msg)
            try:
                return await self.critical.run(
                    self._commit_and_settle(tx, delivery, msg, Outcome.PROCESSED, logger)
                )
            except _CommitRejected as rejected:
                # A deferred constraint of the handler's writes: its failure.
                await tx.rollback()
                result = rejected.error
        return await self.handler_failed(delivery, msg, result, logger)

    def left(self, delivery: Delivery) -> Outcome:
        """Nothing is settled here: another run or delivery settles the message, or its lease
        ends and the server delivers it again."""
        self.observer.outcome(observe.Settled(self.spec, delivery, Outcome.LEFT))
        return Outcome.LEFT

    async def _run_and_commit(
        self,
        tx: inbox.Transaction,
        delivery: Delivery,
        msg: message.Message,
        run: Callable[[], Awaitable[None]],
        logger: log.Logger,
    ) -> Outcome | Exception:
        """Run the handler in its claimed transaction, COMMIT, settle; or the handler's failure.

        A database failure is raised (:func:`transient`: retried, never counted);
        the handler's own, or its writes refused at COMMIT, is returned for
        :meth:`handler_failed`, once the transaction is rolled back.
        """
        try:
            await run()
        except Exception as exc:
            await tx.rollback()
            if transient(exc):
                raise
            return exc
        try:
            return await self.critical.run(
                self._commit_and_settle(tx, delivery, msg, Outcome.PROCESSED, logger)
            )
        except _CommitRejected as rejected:
            # A deferred constraint or the handler's last writes failed at
            # COMMIT: the handler's failure, settled like any other.
            await tx.rollback()
            return rejected.error

    async def _commit_and_settle(
        self,
        tx: inbox.Transaction,
        delivery: Delivery,
        msg: message.Message,
        outcome: Outcome,
        logger: log.Logger,
        dead: inbox.DeadLetter | None = None,
    ) -> Outcome:
        """COMMIT, then tell the server (ack or term); the section a stop must not cut."""
        await faults.point("before_commit")
        try:
            await tx.commit()
        except errors.AmbiguousCommit:
            return await self.resolve_ambiguous(delivery, msg, outcome, logger, dead)
        except Exception as exc:
            if outcome is Outcome.PROCESSED and not transient(exc):
                raise _CommitRejected(exc) from exc
            raise
        await faults.point("after_commit")
        return await self.settle(delivery, outcome, logger, dead)

    async def settle(
        self,
        delivery: Delivery,
        outcome: Outcome,
        logger: log.Logger,
        dead: inbox.DeadLetter | None,
        **extra: Any,
    ) -> Outcome:
        """Ack a processed message, term a dead-lettered or quarantined one, and log it."""
        if outcome is Outcome.PROCESSED:
            committed_at = time.perf_counter()
            acked = await self._ack(delivery, logger)
            # Per message at debug: the worker logs one info line per batch.
            logger.debug(log.Event.MESSAGE_PROCESSED, action=log.Action.ACK, **extra)
            self.observer.outcome(
                observe.Settled(
                    self.spec,
                    delivery,
                    outcome,
                    ack_s=time.perf_counter() - committed_at,
                    acked=acked,
                )
            )
            return outcome
        await ack.term(delivery, logger)
        assert dead is not None
        self.observer.outcome(observe.Settled(self.spec, delivery, outcome, reason=dead.reason))
        if outcome is Outcome.QUARANTINED:
            logger.error(log.Event.MESSAGE_QUARANTINED, action=log.Action.TERM, alarm=True, **extra)
        else:
            logger.warning(
                log.Event.MESSAGE_DEAD_LETTERED,
                action=log.Action.TERM,
                reason=dead.reason,
                error=dead.error[:500],
                **extra,
            )
        return outcome

    async def resolve_ambiguous(
        self,
        delivery: Delivery,
        msg: message.Message,
        outcome: Outcome,
        logger: log.Logger,
        dead: inbox.DeadLetter | None,
    ) -> Outcome:
        """The connection died during the COMMIT of ``msg``'s ``outcome``: read it back.

        Never settle blindly, never re-run here: committed (this very message
        has its outcome), it is settled as ``outcome``; not visible, it is
        nak'ed and its redelivery's claim decides; unreadable, it is left to
        its lease.
        """
        logger.warning(log.Event.COMMIT_AMBIGUOUS)
        for attempt in range(3):
            try:
                committed = await self.store.has_outcome(self.spec, msg)
            except Exception as exc:
                if not transient(exc):
                    raise
                await asyncio.sleep(backoff.backoff_s(attempt + 1, 0.2, 0.8))
                continue
            if committed:
                return await self.settle(delivery, outcome, logger, dead, ambiguous=True)
            # Not visible: it rolled back, or it is still settling; either way the
            # redelivery's claim decides, and it cannot apply the effect twice.
            return await self.nak(delivery, msg, None, logger)
        logger.warning(log.Event.MESSAGE_LEASE_SPENT, action=log.Action.LEFT, ambiguous=True)
        return self.left(delivery)

    async def _not_claimed(
        self,
        delivery: Delivery,
        msg: message.Message,
        existing: inbox.Existing | None,
        logger: log.Logger,
    ) -> Outcome:
        if existing is None:
            # The conflicting row vanished between the claim and the look-up.
            raise errors.TransactionConflict()
        if existing.by == "key" and existing.fingerprint != msg.fingerprint:
            await self.epochs.refresh(msg.stream)
            epoch = await self.epochs.epoch_of(msg.stream, msg.timestamp)
            if epoch is not None and epoch != msg.stream_epoch:
                logger.warning(log.Event.STREAM_EPOCH_CHANGED)
                raise _EpochChanged(epoch)
            return await self._quarantine(delivery, msg, logger)
        await self._ack(delivery, logger)
        logger.info(
            log.Event.MESSAGE_DUPLICATE,
            action=log.Action.ACK,
            by=existing.by,
            outcome=existing.outcome,
        )
        self.observer.outcome(observe.Settled(self.spec, delivery, Outcome.DUPLICATE))
        return Outcome.DUPLICATE

    async def handler_failed(
        self, delivery: Delivery, msg: message.Message, exc: Exception | None, logger: log.Logger
    ) -> Outcome:
        """The handler raised ``exc`` (not a failure of the database), in a transaction
        rolled back since (or, in a batch, its savepoint): settle the failure in a
        transaction of its own (:meth:`_settle_failure`)."""
        assert exc is not None
        self.observer.failed(self.spec, delivery, exc)

        async def settle(m: message.Message) -> Outcome:
            async with self.store.transaction(self.spec) as tx:
                return await self._settle_failure(tx, delivery, m, exc, logger)

        return await self._retrying(delivery, settle, msg, logger)

    async def _settle_failure(
        self,
        tx: inbox.Transaction,
        delivery: Delivery,
        msg: message.Message,
        exc: Exception,
        logger: log.Logger,
    ) -> Outcome:
        """In ``tx``: dead-letter a rejected message, else count the failure; dead-letter at
        ``max_attempts``, else retry. COMMIT, then settle with the server.

        The retry is parked (acked, held in the retries table) unless the
        handler is ordered, whose retry is a nak'ed redelivery. The traceback
        is formatted only for a dead letter: with its source lines and markers
        it costs more than the rest of a failure's handling.
        """
        if isinstance(exc, errors.Reject):
            return await self._dead_letter_in(tx, delivery, msg, rejected(exc), logger)
        parked_run = isinstance(delivery, retries.ParkedDelivery)
        expected = delivery.failures + 1 if isinstance(delivery, retries.ParkedDelivery) else 1
        error = describe(exc)
        delay_s = self.retry_delay(exc, expected)
        failures = await tx.count_failure(
            msg, error, parked=self.parks, due_in_s=delay_s if self.parks else 0.0
        )
        if failures >= self.max_attempts:
            return await self._dead_letter_in(tx, delivery, msg, exhausted(exc, error), logger)
        if failures != expected:
            # Counted elsewhere too (an overlapping delivery): back off by the real count.
            delay_s = self.retry_delay(exc, failures)
            if self.parks:
                await tx.reschedule(msg, delay_s)
        if not self.parks:
            with contextlib.suppress(errors.AmbiguousCommit):
                # Counted or not, the nak below is right: at worst one failure
                # goes uncounted.
                await self.critical.run(tx.commit())
            logger.info(
                log.Event.MESSAGE_RETRY, action=log.Action.NAK, failures=failures, error=error
            )
            return await self.nak(delivery, msg, delay_s, logger)
        if not parked_run and not await _claim(tx, msg, models.OUTCOME_RETRYING):
            existing = await tx.find(msg)
            await tx.rollback()
            return await self._not_claimed(delivery, msg, existing, logger)
        return await self.critical.run(self._commit_and_park(tx, delivery, msg, logger))

    def retry_delay(self, exc: Exception, failures: int) -> float:
        """Seconds until the next run of a message whose handler failed ``failures`` times,
        the last with ``exc``: its ``eop.Retry``'s delay, else the backoff."""
        if isinstance(exc, errors.Retry) and exc.delay_s is not None:
            return exc.delay_s
        return backoff.backoff_s(
            failures, self.settings.backoff_base_s, self.settings.backoff_max_s
        )

    async def _commit_and_park(
        self, tx: inbox.Transaction, delivery: Delivery, msg: message.Message, logger: log.Logger
    ) -> Outcome:
        """COMMIT the parked retry, then ack: the retries table holds the message now."""
        try:
            await tx.commit()
        except errors.AmbiguousCommit:
            # Parked or not: a redelivery finds the retrying row (and is acked), or
            # finds nothing and runs the message again. Both settle it once.
            return await self.nak(delivery, msg, None, logger)
        if not isinstance(delivery, retries.ParkedDelivery):
            await self._ack(delivery, logger)
        return self.parked_again(delivery, logger)

    def parked_again(
        self, delivery: Delivery, logger: log.Logger, *, in_batch: bool = False
    ) -> Outcome:
        """The parking of a failed message committed (and a fetched one was acked): log it,
        at debug ``in_batch`` (the worker logs one info line per batch, counting it)."""
        (logger.debug if in_batch else logger.info)(log.Event.MESSAGE_RETRY, action=log.Action.PARK)
        self.observer.outcome(observe.Settled(self.spec, delivery, Outcome.RETRY))
        return Outcome.RETRY

    async def _dead_letter(
        self,
        delivery: Delivery,
        msg: message.Message,
        dead: inbox.DeadLetter,
        logger: log.Logger,
        *,
        msg_id_guard: bool = True,
    ) -> Outcome:
        spec = self.spec if msg_id_guard else dataclasses.replace(self.spec, msg_id_guard=False)
        async with self.store.transaction(spec) as tx:
            return await self._dead_letter_in(tx, delivery, msg, dead, logger)

    async def _dead_letter_in(
        self,
        tx: inbox.Transaction,
        delivery: Delivery,
        msg: message.Message,
        dead: inbox.DeadLetter,
        logger: log.Logger,
    ) -> Outcome:
        """Dead-letter ``msg`` in ``tx``: its inbox row (a claim, or its retrying row), the
        dead letter, no failure count left; COMMIT and term."""
        if isinstance(delivery, retries.ParkedDelivery):
            marked = await tx.settle_retrying(msg, models.OUTCOME_DEAD_LETTERED)
            if not marked:
                await tx.rollback()
                return self.left(delivery)
        elif not await _claim(tx, msg, models.OUTCOME_DEAD_LETTERED):
            existing = await tx.find(msg)
            await tx.rollback()
            return await self._not_claimed(delivery, msg, existing, logger)
        await tx.forget_failures(msg)
        await tx.add_dead_letter(msg, dead)
        return await self.critical.run(
            self._commit_and_settle(tx, delivery, msg, Outcome.DEAD_LETTERED, logger, dead)
        )

    async def _quarantine(
        self, delivery: Delivery, msg: message.Message, logger: log.Logger
    ) -> Outcome:
        """The sequence was reused for another message: keep it as a dead letter, alarm."""
        dead = inbox.DeadLetter(
            reason=models.REASON_SEQUENCE_REUSED,
            error=f"stream {msg.stream} sequence {msg.seq} (epoch {msg.stream_epoch}) was "
            "already processed with a different fingerprint: the stream was recreated "
            "without a new epoch, or the server lost its tail",
        )
        async with self.store.transaction(self.spec) as tx:
            await tx.add_dead_letter(msg, dead)
            return await self.critical.run(
                self._commit_and_settle(tx, delivery, msg, Outcome.QUARANTINED, logger, dead)
            )

    async def _ack(self, delivery: Delivery, logger: log.Logger) -> bool:
        await faults.point("during_ack")
        acked = await ack.confirm(
            delivery,
            timeout_s=self.settings.ack_timeout_s,
            give_up_s=self.settings.ack_give_up_s,
            logger=logger,
        )
        await faults.point("after_ack")
        return acked

    async def ack_processed(
        self, deliveries: list[Delivery], loggers: Sequence[log.Logger]
    ) -> None:
        """Confirmed acks of a committed batch, together when an :class:`ack.Acker` is set."""
        if self.acker is None:
            await asyncio.gather(
                *(
                    self.settle(d, Outcome.PROCESSED, lg, None)
                    for d, lg in zip(deliveries, loggers, strict=True)
                )
            )
            return
        committed_at = time.perf_counter()
        acked = await self.acker.confirm_many(
            deliveries,
            loggers,
            timeout_s=self.settings.ack_timeout_s,
            give_up_s=self.settings.ack_give_up_s,
        )
        ack_s = time.perf_counter() - committed_at
        for delivery, logger, ok in zip(deliveries, loggers, acked, strict=True):
            await faults.point("after_ack")
            logger.debug(log.Event.MESSAGE_PROCESSED, action=log.Action.ACK)
            self.observer.outcome(
                observe.Settled(self.spec, delivery, Outcome.PROCESSED, ack_s=ack_s, acked=ok)
            )

    async def nak(
        self, delivery: Delivery, msg: message.Message, delay_s: float | None, logger: log.Logger
    ) -> Outcome:
        """Hand the delivery back, to come again in ``delay_s`` (None: the backoff of its
        delivery count); a parked run has nothing to hand back, its lease does."""
        if delay_s is None:
            delay_s = backoff.backoff_s(
                msg.num_delivered, self.settings.backoff_base_s, self.settings.backoff_max_s
            )
        await ack.nak(delivery, delay_s, logger)
        self.observer.outcome(observe.Settled(self.spec, delivery, Outcome.RETRY))
        return Outcome.RETRY


async def _claim(tx: inbox.Transaction, msg: message.Message, outcome: str) -> bool:
    try:
        return await tx.claim(msg, outcome)
    except Exception as exc:
        if failures.classify(exc) is failures.DbFailure.LOCK_TIMEOUT:
            raise errors.ClaimTimeout() from exc
        if failures.refuses_values(exc):
            raise errors.UnclaimableMessage(
                f"the inbox refuses this message's row: {describe(exc)}"
            ) from exc
        raise


def transient(exc: BaseException) -> bool:
    """Failures of the database (:func:`eop.pg.failures.transient`): retried here, never counted."""
    return failures.transient(exc)


# How long after a deadlock or lock timeout a handler's transactions run one at a
# time in a process. Long enough to drain a burst of crossing transactions,
# short enough that a one-off deadlock costs little parallelism.
_CONTENTION_WINDOW_S = 5.0


def contention(exc: BaseException) -> bool:
    """A deadlock, a serialization failure or a lock timeout: transactions in each other's way."""
    if isinstance(exc, errors.TransactionConflict):
        return True
    return failures.classify(exc) in (failures.DbFailure.CONFLICT, failures.DbFailure.LOCK_TIMEOUT)


def rejected(exc: errors.Reject) -> inbox.DeadLetter:
    """The dead letter of a message its handler rejected (``eop.Reject``, or undecodable)."""
    undecodable = isinstance(exc, errors.UndecodableMessage)
    return inbox.DeadLetter(
        reason=models.REASON_UNDECODABLE if undecodable else models.REASON_REJECTED,
        error=describe(exc),
        traceback=log.format_traceback(exc),
    )


def exhausted(exc: Exception, error: str) -> inbox.DeadLetter:
    """The dead letter of a message whose handler failed ``max_attempts`` times, the last
    with ``exc`` (described as ``error``)."""
    return inbox.DeadLetter(
        reason=models.REASON_ATTEMPTS_EXHAUSTED, error=error, traceback=log.format_traceback(exc)
    )


def crash_loop(runs: int, bound: int) -> inbox.DeadLetter:
    """The dead letter of a message run ``runs`` times without an outcome (``max_deliveries``
    is ``bound``)."""
    return inbox.DeadLetter(
        reason=models.REASON_CRASH_LOOP,
        error=f"run {runs} times without an outcome (max_deliveries={bound}): its worker "
        "died or lost its lease in every attempt",
    )


def describe(exc: BaseException) -> str:
    """A failure as a dead letter or a parked retry records it (bounded)."""
    return log.describe_error(exc)[:2000]
