"""The per-message protocol of design.md section 2.

Claim first, run the handler in the same transaction, COMMIT, then the
confirmed ack; every failure lands in exactly one committed outcome (the
handler's writes or a dead letter, each with its inbox row) or in a
redelivery that will find one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import enum
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from eop import ack, errors, faults, inbox, log, message, models, observe
from eop.handler import HandlerSpec
from eop.settings import Settings

T = TypeVar("T")


class Outcome(enum.Enum):
    """What became of one delivery."""

    PROCESSED = "processed"
    DUPLICATE = "duplicate"
    DEAD_LETTERED = "dead_lettered"
    QUARANTINED = "quarantined"
    RETRY = "retry"
    LEFT = "left_for_redelivery"


class Epochs(Protocol):
    """Where the processor learns which epoch of a stream a message belongs to."""

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
    """Runs the protocol for the deliveries of one handler subscription."""

    spec: HandlerSpec
    settings: Settings
    store: inbox.Store
    epochs: Epochs
    critical: Critical = dataclasses.field(default_factory=Critical)
    clock: Callable[[], float] = time.monotonic
    observer: observe.Observer = observe.NOOP
    acker: ack.Acker | None = None
    """Confirms a batch's acks together; None: one ``ack_sync`` per message."""

    @property
    def max_attempts(self) -> int:
        """Deliveries before a failing message is dead-lettered."""
        return self.spec.max_attempts or self.settings.max_attempts

    @property
    def ack_wait_s(self) -> float:
        """The lease of one delivery."""
        return self.spec.ack_wait_s or self.settings.ack_wait_s

    async def handle(self, delivery: ack.Delivery, received_at: float) -> Outcome:
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
            self.observer.outcome(self.spec, delivery, Outcome.LEFT)
            return Outcome.LEFT
        msg = message.from_nats(delivery, subscription=self.spec.name, stream_epoch=epoch)
        remaining = self.ack_wait_s - (self.clock() - received_at)
        if remaining < self.settings.lease_margin_s:
            # The server may already have handed this message to someone else.
            logger.info(log.Event.MESSAGE_LEASE_SPENT, action=log.Action.LEFT, lease_s=remaining)
            self.observer.outcome(self.spec, delivery, Outcome.LEFT)
            return Outcome.LEFT
        if msg.num_delivered > self.max_attempts:
            # Earlier deliveries ended without an outcome: the worker died in them.
            dead = inbox.DeadLetter(
                reason=models.REASON_ATTEMPTS_EXHAUSTED,
                error=f"delivered {msg.num_delivered} times without an outcome "
                f"(max_attempts={self.max_attempts}); earlier attempts crashed or timed out",
            )
            return await self._retrying(
                delivery, lambda m: self._dead_letter(delivery, m, dead, logger), msg, logger
            )
        return await self._retrying(
            delivery, lambda m: self._attempt(delivery, m, logger), msg, logger
        )

    async def _retrying(
        self,
        delivery: ack.Delivery,
        step: Callable[[message.Message], Awaitable[Outcome]],
        msg: message.Message,
        logger: Any,
    ) -> Outcome:
        """Run a transactional step, retrying it whole on conflicts and lost connections.

        When the retries run out, the message is nak'ed: its redelivery starts
        the protocol again from the claim.
        """
        attempt = 0
        while True:
            try:
                return await step(msg)
            except _EpochChanged as changed:
                msg = dataclasses.replace(msg, stream_epoch=changed.epoch)
                continue
            except errors.ClaimTimeout:
                logger.info(log.Event.MESSAGE_CLAIM_TIMEOUT, action=log.Action.NAK)
                return await self._nak(delivery, msg, None, logger)
            except Exception as exc:
                if not _transient(exc):
                    raise
                if attempt >= self.settings.tx_retries:
                    logger.warning(
                        log.Event.MESSAGE_RETRY, action=log.Action.NAK, error=_describe(exc)
                    )
                    return await self._nak(delivery, msg, None, logger)
                attempt += 1
                logger.info(log.Event.TRANSACTION_RETRY, attempt=attempt, error=_describe(exc))
                await asyncio.sleep(min(0.05 * 2**attempt, 2.0))

    async def _attempt(self, delivery: ack.Delivery, msg: message.Message, logger: Any) -> Outcome:
        failure: Exception | None = None
        async with self.store.transaction(self.spec) as tx:
            if not await _claim(tx, msg, models.OUTCOME_PROCESSED):
                existing = await tx.find(msg)
                await tx.rollback()
                return await self._not_claimed(delivery, msg, existing, logger)
            await faults.point("after_claim")
            try:
                async with ack.heartbeat(delivery, self.ack_wait_s / 3, logger):
                    await tx.run(msg)
                    await faults.point("mid_handler")
            except Exception as exc:
                await tx.rollback()
                if _transient(exc):
                    raise
                failure = exc
            else:
                try:
                    return await self.critical.run(
                        self._commit_and_settle(tx, delivery, msg, Outcome.PROCESSED, logger)
                    )
                except _CommitRejected as rejected:
                    # A deferred constraint or the handler's last writes failed at
                    # COMMIT: the handler's failure, settled like any other.
                    await tx.rollback()
                    failure = rejected.error
        return await self._handler_failed(delivery, msg, failure, logger)

    async def _commit_and_settle(
        self,
        tx: inbox.Transaction,
        delivery: ack.Delivery,
        msg: message.Message,
        outcome: Outcome,
        logger: Any,
        dead: inbox.DeadLetter | None = None,
    ) -> Outcome:
        """COMMIT, then tell the server (ack or term); the section a stop must not cut."""
        await faults.point("before_commit")
        try:
            await tx.commit()
        except errors.AmbiguousCommit:
            return await self._resolve_ambiguous(delivery, msg, outcome, logger, dead)
        except Exception as exc:
            if outcome is Outcome.PROCESSED and not _transient(exc):
                raise _CommitRejected(exc) from exc
            raise
        await faults.point("after_commit")
        return await self._settle(delivery, outcome, logger, dead)

    async def _settle(
        self,
        delivery: ack.Delivery,
        outcome: Outcome,
        logger: Any,
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
                self.spec,
                delivery,
                outcome,
                ack_s=time.perf_counter() - committed_at,
                acked=acked,
            )
            return outcome
        await ack.term(delivery, logger)
        assert dead is not None
        self.observer.outcome(self.spec, delivery, outcome, reason=dead.reason)
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

    async def _resolve_ambiguous(
        self,
        delivery: ack.Delivery,
        msg: message.Message,
        outcome: Outcome,
        logger: Any,
        dead: inbox.DeadLetter | None,
    ) -> Outcome:
        """The connection died during COMMIT: never settle blindly, never re-run here."""
        logger.warning(log.Event.COMMIT_AMBIGUOUS)
        for attempt in range(3):
            try:
                committed = await self.store.has_outcome(self.spec, msg)
            except Exception as exc:
                if not _transient(exc):
                    raise
                await asyncio.sleep(0.2 * 2**attempt)
                continue
            if committed:
                return await self._settle(delivery, outcome, logger, dead, ambiguous=True)
            # Not visible: it rolled back, or it is still settling; either way the
            # redelivery's claim decides, and it cannot apply the effect twice.
            return await self._nak(delivery, msg, None, logger)
        logger.warning(log.Event.MESSAGE_LEASE_SPENT, action=log.Action.LEFT, ambiguous=True)
        self.observer.outcome(self.spec, delivery, Outcome.LEFT)
        return Outcome.LEFT

    async def _not_claimed(
        self,
        delivery: ack.Delivery,
        msg: message.Message,
        existing: inbox.Existing | None,
        logger: Any,
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
        self.observer.outcome(self.spec, delivery, Outcome.DUPLICATE)
        return Outcome.DUPLICATE

    async def _handler_failed(
        self, delivery: ack.Delivery, msg: message.Message, exc: Exception | None, logger: Any
    ) -> Outcome:
        assert exc is not None
        self.observer.failed(self.spec, delivery, exc)
        tb = log.format_traceback(exc)
        if isinstance(exc, errors.Reject):
            reason = (
                models.REASON_UNDECODABLE
                if isinstance(exc, errors.UndecodableMessage)
                else models.REASON_REJECTED
            )
            dead = inbox.DeadLetter(reason=reason, error=_describe(exc), traceback=tb)
            return await self._retrying(
                delivery, lambda m: self._dead_letter(delivery, m, dead, logger), msg, logger
            )
        if msg.num_delivered >= self.max_attempts:
            dead = inbox.DeadLetter(
                reason=models.REASON_ATTEMPTS_EXHAUSTED, error=_describe(exc), traceback=tb
            )
            return await self._retrying(
                delivery, lambda m: self._dead_letter(delivery, m, dead, logger), msg, logger
            )
        delay = exc.delay_s if isinstance(exc, errors.Retry) else None
        logger.info(log.Event.MESSAGE_RETRY, action=log.Action.NAK, error=_describe(exc))
        return await self._nak(delivery, msg, delay, logger)

    async def _dead_letter(
        self,
        delivery: ack.Delivery,
        msg: message.Message,
        dead: inbox.DeadLetter,
        logger: Any,
    ) -> Outcome:
        async with self.store.transaction(self.spec) as tx:
            if not await _claim(tx, msg, models.OUTCOME_DEAD_LETTERED):
                existing = await tx.find(msg)
                await tx.rollback()
                return await self._not_claimed(delivery, msg, existing, logger)
            await tx.add_dead_letter(msg, dead)
            return await self.critical.run(
                self._commit_and_settle(tx, delivery, msg, Outcome.DEAD_LETTERED, logger, dead)
            )

    async def _quarantine(
        self, delivery: ack.Delivery, msg: message.Message, logger: Any
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

    async def _ack(self, delivery: ack.Delivery, logger: Any) -> bool:
        await faults.point("during_ack")
        acked = await ack.confirm(
            delivery,
            timeout_s=self.settings.ack_timeout_s,
            give_up_s=self.settings.ack_give_up_s,
            logger=logger,
        )
        await faults.point("after_ack")
        return acked

    async def ack_processed(self, deliveries: list[ack.Delivery], loggers: list[Any]) -> None:
        """Confirmed acks of a committed batch, together when an :class:`ack.Acker` is set."""
        if self.acker is None:
            await asyncio.gather(
                *(
                    self._settle(d, Outcome.PROCESSED, lg, None)
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
            self.observer.outcome(self.spec, delivery, Outcome.PROCESSED, ack_s=ack_s, acked=ok)

    async def _nak(
        self, delivery: ack.Delivery, msg: message.Message, delay_s: float | None, logger: Any
    ) -> Outcome:
        if delay_s is None:
            delay_s = ack.backoff_s(
                msg.num_delivered, self.settings.backoff_base_s, self.settings.backoff_max_s
            )
        await ack.nak(delivery, delay_s, logger)
        self.observer.outcome(self.spec, delivery, Outcome.RETRY)
        return Outcome.RETRY


async def _claim(tx: inbox.Transaction, msg: message.Message, outcome: str) -> bool:
    try:
        return await tx.claim(msg, outcome)
    except Exception as exc:
        if inbox.classify(exc) is inbox.DbFailure.LOCK_TIMEOUT:
            raise errors.ClaimTimeout() from exc
        raise


def _transient(exc: BaseException) -> bool:
    """Errors after which the whole transaction is retried in this process."""
    if isinstance(exc, (errors.TransactionConflict, errors.DatabaseUnavailable)):
        return True
    if isinstance(exc, errors.EopError):
        return False
    return inbox.classify(exc) in (inbox.DbFailure.CONFLICT, inbox.DbFailure.CONNECTION)


def _describe(exc: BaseException) -> str:
    return log.describe_error(exc)[:2000]
