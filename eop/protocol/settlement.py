"""Settlement: how a message's outcome is made durable and told to the server.

Once a transaction has decided a message's outcome, :class:`Settlement` commits
it inside a :class:`Critical` section and settles the delivery: a confirmed ack
for a processed message (together for a committed batch), ``term()`` for a
dead-lettered or quarantined one, a nak for a retry the server redelivers, an
ack for one parked in the retries table. A COMMIT whose outcome is unknown
(the connection died during it) is read back, never settled blindly
(:meth:`Settlement.resolve_ambiguous`). It also writes the outcomes that are
not the handler's: a dead letter, a duplicate acked, a reused sequence
quarantined. What a handler's failure costs is :mod:`eop.protocol.attempts`'s
to decide; it parks, naks or dead-letters the message here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
import time
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol, TypeVar

from eop import backoff, errors, faults, futures, log, message
from eop.broker import ack
from eop.broker.fence import Fence, Readings
from eop.handler import HandlerSpec
from eop.observe import observer as observe
from eop.pg import contract, failures, models, retries
from eop.settings import Settings
from eop.types import Delivery, Outcome

T = TypeVar("T")


class Epochs(Readings, Protocol):
    """Where the protocol learns which epoch of a stream a message belongs to, and the
    readings its settlements rely on (:class:`eop.broker.fence.Readings`).

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
        task.add_done_callback(self._ended)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # Let the section end before the caller's cleanup runs: that cleanup
            # closes the session the section is committing on.
            await asyncio.wait({task})
            raise

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        futures.retrieve(task)  # its caller's, if it still waits; else nobody's

    async def drain(self, within_s: float | None = None) -> int:
        """Wait for every running section, for ``within_s`` at most; how many still run.

        A section that outlives it waits on a server that does not answer (a COMMIT to a
        frozen PostgreSQL): it is left to end by itself. Its message, not acked, comes
        back, and the inbox tells whether its COMMIT took effect.
        """
        loop = asyncio.get_running_loop()
        deadline = None if within_s is None else loop.time() + within_s
        while self._tasks:
            left_s = None if deadline is None else deadline - loop.time()
            if left_s is not None and left_s <= 0:
                break
            await asyncio.wait(list(self._tasks), timeout=left_s)
        return len(self._tasks)


class EpochChanged(Exception):
    """The stream was recreated under the message: retry with the new epoch."""

    def __init__(self, epoch: str) -> None:
        super().__init__(epoch)
        self.epoch = epoch


class CommitRejected(Exception):
    """COMMIT failed for a reason of the handler's writes, not of the connection."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class Settlement:
    """Commits and settles the outcomes of one handler subscription's messages.

    The per-message protocol (:class:`eop.protocol.processor.Processor`), the
    attempt rule (:class:`eop.protocol.attempts.Attempts`) and the two batch
    paths share it: :meth:`commit_and_settle` (run inside :attr:`critical`) and
    :meth:`settle` for an outcome decided in a transaction, :meth:`ack_processed`
    for a committed batch, :meth:`resolve_ambiguous` after a COMMIT of unknown
    outcome; :meth:`nak`, :meth:`left`, :meth:`commit_and_park` and
    :meth:`parked_again` for a message not settled for good; :meth:`dead_letter`
    (:meth:`dead_letter_in` a transaction) and :meth:`not_claimed` (after
    :meth:`end_look_up`) for the outcomes that are not the handler's.
    """

    def __init__(
        self,
        spec: HandlerSpec,
        settings: Settings,
        store: contract.Store,
        epochs: Epochs,
        critical: Critical,
        observer: observe.Observer,
        acker: ack.Acker | None,
    ) -> None:
        self.spec = spec
        self.settings = settings
        self.store = store
        self.epochs = epochs
        self.critical = critical
        self.observer = observer
        self.acker = acker
        """Confirms a batch's acks together; None: one ``ack_sync`` per message."""
        self.fence = Fence(epochs)
        """Lets an ack, nak or term go only for a delivery of its stream's current
        incarnation (a recreated stream's consumer would take it as its own message's)."""

    # -- an outcome decided in a transaction

    async def commit_and_settle(
        self,
        tx: contract.Transaction,
        delivery: Delivery,
        msg: message.Message,
        outcome: Outcome,
        logger: log.Logger,
        dead: contract.DeadLetter | None = None,
    ) -> Outcome:
        """COMMIT, then tell the server (ack or term); the section a stop must not cut, so
        run inside :attr:`critical`. A processed message's writes refused at COMMIT (not
        for the connection) raise :class:`CommitRejected`: the handler's failure."""
        await faults.point("before_commit")
        try:
            await tx.commit()
        except errors.AmbiguousCommit:
            return await self.resolve_ambiguous(delivery, msg, outcome, logger, dead)
        except Exception as exc:
            if outcome is Outcome.PROCESSED and not failures.transient(exc):
                raise CommitRejected(exc) from exc
            raise
        await faults.point("after_commit")
        return await self.settle(delivery, outcome, logger, dead)

    async def settle(
        self,
        delivery: Delivery,
        outcome: Outcome,
        logger: log.Logger,
        dead: contract.DeadLetter | None,
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
        await ack.term(delivery, logger, self.fence)
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
            fence=self.fence,
        )
        ack_s = time.perf_counter() - committed_at
        # Asked once a batch, not once a message: a point nothing arms, a debug line
        # the level drops.
        after_ack, debug = faults.ruled("after_ack"), log.enabled(logging.DEBUG)
        outcome, spec = self.observer.outcome, self.spec
        for delivery, logger, ok in zip(deliveries, loggers, acked, strict=True):
            if after_ack:
                await faults.point("after_ack")
            if debug:
                logger.debug(log.Event.MESSAGE_PROCESSED, action=log.Action.ACK)
            outcome(observe.Settled(spec, delivery, Outcome.PROCESSED, ack_s=ack_s, acked=ok))

    async def resolve_ambiguous(
        self,
        delivery: Delivery,
        msg: message.Message,
        outcome: Outcome,
        logger: log.Logger,
        dead: contract.DeadLetter | None,
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
                if not failures.transient(exc):
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

    # -- not settled for good

    async def nak(
        self, delivery: Delivery, msg: message.Message, delay_s: float | None, logger: log.Logger
    ) -> Outcome:
        """Hand the delivery back, to come again in ``delay_s`` (None: the backoff of its
        delivery count); a parked run has nothing to hand back, its lease does."""
        if delay_s is None:
            delay_s = backoff.backoff_s(
                msg.num_delivered, self.settings.backoff_base_s, self.settings.backoff_max_s
            )
        await ack.nak(delivery, delay_s, logger, self.fence)
        self.observer.outcome(observe.Settled(self.spec, delivery, Outcome.RETRY))
        return Outcome.RETRY

    async def hand_back(self, delivery: Delivery, logger: log.Logger) -> Outcome:
        """The worker stops before this delivery ran (or while its transaction waits to be
        retried): nak'ed at once, for another process to take without waiting, and
        counted as left for redelivery, not as a retry (nothing failed)."""
        await ack.nak(delivery, 0.0, logger, self.fence)
        self.observer.outcome(observe.Settled(self.spec, delivery, Outcome.LEFT))
        return Outcome.LEFT

    def left(self, delivery: Delivery) -> Outcome:
        """Nothing is settled here: another run or delivery settles the message, or its lease
        ends and the server delivers it again."""
        self.observer.outcome(observe.Settled(self.spec, delivery, Outcome.LEFT))
        return Outcome.LEFT

    def parked_again(
        self, delivery: Delivery, logger: log.Logger, *, in_batch: bool = False
    ) -> Outcome:
        """The parking of a failed message committed (and a fetched one was acked): log it,
        at debug ``in_batch`` (the worker logs one info line per batch, counting it)."""
        (logger.debug if in_batch else logger.info)(log.Event.MESSAGE_RETRY, action=log.Action.PARK)
        self.observer.outcome(observe.Settled(self.spec, delivery, Outcome.RETRY))
        return Outcome.RETRY

    async def commit_and_park(
        self, tx: contract.Transaction, delivery: Delivery, msg: message.Message, logger: log.Logger
    ) -> Outcome:
        """COMMIT the parked retry, then ack: the retries table holds the message now (run
        inside :attr:`critical`)."""
        try:
            await tx.commit()
        except errors.AmbiguousCommit:
            # Parked or not: a redelivery finds the retrying row (and is acked), or
            # finds nothing and runs the message again. Both settle it once.
            return await self.nak(delivery, msg, None, logger)
        if not isinstance(delivery, retries.ParkedDelivery):
            await self._ack(delivery, logger)
        return self.parked_again(delivery, logger)

    # -- the outcomes that are not the handler's

    async def dead_letter(
        self,
        delivery: Delivery,
        msg: message.Message,
        dead: contract.DeadLetter,
        logger: log.Logger,
        *,
        msg_id_guard: bool = True,
    ) -> Outcome:
        """Dead-letter ``msg`` in a transaction of its own (without its msg-id in the inbox
        row unless ``msg_id_guard``), COMMIT and term."""
        spec = self.spec if msg_id_guard else dataclasses.replace(self.spec, msg_id_guard=False)
        async with self.store.transaction(spec) as tx:
            return await self.dead_letter_in(tx, delivery, msg, dead, logger)

    async def dead_letter_in(
        self,
        tx: contract.Transaction,
        delivery: Delivery,
        msg: message.Message,
        dead: contract.DeadLetter,
        logger: log.Logger,
    ) -> Outcome:
        """Dead-letter ``msg`` in ``tx``: its inbox row (a claim, or its retrying row), the
        dead letter, no failure count left; COMMIT and term (or, its inbox row taken,
        :meth:`not_claimed`)."""
        if isinstance(delivery, retries.ParkedDelivery):
            marked = await tx.settle_retrying(msg, models.OUTCOME_DEAD_LETTERED)
            if not marked:
                await tx.rollback()
                return self.left(delivery)
        elif not await tx.claim(msg, models.OUTCOME_DEAD_LETTERED):
            existing = await tx.find(msg)
            # It may hold the failure counted for this dead letter (attempts_exhausted):
            # rolled back; a redelivery's counted run is forgotten apart.
            await tx.rollback()
            await self.end_look_up(None, msg, existing)
            return await self.not_claimed(delivery, msg, existing, logger)
        await tx.forget_failures(msg)
        await tx.add_dead_letter(msg, dead)
        return await self.critical.run(
            self.commit_and_settle(tx, delivery, msg, Outcome.DEAD_LETTERED, logger, dead)
        )

    async def end_look_up(
        self,
        tx: contract.Transaction | None,
        msg: message.Message,
        existing: contract.Existing | None,
    ) -> None:
        """End ``tx``, in which ``msg`` was looked up and found as ``existing`` (None: not
        found), before :meth:`not_claimed` settles it: a redelivery found settled forgets
        its run count, in ``tx`` (which wrote nothing) then COMMIT; else ROLLBACK.

        A redelivery's runs are counted in the retries table before it starts
        (``Processor._suspect``), an ordered handler's nak'ed failures too; its
        message having an outcome now (a duplicate by key, msg-id or watermark),
        the count is forgotten with it (docs/design.md, 'The crash-loop bound').
        A parked retry's row stays (:func:`eop.pg.sql.retries.forget_runs`). With
        ``tx`` None (the caller's transaction wrote more, a failure counted, and
        was rolled back) the count is forgotten in a transaction of its own. A
        first delivery forgets nothing: it counted no run, and its duplicates (a
        batch's messages not claimed, a msg-id republished) keep their cost; a
        row another delivery left behind goes with compaction's sweep
        (:func:`eop.pg.sql.retries.forget_runs_below`).
        """
        if existing is None or not _duplicate(msg, existing) or msg.num_delivered <= 1:
            if tx is not None:
                await tx.rollback()
            return
        if tx is None:
            async with self.store.transaction(self.spec) as own:
                await _forget_runs(own, msg)
        else:
            await _forget_runs(tx, msg)

    async def not_claimed(
        self,
        delivery: Delivery,
        msg: message.Message,
        existing: contract.Existing | None,
        logger: log.Logger,
    ) -> Outcome:
        """The claim of ``msg`` found ``existing`` under its key, msg-id or watermark: ack it
        as a duplicate; quarantine it if its sequence holds another message (raise
        :class:`EpochChanged` if its stream was recreated under it instead)."""
        if existing is None:
            # The conflicting row vanished between the claim and the look-up.
            raise errors.TransactionConflict()
        if not _duplicate(msg, existing):
            await self.epochs.refresh(msg.stream)
            epoch = await self.epochs.epoch_of(msg.stream, msg.timestamp)
            if epoch is not None and epoch != msg.stream_epoch:
                logger.warning(log.Event.STREAM_EPOCH_CHANGED)
                raise EpochChanged(epoch)
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

    async def _quarantine(
        self, delivery: Delivery, msg: message.Message, logger: log.Logger
    ) -> Outcome:
        """The sequence was reused for another message: keep it as a dead letter, alarm."""
        dead = contract.DeadLetter(
            reason=models.REASON_SEQUENCE_REUSED,
            error=f"stream {msg.stream} sequence {msg.seq} (epoch {msg.stream_epoch}) was "
            "already processed with a different fingerprint: the stream was recreated "
            "without a new epoch, or the server lost its tail",
        )
        async with self.store.transaction(self.spec) as tx:
            await tx.add_dead_letter(msg, dead)
            return await self.critical.run(
                self.commit_and_settle(tx, delivery, msg, Outcome.QUARANTINED, logger, dead)
            )

    async def _ack(self, delivery: Delivery, logger: log.Logger) -> bool:
        await faults.point("during_ack")
        acked = await ack.confirm(
            delivery,
            timeout_s=self.settings.ack_timeout_s,
            give_up_s=self.settings.ack_give_up_s,
            logger=logger,
            stopping=self.acker.stopping if self.acker is not None else None,
            gone=self.acker.gone if self.acker is not None else None,
            fence=self.fence,
        )
        await faults.point("after_ack")
        return acked


def _duplicate(msg: message.Message, existing: contract.Existing) -> bool:
    """Whether ``existing`` is ``msg``'s own outcome (by msg-id or watermark, or its key with
    its fingerprint), not another message's under its key (a recreated stream, a reused
    sequence)."""
    return existing.by != "key" or existing.fingerprint == msg.fingerprint


async def _forget_runs(tx: contract.Transaction, msg: message.Message) -> None:
    """Forget ``msg``'s run count in ``tx`` and COMMIT."""
    await tx.forget_runs(msg)
    with contextlib.suppress(errors.AmbiguousCommit):
        # Forgotten or not, the count is of no use any more: compaction's sweep
        # deletes it once the watermark passes its message.
        await tx.commit()


def describe(exc: BaseException) -> str:
    """A failure as a dead letter or a parked retry records it (bounded)."""
    return log.bounded_error(exc)
